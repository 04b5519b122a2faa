"""A Hugging Face checkpoint directory with a model's configuration and tokenizer and seeded
random weights: a model with a real tokenizer (text prompts, as external benchmark clients send)
at a real shape, where the weights themselves cannot travel.

    # where the model's file is: config.json and the tokenizer only (a few MB)
    python scripts/random_checkpoint.py --model smollm2-135m --out .bench_model --no-weights
    # where the model will be served: add random bf16 weights (transformers + torch)
    python scripts/random_checkpoint.py --out .bench_model

The first step needs the model (a built-in, packaged or .gguf name, or a checkpoint dir); the
second only the directory the first wrote. Each step skips what the directory already holds.
"""

from __future__ import annotations

import argparse
import json
import os


def write_config_and_tokenizer(model: str, out: str):
    from forkjax.engine.loading import describe_model
    cfg, tokenizer, (kind, source) = describe_model(model)
    if tokenizer is None or not hasattr(tokenizer, "tok"):
        raise SystemExit(f"{model}: no Hugging Face tokenizer to export")
    config = source.config if kind == "gguf" else json.load(open(os.path.join(source, "config.json")))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tokenizer.tok.save_pretrained(out)


def write_random_weights(out: str, seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the model whose config and tokenizer to copy")
    p.add_argument("--out", required=True)
    p.add_argument("--no-weights", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not os.path.exists(os.path.join(args.out, "config.json")):
        if args.model is None:
            p.error(f"{args.out} has no config.json: give --model")
        write_config_and_tokenizer(args.model, args.out)
    if not args.no_weights and not any(f.endswith(".safetensors") for f in os.listdir(args.out)):
        write_random_weights(args.out, args.seed)
    print(f"{args.out}: {sorted(os.listdir(args.out))}")


if __name__ == "__main__":
    main()
