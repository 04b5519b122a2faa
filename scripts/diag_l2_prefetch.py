"""Weights read into L2 just before their decode GEMM, on a second stream (a diagnostic).

    PYTHONPATH=. python3 scripts/diag_l2_prefetch.py --out $OUT [--part a,b]

Between a layer's GEMMs run small kernels (norms, adds, SiLU, the LoRA glue, the split-K
reduce) that leave DRAM mostly idle. If the next GEMM's first weight rows were read into L2
(50 MB) meanwhile, on a second CUDA stream (`compute_on("gpu_stream:1")`, XLA's
`--xla_gpu_experimental_stream_annotation`), the GEMM would read fewer bytes from DRAM.
  A  each M=64 decode GEMM (Llama-3-8B shapes + LoRA A rows) after an L2 flush: cold, and with
     its first rows read just before (CUPTI kernel µs): what an L2-warm slice saves at most.
  B  16 layers of decode-shaped GEMMs with the small kernels between them and a 537 MB read
     standing in for attention (distinct weights and reads per layer), wall ms per layer:
     without prefetch, with prefetches on stream 1, and with the same reads on the main stream.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_gpu_experimental_stream_annotation=true")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental.compute_on import compute_on  # noqa: E402

D, Q, KV, F, NR, M = 4096, 4096, 1024, 14336, 128, 64
LAYERS = 16
ROUNDS = 8
KV_ELEMS = M * 2048 * 2048  # the attention stand-in's read: 537 MB of bf16 a layer
XW = (((1,), (1,)), ((), ()))
GEMMS = {  # name -> (out rows incl. LoRA A rows, in)
    "o": (D + NR, Q), "qkv": (Q + 2 * KV + 3 * NR, D), "gate_up": (2 * F + 2 * NR, D),
    "down": (D + NR, F)}
MIB = 1 << 20


def dot(x, w):  # x [M, in], w [out, in] -> [M, out] bf16, as forkjax.linear.linear
    return lax.dot_general(x, w, XW, preferred_element_type=jnp.float32).astype(x.dtype)


def rows_for(name, mib):
    out, inp = GEMMS[name]
    return min(out, int(mib * MIB) // (inp * 2))


def read_rows(w, rows, after=None, stream=True):
    """max of w[:rows] (its bytes go through L2), started once `after` exists -> f32 scalar."""
    def f(w, after):
        s = jnp.max(w[:rows]).astype(jnp.float32)
        return s if after is None else s + 0 * after.reshape(-1)[0].astype(jnp.float32)
    if stream:
        f = compute_on(compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)(f)
    return f(w, after)


def gate(x, token):
    """x, not usable before token exists (a scheduling edge, no kernel); token None: x."""
    return x if token is None else lax.optimization_barrier((x, token))[0]


def kernels_ms(f, args, iters=10):
    from jax.experimental.mosaic.gpu import profiler
    _, runs = profiler.measure(f, aggregate=False, iterations=iters)(*args)
    return runs  # per iteration: [(kernel name, ms), ...]


def part_a(results):
    key = jax.random.key(0)
    flush = jnp.ones((128 * MIB,), jnp.float32)  # 512 MiB written: evicts L2
    for name, (out, inp) in GEMMS.items():
        w = jax.random.normal(key, (out, inp), jnp.bfloat16) * 0.02
        x = jax.random.normal(key, (M, inp), jnp.bfloat16)
        for rows in sorted({rows_for(name, mib) for mib in (0, 8, 16, 32, 48)}):
            def prog(flush, w, x, rows=rows):
                f = flush * 1.0001
                w, f = lax.optimization_barrier((w, f))
                outs = [f]
                if rows:
                    s = read_rows(w, rows, stream=False)
                    x = gate(x, s)
                    outs.append(s)
                return outs + [dot(x, w)]

            runs = kernels_ms(jax.jit(prog), (flush, w, x))
            names = [k for k, _ in runs[0]]
            # the GEMM's kernels (a split-K GEMM ends in a loop_reduce) come after the flush's
            # (loop_multiply) and the read's (input_reduce)
            first = 1 + max(i for i, k in enumerate(names)
                            if "multiply" in k or "input_reduce" in k)
            gemm = statistics.median(sum(t for _, t in r[first:]) for r in runs) * 1e3
            read = statistics.median(sum(t for _, t in r[1:first]) for r in runs) * 1e3
            row = dict(gemm=name, warm_mib=round(rows * inp * 2 / MIB, 1) if rows else 0,
                       gemm_us=round(gemm, 1), read_us=round(read, 1), kernels=names)
            print(f"A {name:8s} warm {row['warm_mib']:5.1f} MiB: GEMM {gemm:6.1f} us, read "
                  f"{read:5.1f} us  {names[first:]}", flush=True)
            results["a"].append(row)


def rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(x.dtype)


def layers_fn(plan, stream):
    """plan: GEMM name -> MiB of its rows to read ahead (o's during the attention stand-in,
    gate_up's during o and its glue, down's during SiLU, qkv's during the add and norm)."""
    def pre(name, w, after):
        return read_rows(w, rows_for(name, plan[name]), after, stream) if plan.get(name) else None

    def fn(ws, kvs, h, a):
        for i, ((wo, wgu, wd, wqkv), kv) in enumerate(zip(ws, kvs)):
            t = pre("gate_up", wgu, a)  # runs beside the o GEMM and the add and norm
            h = rms(h + dot(a, wo)[:, :D])
            gu = dot(gate(h, t), wgu)
            t = pre("down", wd, gu)
            act = jax.nn.silu(gu[:, :F]) * gu[:, F:2 * F]
            d = dot(gate(act, t), wd)
            t = pre("qkv", wqkv, d)
            h = rms(h + d[:, :D])
            qkv = dot(gate(h, t), wqkv)
            t = pre("o", ws[(i + 1) % len(ws)][0], qkv)  # the next layer's o
            s = jnp.max(kv).astype(qkv.dtype)  # the attention stand-in: 537 MB read
            a = gate(qkv[:, :Q] * (1 + 0 * s), t)
        return h, a
    return jax.jit(fn)


def part_b(results, plans):
    key = jax.random.key(1)
    ws = []
    for i in range(LAYERS):
        ks = jax.random.split(jax.random.fold_in(key, i), 4)
        ws.append(tuple(jax.random.normal(k, GEMMS[n], jnp.bfloat16) * 0.02
                        for k, n in zip(ks, ("o", "gate_up", "down", "qkv"))))
    kvs = [jnp.full((KV_ELEMS // 2048, 2048), i, jnp.bfloat16) for i in range(LAYERS)]
    h = jax.random.normal(key, (M, D), jnp.bfloat16)
    a = jax.random.normal(key, (M, Q), jnp.bfloat16)
    fns = [layers_fn(plan, stream) for plan, stream in plans]
    outs = [jax.block_until_ready(f(ws, kvs, h, a)) for f in fns]
    times = [[] for _ in fns]
    for _ in range(ROUNDS):  # the plans in turn, so clock and power drift reach them alike
        for f, t in zip(fns, times):
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(f(ws, kvs, h, a))
                t.append((time.perf_counter() - t0) * 1e3 / LAYERS)
    for (plan, stream), out, t in zip(plans, outs, times):
        same = all(bool(jnp.array_equal(x, y)) for x, y in zip(out, outs[0]))
        ms, q1, q3 = statistics.median(t), *statistics.quantiles(t, n=4)[::2]
        row = dict(plan=plan, stream=stream, ms_per_layer=round(ms, 4), q1=round(q1, 4),
                   q3=round(q3, 4), same=same)
        print(f"B {json.dumps(plan):60s} stream={stream!s:5s} {ms * 1e3:6.1f} us/layer "
              f"(quartiles {q1 * 1e3:.1f}-{q3 * 1e3:.1f}; same output: {same})", flush=True)
        results["b"].append(row)


PLANS = [
    ({}, True),
    ({"gate_up": 32}, True),
    ({"gate_up": 32, "down": 12, "qkv": 20}, True),
    ({"gate_up": 32, "down": 12, "qkv": 20}, False),
    ({"gate_up": 16, "down": 8, "qkv": 12}, True),
    ({"gate_up": 32, "down": 12, "qkv": 20, "o": 34}, True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="diag_out")
    ap.add_argument("--part", default="a,b")
    ap.add_argument("--plans", default="", help="JSON list of [plan, stream] (default: PLANS)")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    args = ap.parse_args()
    globals()["ROUNDS"] = args.rounds
    os.makedirs(args.out, exist_ok=True)
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "a": [], "b": []}
    if "a" in args.part:
        part_a(results)
    if "b" in args.part:
        part_b(results, [tuple(p) for p in json.loads(args.plans)] if args.plans else PLANS)
    with open(os.path.join(args.out, "diag_l2_prefetch.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
