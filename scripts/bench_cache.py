"""Host-side cost of the DualRadixCache: many agents on shared 32k-token prefixes.

Each request is `prefix[agent % num_prefixes] + random suffix`, decodes `--gen` tokens, and runs
while `--concurrency - 1` other requests hold their locks. Timed per request, all host
bookkeeping the engine does for it: begin (match + lock both trees), reserve (allocation, LRU
eviction, copy-on-write), commit after prefill and at finish (insert), release. Device-free: the
pools are sized for Llama-3-8B (bf16, r=16) but never allocated.

    .venv/bin/python scripts/bench_cache.py              # all four policies, 10,000 requests
    .venv/bin/python scripts/bench_cache.py --policy forkkv --requests 2000
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np

from forkjax.cache import POLICIES, DualRadixCache, OutOfPages, PoolLayout

LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, lora_rank=16, page_size=16, dtype="bfloat16")


def run(policy: str, args) -> dict:
    layout = PoolLayout.from_budget(**LLAMA3_8B, kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)), policy=policy)
    cache = DualRadixCache.from_layout(layout)
    rng = np.random.default_rng(args.seed)
    prefixes = [rng.integers(0, 128_000, args.prefix_len, dtype=np.int32) for _ in range(args.num_prefixes)]
    agents = [f"{i:064x}" for i in range(args.agents)]  # content-hash-like adapter keys
    running = collections.deque()  # (request index, handle, tokens with K/V at finish)
    match_ns, insert_ns, total_ns = (np.zeros(args.requests, np.int64) for _ in range(3))
    peak_base = peak_res = 0

    def finish(i, h, tokens) -> int:
        t0 = time.perf_counter_ns()
        h.commit(tokens)
        h.release()
        dt = time.perf_counter_ns() - t0
        insert_ns[i] += dt
        total_ns[i] += dt
        return dt

    def reserve(h, n) -> int:
        """Admission control as the scheduler does it: finish the oldest requests until it fits."""
        spent = 0
        while True:
            try:
                h.reserve(n)
                return spent
            except OutOfPages:
                if not running:
                    raise
                spent += finish(*running.popleft())

    for i in range(args.requests):
        agent = int(rng.integers(args.agents))
        suffix = rng.integers(0, 128_000, int(rng.integers(args.suffix_min, args.suffix_max + 1)), dtype=np.int32)
        prompt = np.concatenate([prefixes[agent % args.num_prefixes], suffix])
        full = np.concatenate([prompt, rng.integers(0, 128_000, args.gen, dtype=np.int32)])
        if len(running) >= args.concurrency:
            finish(*running.popleft())
        t0 = time.perf_counter_ns()
        h = cache.begin(prompt, agents[agent])
        t1 = time.perf_counter_ns()
        other = reserve(h, len(prompt))
        t2 = time.perf_counter_ns()
        h.commit(prompt)
        t3 = time.perf_counter_ns()
        other += reserve(h, len(full))  # the decode steps' pages, reserved at once
        t4 = time.perf_counter_ns()
        match_ns[i], insert_ns[i], total_ns[i] = t1 - t0, t3 - t2, t4 - t0 - other
        running.append((i, h, full[:-1]))  # the last sampled token has no K/V
        peak_base = max(peak_base, cache.base_tree.allocator.num_used)
        peak_res = max(peak_res, cache.res_tree.allocator.num_used if cache.res_tree else 0)
    while running:
        finish(*running.popleft())
    cache.check()
    st = cache.stats()
    ms = {"total": total_ns / 1e6, "match": match_ns / 1e6, "insert": insert_ns / 1e6}
    return {
        "policy": policy,
        "median_ms": float(np.median(ms["total"])),
        "p99_ms": float(np.percentile(ms["total"], 99)),
        "match_median_ms": float(np.median(ms["match"])),
        "insert_median_ms": float(np.median(ms["insert"])),
        "base_pages_total": st["base_pages_total"],
        "peak_base_pages": peak_base,
        "residual_pages_total": st["residual_pages_total"],
        "peak_residual_pages": peak_res,
        "base_hit_rate": st["base_hit_tokens"] / st["prompt_tokens"],
        "residual_hit_rate": st["residual_hit_tokens"] / st["prompt_tokens"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=sorted(POLICIES), action="append")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument("--prefix-len", type=int, default=32_768)
    p.add_argument("--suffix-min", type=int, default=16)
    p.add_argument("--suffix-max", type=int, default=1024)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--kv-cache-gib", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line per policy instead of a table")
    args = p.parse_args()
    print(f"# {args.requests} requests, {args.agents} agents, {args.num_prefixes} x {args.prefix_len}-token "
          f"prefix, suffix {args.suffix_min}-{args.suffix_max}, gen {args.gen}, concurrency {args.concurrency}, "
          f"{args.kv_cache_gib:g} GiB Llama-3-8B pools")
    if not args.json:
        print("| policy | median ms | p99 ms | match median ms | insert median ms | peak base pages "
              "| peak residual pages | base hit | residual hit |")
        print("|---|---|---|---|---|---|---|---|---|")
    for policy in args.policy or ["forkkv", "lrshared", "full_reuse", "prefix"]:
        r = run(policy, args)
        if args.json:
            print(json.dumps(r))
            continue
        print(f"| {policy} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | {r['match_median_ms']:.3f} "
              f"| {r['insert_median_ms']:.3f} | {r['peak_base_pages']} / {r['base_pages_total']} "
              f"| {r['peak_residual_pages']} / {r['residual_pages_total']} | {r['base_hit_rate']:.1%} "
              f"| {r['residual_hit_rate']:.1%} |", flush=True)


if __name__ == "__main__":
    main()
