"""One Mosaic GPU kernel for a layer's K/V cache writes, in place.

`forkjax.cache.write_kv` (the reference) scatters a step's new tokens with one XLA scatter per
pool: base K, base V, residual K, residual V. In a B=64 decode step each of those four kernels
moves 64 rows and takes ~2.8 us on the H200 (BENCHMARKS.md, the engine's layer timeline),
launch and tail mostly. Here one CTA per token TMA-copies its rows into shared memory and on
into every pool; the pools are aliased inputs and outputs, so nothing else is copied. TMA
addresses the pools by coordinates, so pools of over 2^31 elements are fine.

    pools   base [L, Hkv, P, S, D], residual [L, Pr, S, R] (forkjax.cache.pool)
    slots   [T] int32 page * S + offset, 0 (the sink page) where a token must not be written

The engine's Pallas path uses it on a GPU wherever `supports` holds (B=64 decode 11.11 against
11.23 ms with XLA's scatters: BENCHMARKS.md, twelfth session).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from forkjax.cache.pool import KVPools


def _kernel(layer_ref, base_slots_ref, res_slots_ref, *refs, page: int, n: int):
    """refs: n row arrays ([T, Hkv, D] k, v, then [T, R] xa_k, xa_v), the n pools they go to,
    then scratch: a shared-memory buffer per row array and the barrier of its copies."""
    rows, pools, (*smem, landed) = refs[:n], refs[n:2 * n], refs[2 * n:]
    t = lax.axis_index("t")
    layer = layer_ref[0]
    for row, buf in zip(rows, smem):  # token t's rows into shared memory...
        plgpu.copy_gmem_to_smem(row.at[t], buf, landed)
    plgpu.barrier_wait(landed)
    slot_refs = (base_slots_ref, base_slots_ref, res_slots_ref, res_slots_ref)
    for buf, pool, slots in zip(smem, pools, slot_refs):  # ...and out to their pool slots
        where = (slots[t] // page, slots[t] % page)
        plgpu.copy_smem_to_gmem(buf, pool.at[(layer, slice(None)) + where if pool.ndim == 5
                                             else (layer,) + where])
    plgpu.wait_smem_to_gmem(0)


def supports(pools: KVPools) -> bool:
    """TMA copies of whole rows: 16-byte multiples (D, R of 8+ bf16 elements)."""
    return all(p.shape[-1] * p.dtype.itemsize % 16 == 0 for p in (pools.base_k, pools.res_k))


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def kv_write(
    pools: KVPools,  # base [L, Hkv, P, S, D], residual [L, Pr, S, R]; donated, written in place
    layer,  # int32 scalar
    base_slots,  # [T] int32 page * S + offset; 0: the sink (do not write)
    res_slots,  # [T] int32
    k,  # [T, Hkv, D]
    v,  # [T, Hkv, D]
    xa_k=None,  # [T, R], or None: the residual pools are left as they are
    xa_v=None,  # [T, R]
    *,
    interpret: bool = False,
) -> KVPools:
    """`write_kv`'s contract (forkjax.cache.pool), one kernel."""
    residual = xa_k is not None
    targets = tuple(pools) if residual else tuple(pools[:2])
    rows = (k, v, xa_k, xa_v) if residual else (k, v)
    rows = tuple(r.astype(p.dtype) for r, p in zip(rows, targets))
    n = len(rows)
    refs = [jax.new_ref(p) for p in targets]  # written in place: aliased kernel operands
    plgpu.kernel(
        functools.partial(_kernel, page=pools.base_k.shape[3], n=n), out_type=(),
        scratch_types=[plgpu.SMEM(r.shape[1:], r.dtype) for r in rows]
        + [plgpu.Barrier(num_arrivals=n)],
        grid=(k.shape[0],), grid_names=("t",),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(jnp.asarray(layer, jnp.int32).reshape(1), base_slots.astype(jnp.int32),
      res_slots.astype(jnp.int32), *rows, *refs)
    written = [r[...] for r in refs]
    return KVPools(*written) if residual else KVPools(*written, pools.res_k, pools.res_v)

