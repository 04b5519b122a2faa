"""Decode-shaped projections on the GPU: separate vs fused weights (a diagnostic).

    PYTHONPATH=. python3 scripts/diag_decode_gemms.py --out $OUT [--m 64] [--cases o,down]
        [--options '{"xla_gpu_enable_triton_gemm": false}']   # extra XLA compiler options
        [--options '[{}, {"xla_gpu_enable_triton_gemm": false}]']   # or a list: each in turn
        [--splits 1,2,4]   # split-K by hand: weights stored [S, out, in/S], one batched GEMM

At the Llama-3-8B shapes (d 4096, q 4096, kv 1024, ffn 14336), bf16, M = 1, 16, 64 tokens: the
time of one layer's projections as the engine runs them (q, k, v, gate, up separately) against
the same weights stored fused (q|k|v, gate|up), with and without LoRA A's (N·R = 128 columns per
target) appended as extra output rows. Eight layers of distinct weights per call, so that no
weight is served from L2. CUPTI kernel time per layer and achieved TB/s. Not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from bench_kernels import time_ms  # scripts/ is on sys.path when this script runs

D, Q, KV, F, NR = 4096, 4096, 1024, 14336, 128
LAYERS = 8
XW = (((1,), (1,)), ((), ()))


def dot(x, w):  # x [M, in], w [out, in] -> [M, out], as forkjax.linear.linear
    return jax.lax.dot_general(x, w, XW, preferred_element_type=jnp.float32).astype(x.dtype)


def split_dot(x, w):
    """x [M, in], w [S, out, in/S] -> [M, out]: split-K as a batched GEMM of S partial products
    (float32), summed (here a kernel of its own, timed with the GEMM; in a model XLA could fuse
    it into the consumer)."""
    s, m = w.shape[0], x.shape[0]
    xs = x.reshape(m, s, -1).swapaxes(0, 1)  # [S, M, in/S]
    y = jax.lax.dot_general(xs, w, (((2,), (2,)), ((0,), (0,))),
                            preferred_element_type=jnp.float32)
    return y.sum(0).astype(x.dtype)


def weights(shapes, seed, split=1):
    keys = jax.random.split(jax.random.key(seed), LAYERS * len(shapes))
    w = [[jax.random.normal(keys[i * len(shapes) + j], s, jnp.bfloat16) * 0.02
          for j, s in enumerate(shapes)] for i in range(LAYERS)]
    if split > 1:  # [out, in] -> [S, out, in/S]
        w = [[a.reshape(a.shape[0], split, -1).swapaxes(0, 1) for a in layer] for layer in w]
    return w


CASES = {  # name -> (weight shapes of one layer, input width)
    "qkv separate": ([(Q, D), (KV, D), (KV, D)], D),
    "qkv fused": ([(Q + 2 * KV, D)], D),
    "qkv + A fused": ([(Q + 2 * KV + 3 * NR, D)], D),
    "q,k,v + 3 A separate": ([(Q, D), (KV, D), (KV, D), (NR, D), (NR, D), (NR, D)], D),
    "gate, up separate": ([(F, D), (F, D)], D),
    "gate|up fused": ([(2 * F, D)], D),
    "down": ([(D, F)], F),
    "o": ([(D, Q)], Q),
    "o + A": ([(D + NR, Q)], Q),
    "gate|up + A": ([(2 * F + 2 * NR, D)], D),
    "down + A": ([(D + NR, F)], F),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="diag_out")
    ap.add_argument("--m", default="1,16,64", help="token counts")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--splits", default="1", help="split-K factors (1: the plain GEMM)")
    ap.add_argument("--options", default="{}",
                    help="JSON dict of XLA compiler options, or a list of them (each in turn)")
    args = ap.parse_args()
    option_sets = json.loads(args.options)
    if isinstance(option_sets, dict):
        option_sets = [option_sets]
    cases = args.cases.split(",") if args.cases else list(CASES)
    os.makedirs(args.out, exist_ok=True)
    results = []
    for seed, (name, (shapes, d_in)) in enumerate(CASES.items()):
        if name not in cases:
            continue
        for split in map(int, args.splits.split(",")):
            ws = weights(shapes, seed, split)
            nbytes = sum(w.nbytes for w in ws[0])
            mult = split_dot if split > 1 else dot
            for m in map(int, args.m.split(",")):
                x = jax.random.normal(jax.random.key(99), (m, d_in), jnp.bfloat16)
                for extra in option_sets:
                    row = dict(case=name, m=m, split=split, options=extra,
                               mb=round(nbytes / 1e6, 1))
                    f = jax.jit(lambda x, ws: [[mult(x, w) for w in layer] for layer in ws],
                                compiler_options={"xla_gpu_dot_merger_threshold_mb": 0, **extra})
                    try:
                        ms, how = time_ms(f, (x, ws))
                    except Exception as e:  # noqa: BLE001  (an option this XLA rejects)
                        row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
                    else:
                        us = ms * 1e3 / LAYERS
                        row.update(us_per_layer=round(us, 2), timing=how,
                                   tbps=round(nbytes / (us * 1e-6) / 1e12, 2))
                    print(json.dumps(row), flush=True)
                    results.append(row)
        del ws
    with open(os.path.join(args.out, "diag_decode_gemms.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
