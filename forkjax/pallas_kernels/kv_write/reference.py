"""The K/V write's contract in plain jnp: one XLA scatter per pool (the engine's reference path,
and its path wherever the Mosaic kernel does not run)."""

from __future__ import annotations

from forkjax.pallas_kernels.kv_write import KVPools


def write_kv(pools: KVPools, layer, base_slots, res_slots, k, v, xa_k=None, xa_v=None) -> KVPools:
    """Scatter one layer's new tokens into the pools (pure; call it inside the jitted step).

    layer: int or traced int32 scalar. base_slots: [T] int32 flat slots page·S + offset, 0 where
    the token must not be written (cached already, padding, or no residual): those writes land in
    the sink page. k, v: [T, Hkv, D]. xa_k, xa_v: [T, R] with res_slots [T], or [T, J, R] with
    res_slots [T, J] (a token's own residual row, then other agents' under residual fan-out), or
    None to leave the residual pool untouched (policies without one).
    """
    S = pools.base_k.shape[3]
    page, off = base_slots // S, base_slots % S
    # Advanced indices (layer, page, off) around a slice: the indexed shape is [T, Hkv, D].
    base_k = pools.base_k.at[layer, :, page, off].set(k.astype(pools.base_k.dtype))
    base_v = pools.base_v.at[layer, :, page, off].set(v.astype(pools.base_v.dtype))
    res_k, res_v = pools.res_k, pools.res_v
    if xa_k is not None:
        flat = res_slots.reshape(-1)
        rpage, roff = flat // S, flat % S
        r = xa_k.shape[-1]
        res_k = res_k.at[layer, rpage, roff].set(xa_k.reshape(-1, r).astype(res_k.dtype))  # [T·J, R]
        res_v = res_v.at[layer, rpage, roff].set(xa_v.reshape(-1, r).astype(res_v.dtype))
    return KVPools(base_k, base_v, res_k, res_v)
