"""Multi-LoRA matmul formulations against the base projection they ride on.

For T tokens spread evenly over N adapter slots, rank R, d_in -> d_out in bf16: the median time of
the base matmul x·Wᵀ, of LoRA shrink+expand as a grouped GEMM (`jax.lax.ragged_dot`), of the
dense one-hot formulation `forkjax.lora.batched` uses (every token through every slot,
2·N·T·R·(d_in+d_out) FLOPs), and of the whole projection as the model runs it (`fused`: the N·R A rows appended to W, one GEMM, then the one-hot expand), to set
beside the base matmul plus a grouped LoRA: `ragged_dot` or the SGMV kernels
(`forkjax.pallas_kernels.sgmv`, GPU only: each token against its own slot). Writes JSON lines to
--out.
"""

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from forkjax.lora.batched import lora_expand, lora_shrink, slot_rows, slots_from_group_sizes
from forkjax.pallas_kernels.sgmv.triton import SgmvConfig, sgmv_expand, sgmv_shrink
from provenance import run_info  # scripts/ is on sys.path when this script runs


def bench(f, *args, reps=50):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e6


@jax.jit
def base(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)


def _ragged(x, a, b, gs):
    xa = jax.lax.ragged_dot(x, a, gs, preferred_element_type=jnp.float32).astype(x.dtype)
    return jax.lax.ragged_dot(xa, b, gs, preferred_element_type=jnp.float32).astype(x.dtype)


grouped = jax.jit(_ragged)


@jax.jit
def onehot(x, a, b, gs):
    return lora_expand(lora_shrink(x, a, gs), b)


@jax.jit
def fused(x, wa, b, gs):
    """x [T, d_in], wa [d_out + N·R, d_in] (W, then every slot's A^T as rows), b [N, R, d_out]."""
    n, r, d_out = b.shape
    y = base(x, wa)
    slots = slots_from_group_sizes(gs, x.shape[0])
    return y[:, :d_out] + lora_expand(slot_rows(y[:, d_out:].reshape(-1, n, r), slots, n), b)


@functools.partial(jax.jit, static_argnums=4)
def sgmv(x, a, b, slots, config):
    """x [T, d_in], a [N, R, d_in], b [N, R, d_out], slots [T] -> each token's x·A_s·B_s."""
    return sgmv_expand(sgmv_shrink(x, a, slots, config), b, slots, config)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_lora.jsonl")
    p.add_argument("--tokens", default="64,2048,8192", help="T values, comma-separated (%(default)s)")
    p.add_argument("--slots", default="1,8,32,64", help="N values, comma-separated (%(default)s)")
    args = p.parse_args()
    key = jax.random.key(0)
    info = run_info(__file__)
    with open(args.out, "w") as out:  # a line a row: a timed-out sweep keeps what it measured
        for t in map(int, args.tokens.split(",")):
            for n in map(int, args.slots.split(",")):
                for d_in, d_out in ((4096, 4096), (4096, 1024)):
                    row = {**measure(key, t, n, 16, d_in, d_out), **info}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(json.dumps(row), flush=True)


def measure(key, t, n, r, d_in, d_out):
    x = jax.random.normal(key, (t, d_in), jnp.bfloat16)
    w = jax.random.normal(key, (d_out, d_in), jnp.bfloat16)
    a = jax.random.normal(key, (n, d_in, r), jnp.bfloat16)
    b = jax.random.normal(key, (n, r, d_out), jnp.bfloat16)
    gs = jnp.full((n,), t // n, jnp.int32)
    a_rows = a.transpose(0, 2, 1)  # [N, R, d_in]
    row = dict(T=t, N=n, R=r, d_in=d_in, d_out=d_out,
               base_us=bench(base, x, w), grouped_us=bench(grouped, x, a, b, gs),
               onehot_us=bench(onehot, x, a_rows, b, gs),
               fused_us=bench(fused, x, jnp.concatenate([w, a_rows.reshape(n * r, d_in)]), b, gs))
    if jax.default_backend() == "gpu":
        row["sgmv_us"] = bench(sgmv, x, a_rows, b, slots_from_group_sizes(gs, t),
                               SgmvConfig.for_shapes(d_in, d_out))
    return row

if __name__ == "__main__":
    main()
