"""Host tier copy rates: pages of a KV pool written back to pinned host memory and loaded again
through `HostPagePool` (cache/host_pool.py) and `HostBlocks` (runtime/host_blocks.py), as the
engine does it: a gather into one block and one device-to-host copy per store, one
host-to-device copy and a scatter per load.

    PYTHONPATH=. python3 scripts/bench_host_tier.py --out $OUT/host_tier.json     # GPU
    PYTHONPATH=. python scripts/bench_host_tier.py --model tiny-llama --pages 4,16 # CPU smoke

A pool of the model's base-page geometry (bf16, page 16); for each page count, the median of
--repeats store and load round trips, each timed to its last byte (block_until_ready), in GB/s
of page bytes moved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from forkjax.cache import PoolLayout
from forkjax.cache.host_pool import HostBudget, HostPagePool
from forkjax.config import ModelConfig
from forkjax.models.builtin import BUILTIN_CONFIGS
from forkjax.runtime.host_blocks import HostBlocks
from provenance import run_info  # scripts/ is on sys.path when this script runs


def round_trip(pool: HostPagePool, blocks: HostBlocks, k, v, pages: np.ndarray):
    """-> (store seconds, load seconds, k, v) for one store of `pages` and its load back."""
    t0 = time.perf_counter()
    ids = pool.store(pages)
    k, v = blocks.execute(pool.take_copies(), k, v)
    blocks.wait()
    t1 = time.perf_counter()
    pool.load(ids, pages[::-1].copy())
    k, v = jax.block_until_ready(blocks.execute(pool.take_copies(), k, v))
    t2 = time.perf_counter()
    pool.free(ids)
    return t1 - t0, t2 - t1, k, v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3.1-8b-random")
    ap.add_argument("--pages", default="1,4,32,256", help="pages per store (8B: 2 MiB a page; a block is at most 256)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="host_tier.json")
    args = ap.parse_args()
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS[args.model])
    counts = [int(n) for n in args.pages.split(",")]
    layout = PoolLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 16, "bfloat16",
                        max(counts) + 1, 1, None)
    shape = (cfg.num_layers, cfg.num_kv_heads, max(counts) + 1, 16, cfg.head_dim)
    k, v = jnp.ones(shape, jnp.bfloat16), jnp.ones(shape, jnp.bfloat16)
    pool = HostPagePool(layout.base_page_bytes, HostBudget(2 * max(counts) * layout.base_page_bytes))
    blocks = HostBlocks(axis=2)
    rows = []
    for n in counts:
        pages = np.arange(1, n + 1, dtype=np.int32)
        *_, k, v = round_trip(pool, blocks, k, v, pages)  # compiles the gather and scatter of this size
        times = []
        for _ in range(args.repeats):
            store_s, load_s, k, v = round_trip(pool, blocks, k, v, pages)
            times.append((store_s, load_s))
        nbytes = n * layout.base_page_bytes
        store, load = (statistics.median(t[i] for t in times) for i in (0, 1))
        rows.append(dict(pages=n, bytes=nbytes, store_s=store, load_s=load,
                         store_GBps=nbytes / store / 1e9, load_GBps=nbytes / load / 1e9))
        print(f"{n} pages ({nbytes / 1e6:.0f} MB): store {rows[-1]['store_GBps']:.1f} GB/s, "
              f"load {rows[-1]['load_GBps']:.1f} GB/s", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(**run_info(__file__), model=args.model,
                       page_bytes=layout.base_page_bytes, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
