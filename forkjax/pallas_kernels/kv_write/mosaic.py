"""One Mosaic GPU kernel for a layer's K/V cache writes, in place.

`write_kv` (reference.py) scatters a step's new tokens with one XLA scatter per
pool: base K, base V, residual K, residual V. In a decode step each of those moves a few rows,
so its launch and tail are most of its time. Here one CTA per token TMA-copies its rows into
shared memory and on into every pool: one launch for all four. The pools are aliased inputs and
outputs, so nothing else is copied. TMA addresses the pools by coordinates, so pools of over
2^31 elements are fine.

    pools   base [L, Hkv, P, S, D], residual [L, Pr, S, R] (forkjax.cache.pool)
    slots   [T] int32 page * S + offset, 0 (the sink page) where a token must not be written;
            residual slots [T] or [T, J]: J residual rows a token, its own and, with residual
            fan-out, other agents' (x·A_j), all in the same kernel

api.py runs it on a GPU wherever `supports` holds (BENCHMARKS.md, Engine).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from forkjax.pallas_kernels.kv_write import KVPools


def _kernel(layer_ref, base_slots_ref, res_slots_ref, *refs, page: int, n: int, n_pools: int):
    """refs: n row arrays ([T, Hkv, D] k, v, then [T, R] xa_k, xa_v of each of the J residual
    columns), the pools (base K, V, residual K, V), then scratch: a shared-memory buffer per row
    array (each its own, so every copy starts aligned) and the barrier of their copies."""
    rows, pools, (*smem, landed) = refs[:n], refs[n:n + n_pools], refs[n + n_pools:]
    t = lax.axis_index("t")
    layer = layer_ref[0]
    for row, buf in zip(rows, smem):  # token t's rows into shared memory...
        plgpu.copy_gmem_to_smem(row.at[t], buf, landed)
    plgpu.barrier_wait(landed)
    for i, buf in enumerate(smem):  # ...and out to their pool slots
        if i < 2:
            slot = base_slots_ref[t]
            plgpu.copy_smem_to_gmem(buf, pools[i].at[layer, :, slot // page, slot % page])
        else:
            slot = res_slots_ref[t, (i - 2) // 2]
            plgpu.copy_smem_to_gmem(buf, pools[2 + i % 2].at[layer, slot // page, slot % page])
    plgpu.wait_smem_to_gmem(0)


def supports(pools: KVPools) -> bool:
    """TMA copies of whole rows: 16-byte multiples (D, R of 8+ bf16 elements)."""
    return all(p.shape[-1] * p.dtype.itemsize % 16 == 0 for p in (pools.base_k, pools.res_k))


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def kv_write(
    pools: KVPools,  # base [L, Hkv, P, S, D], residual [L, Pr, S, R]; donated, written in place
    layer,  # int32 scalar
    base_slots,  # [T] int32 page * S + offset; 0: the sink (do not write)
    res_slots,  # [T] or [T, J] int32
    k,  # [T, Hkv, D]
    v,  # [T, Hkv, D]
    xa_k=None,  # [T, R] or [T, J, R], or None: the residual pools are left as they are
    xa_v=None,  # like xa_k
    *,
    interpret: bool = False,
) -> KVPools:
    """`write_kv`'s contract (reference.py), one kernel."""
    residual = xa_k is not None
    targets = tuple(pools) if residual else tuple(pools[:2])
    rows = [k.astype(pools.base_k.dtype), v.astype(pools.base_v.dtype)]
    res_slots = res_slots.astype(jnp.int32)
    if residual:
        if xa_k.ndim == 2:  # one residual row a token
            xa_k, xa_v, res_slots = xa_k[:, None], xa_v[:, None], res_slots[:, None]
        for j in range(xa_k.shape[1]):
            rows += [xa_k[:, j].astype(pools.res_k.dtype), xa_v[:, j].astype(pools.res_v.dtype)]
    n = len(rows)
    refs = [jax.new_ref(p) for p in targets]  # written in place: aliased kernel operands
    plgpu.kernel(
        functools.partial(_kernel, page=pools.base_k.shape[3], n=n, n_pools=len(refs)),
        out_type=(),
        scratch_types=[plgpu.SMEM(r.shape[1:], r.dtype) for r in rows]
        + [plgpu.Barrier(num_arrivals=n)],
        grid=(k.shape[0],), grid_names=("t",),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(jnp.asarray(layer, jnp.int32).reshape(1), base_slots.astype(jnp.int32), res_slots,
      *rows, *refs)
    written = [r[...] for r in refs]
    return KVPools(*written) if residual else KVPools(*written, pools.res_k, pools.res_v)

