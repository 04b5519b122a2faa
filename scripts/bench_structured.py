"""Constrained decoding's cost and validity: decode step time with every request under a JSON
schema against the same requests unconstrained, and how many bounded-schema outputs finish.

    PYTHONPATH=. python3 scripts/bench_structured.py --model smollm2-135m --batches 64,256 \\
        --context 1024 --kv-cache-bytes 16e9 --out $OUT/bench_structured.json
    PYTHONPATH=. python3 scripts/bench_structured.py --model tiny-llama --batches 4 --context 64 \\
        --steps 8 --validity 8 --dtype float32          # CPU smoke run

Step time: B requests with distinct random prompts of --context tokens, greedy; once all of them
decode, --steps engine steps are timed (wall clock, each step's results taken in) unconstrained
(EOS ignored) and then under a schema whose string is long enough that none finishes meanwhile.
A constrained step dispatches its forward pass, takes in the step in flight (its masks need
those tokens), builds the masks on the host meanwhile (`mask_s_per_step`, from
`Engine.stats()["guided_mask_s"]`) and applies them in its sampling program. Validity:
--validity requests under bounded random schemas (nested objects, enums, bounded strings and
arrays), at most 200 new tokens, sampled at temperature 1:
the fraction that ends "stop", and of those the fraction whose output validates (`jsonschema`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import forkjax
from forkjax.engine.sequence import SamplingParams, Status
from forkjax.sizes import size_flag
from forkjax.structured_output import json_schema_grammar
from forkjax.workflows.base import TokenSampler

MAX_NEW = 256  # new tokens a timed request may have: more than the timed steps need
# A string far longer than the timed steps can write: no request finishes while they run.
LONG = {"type": "object", "additionalProperties": False, "required": ["text"],
        "properties": {"text": {"type": "string", "minLength": 2000, "maxLength": 4000}}}


def bounded_schema(rng) -> dict:
    leaf = [{"type": "string", "maxLength": 12}, {"enum": ["red", "green", "blue"]},
            {"type": "integer", "minimum": 0, "maximum": 999}, {"type": "boolean"},
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}]

    def obj(depth):
        props = {f"k{i}": obj(depth + 1) if depth < 1 and rng.random() < 0.3 else leaf[int(rng.integers(len(leaf)))]
                 for i in range(int(rng.integers(1, 5)))}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return obj(0)


def timed_steps(engine, prompts, params: SamplingParams, steps: int) -> tuple[float, float]:
    """(seconds per engine step, host seconds per step building masks) once every request
    decodes, over `steps` steps."""
    seqs = [engine.add_request(p, params=params) for p in prompts]
    while any(s.in_prefill or not s.output for s in seqs):  # prefilled, and a first token out
        engine.step()
    engine.step()
    mask_s, t = engine.stats()["guided_mask_s"], time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t) / steps
    mask_s = (engine.stats()["guided_mask_s"] - mask_s) / steps
    ended = [(s.finish_reason, len(s.output), s.error) for s in seqs if s.status is not Status.RUNNING]
    assert not ended, f"timed requests ended early: {ended}"
    for s in seqs:
        engine.abort(s)
    while engine.scheduler.has_work:
        engine.step()
    return dt, mask_s


def validity(engine, n: int, tokens: TokenSampler, rng) -> dict:
    import jsonschema
    schemas = [bounded_schema(rng) for _ in range(n)]
    seqs = [engine.add_request(tokens.draw(rng, 32), params=SamplingParams(
        max_new_tokens=200, temperature=1.0, seed=i, guided=json_schema_grammar(s))) for i, s in enumerate(schemas)]
    while any(s.status is not Status.FINISHED for s in seqs):
        engine.step()
    tok = engine.tokenizer
    stopped = [(s, schema) for s, schema in zip(seqs, schemas) if s.finish_reason == "stop"]
    valid = 0
    for s, schema in stopped:
        try:
            jsonschema.validate(json.loads(tok.decode(s.output)), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"requests": n, "stop_fraction": len(stopped) / n, "valid_fraction_of_stopped": valid / max(1, len(stopped)),
            "mean_tokens": float(np.mean([len(s.output) for s in seqs]))}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--validity", type=int, default=200, help="bounded-schema requests (0: none)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-bytes", type=size_flag, default=None,
                   help="the KV pool (default: the engine's); it must hold every timed request at once")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    engine = forkjax.Engine.from_pretrained(args.model, dtype=args.dtype, cache_policy="prefix",
                                            max_batch_size=max(batches + [args.validity]),
                                            max_model_len=args.context + MAX_NEW, warmup=False,
                                            kv_cache_bytes=args.kv_cache_bytes)
    tokens = TokenSampler.for_model(engine.model_cfg)
    rng = np.random.default_rng(0)
    result = {"model": args.model, "context": args.context, "steps": args.steps, "batches": {}}
    guided = json_schema_grammar(LONG)
    for b in batches:
        prompts = [tokens.draw(rng, args.context) for _ in range(b)]
        for _ in range(2):  # the first pass compiles the shapes; the second is timed
            free, _ = timed_steps(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
                                  args.steps)
            constrained, mask_s = timed_steps(engine, prompts, SamplingParams(
                max_new_tokens=MAX_NEW, ignore_eos=True, guided=guided), args.steps)
        result["batches"][b] = {"unconstrained_step_s": free, "constrained_step_s": constrained,
                                "ratio": constrained / free, "mask_s_per_step": mask_s}
        print(f"B={b}: {free * 1e3:.2f} ms -> {constrained * 1e3:.2f} ms a step under a schema "
              f"({constrained / free:.3f}x), masks {result['batches'][b]['mask_s_per_step'] * 1e3:.2f} ms "
              "a step on the host", flush=True)
    if args.validity:
        result["validity"] = validity(engine, args.validity, tokens, rng)
        print(f"validity: {result['validity']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    engine.close()
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
