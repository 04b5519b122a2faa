"""Where a decode step's GPU time goes: per-kernel CUPTI times of one engine step, grouped.

    PYTHONPATH=. python3 scripts/diag_engine_step.py --batch 64 --context 2048 --out $OUT

Builds `llama3-8b-random` with one rank-16 adapter, brings `batch` requests of `context` tokens to
steady decode (as bench_engine.py does), then runs a few steps under CUPTI and prints the kernels
by total time (a diagnostic for the decode roofline gap; not a benchmark).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import time

import numpy as np
from jax.experimental.mosaic.gpu import profiler

import forkjax
from forkjax.config import ModelConfig
from forkjax.engine.sequence import SamplingParams
from forkjax.models.builtin import BUILTIN_CONFIGS, random_adapter


def engine_args() -> argparse.ArgumentParser:
    """The options of `steady_engine` (shared with diag_engine_timeline.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="diag_out")
    ap.add_argument("--model", default="llama3-8b-random")
    ap.add_argument("--policy", default="forkkv")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--kv-cache-bytes", type=float, default=24e9)
    ap.add_argument("--no-overlap", action="store_true", help="synchronous engine steps")
    return ap


def steady_engine(args):
    """`llama3-8b-random` (args.model) with one rank-16 adapter and args.batch requests of
    args.context tokens in steady decode (prompts prefilled and cached first, as bench_engine.py
    does, so that they decode together)."""
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS[args.model])
    adapter = random_adapter("agent", cfg, 16, 32, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=1)
    engine = forkjax.Engine.from_pretrained(args.model, adapters={"agent": adapter},
                                            cache_policy=args.policy, max_batch_size=64,
                                            kv_cache_bytes=int(args.kv_cache_bytes), warmup=False,
                                            overlap=not args.no_overlap)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.context).tolist() for _ in range(args.batch)]
    engine.generate(prompts, adapters="agent", max_new_tokens=1)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    seqs = [engine.add_request(p, "agent", params) for p in prompts]
    while any(s.in_prefill or s.cache is None for s in seqs):
        engine.step()
    for _ in range(3):
        engine.step()
    return engine


def main():
    ap = engine_args()
    ap.add_argument("--tag", default="", help="suffix of the output file")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    engine = steady_engine(args)
    # CUPTI around plain engine steps (profiler.measure would jit-trace its function).
    ext = profiler.mosaic_gpu_lib._mosaic_gpu_ext
    n = 3
    ext._cupti_init()
    t = time.perf_counter()
    try:
        for _ in range(n):
            engine.step()
    finally:
        timings = ext._cupti_get_timings(True)
    wall = (time.perf_counter() - t) / n
    per_kernel = collections.defaultdict(float)
    for name, ms in timings:
        per_kernel[re.sub(r"[._]\d+$", "", name)] += ms / n
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    result = dict(batch=args.batch, context=args.context, policy=args.policy,
                  xla_flags=os.environ.get("XLA_FLAGS", ""), kernels_per_step=len(timings) / n,
                  step_kernel_ms=sum(ms for _, ms in timings) / n, step_wall_ms=wall * 1e3,
                  kernels=[(k, round(v, 4)) for k, v in rows])
    print(f"kernel time / step {result['step_kernel_ms']:.2f} ms ({result['kernels_per_step']:.0f} "
          f"kernels), wall {result['step_wall_ms']:.2f} ms")
    for k, v in rows[:40]:
        print(f"{v:8.3f} ms  {k}")
    tag = f"{args.policy}_b{args.batch}{'_' + args.tag if args.tag else ''}"
    with open(os.path.join(args.out, f"diag_engine_step_{tag}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
