"""The device page pools (their layout: cache/pool.py): allocation, copy-on-write page copies,
and their PartitionSpecs under tensor parallelism.

    base_k, base_v  [L, Hkv, P,  S, D]
    res_k,  res_v   [L,      Pr, S, R]

The K/V write op (pallas_kernels/kv_write, which defines `KVPools`) writes a step's tokens into
them.
"""

from __future__ import annotations

import functools
import jax.numpy as jnp
import numpy as np

from forkjax.pallas_kernels.kv_write import KVPools
from forkjax.tensor_parallel import BASE_POOL_SPEC, RES_POOL_SPEC, sharding


# Their PartitionSpecs under tensor parallelism (tensor_parallel.py)
KV_SPECS = KVPools(BASE_POOL_SPEC, BASE_POOL_SPEC, RES_POOL_SPEC, RES_POOL_SPEC)


def allocate(layout) -> KVPools:
    """Zero-filled device pools of a `cache.PoolLayout` (under tensor parallelism each device
    holds its KV heads' base pages and the whole residual pool)."""
    base = (layout.num_layers, layout.num_kv_heads, layout.base_pages, layout.page_size, layout.head_dim)
    res = (layout.num_layers, layout.res_pages, layout.page_size, layout.lora_rank)
    on = functools.partial(sharding, layout.tensor_parallel)
    return KVPools(*(jnp.zeros(shape, layout.dtype, device=on(spec))
                     for shape, spec in zip((base, base, res, res), KV_SPECS)))


def copy_pages(pools: KVPools, base_src, base_dst, res_src, res_dst) -> KVPools:
    """Copy-on-write: copy whole pages (every layer) src -> dst. All args [C] int32.

    Pad with (0, 0) pairs to keep C fixed across steps: copying the sink onto itself is a no-op.
    Run it before the step writes into the destinations.
    """
    return KVPools(
        pools.base_k.at[:, :, base_dst].set(pools.base_k[:, :, base_src]),
        pools.base_v.at[:, :, base_dst].set(pools.base_v[:, :, base_src]),
        pools.res_k.at[:, res_dst].set(pools.res_k[:, res_src]),
        pools.res_v.at[:, res_dst].set(pools.res_v[:, res_src]),
    )


def copy_index_arrays(pairs: list[tuple[int, int]], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(src [size], dst [size]) int32 from (src, dst) pairs, padded with sink-to-sink copies."""
    if len(pairs) > size:
        raise ValueError(f"{len(pairs)} copy-on-write pairs exceed the bucket of {size}")
    out = np.zeros((2, size), np.int32)
    if pairs:
        out[:, : len(pairs)] = np.asarray(pairs, np.int32).T
    return out[0], out[1]
