"""Checkpoint load time: write a Llama-shaped bf16 safetensors checkpoint, load it twice.

The loader maps HF names to parameters with no conversion (weights keep HF's layout), so the
second load should cost what the first does, bounded by reading the files.
"""

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
from safetensors.flax import save_file

from forkjax.models.loader import checkpoint_shapes, load_checkpoint
from provenance import run_info  # scripts/ is on sys.path when this script runs

CONFIG = dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
              num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
              rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
              tie_word_embeddings=False)


def write_checkpoint(path):
    from forkjax.config import ModelConfig
    cfg = ModelConfig.from_hf(CONFIG)
    tensors, key = {}, jax.random.key(0)
    for name, shape in checkpoint_shapes(cfg).items():
        key, sub = jax.random.split(key)
        tensors[name] = jax.random.normal(sub, shape, jnp.bfloat16)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    return sum(t.size for t in tensors.values()) * 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_load.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        nbytes = write_checkpoint(d)
        times = []
        for _ in range(2):
            t = time.perf_counter()
            _, model = load_checkpoint(d, num_slots=2, rank=16, dtype=jnp.bfloat16, progress=False)
            jax.block_until_ready(nnx_state(model))
            times.append(time.perf_counter() - t)
    row = dict(**run_info(__file__), checkpoint_bytes=nbytes,
               first_load_s=times[0], second_load_s=times[1])
    print(json.dumps(row))
    with open(args.out, "w") as f:
        json.dump(row, f)


def nnx_state(model):
    from flax import nnx
    return jax.tree.leaves(nnx.state(model))


if __name__ == "__main__":
    main()
