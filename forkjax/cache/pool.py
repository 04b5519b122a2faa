"""Device page pools: sizing from a byte budget, allocation, and the jittable writes into them.

    base_k, base_v  [L, Hkv, P,  S, D]   x·W (+bias), RoPE applied to K; merged K/V under
                                         `prefix` / `full_reuse`
    res_k,  res_v   [L,      Pr, S, R]   x·A_k, x·A_v (no RoPE), R = max LoRA rank, zero-padded

Page 0 of each pool is the padding sink (see allocator.py). Policies without a residual keep a
sink-only residual pool (Pr = 1) so the kernel signature never changes.

Budget split: `residual_fraction` of `kv_cache_bytes` goes to the residual pool. The default
gives the residual pool `residual_copies` token slots per base-pool token slot: the engine asks
under `forkkv` for one per adapter that fits in a device slot (every agent keeps its residual of
every cached base token; with residual fan-out every agent's is written) unless told how many
adapters read one context at once (`residual_copies`), one under `lrshared` (one shared residual
per base token). For Llama-3-8B at r=16 (n/r = 64) one copy is 1.5% of the budget,
three 4.5%.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from forkjax.cache.policy import CachePolicy, get_policy
from forkjax.tensor_parallel import BASE_POOL_SPEC, RES_POOL_SPEC, sharding

class KVPools(NamedTuple):
    base_k: jax.Array  # [L, Hkv, P, S, D]
    base_v: jax.Array  # [L, Hkv, P, S, D]
    res_k: jax.Array  # [L, Pr, S, R]
    res_v: jax.Array  # [L, Pr, S, R]


# Their PartitionSpecs under tensor parallelism (tensor_parallel.py)
KV_SPECS = KVPools(BASE_POOL_SPEC, BASE_POOL_SPEC, RES_POOL_SPEC, RES_POOL_SPEC)


class PoolLayout(NamedTuple):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    lora_rank: int  # R: the max rank over adapters, padded
    page_size: int
    dtype: str
    base_pages: int  # sink included
    res_pages: int  # sink included
    policy: CachePolicy
    tensor_parallel: int = 1  # devices the base pools' KV heads are split over


    @classmethod
    def from_budget(cls, *, num_layers: int, num_kv_heads: int, head_dim: int, lora_rank: int,
                    page_size: int, kv_cache_bytes: int, policy: str | CachePolicy = "forkkv",
                    dtype: str = "bfloat16", residual_fraction: float | None = None,
                    residual_copies: int = 1, tensor_parallel: int = 1) -> PoolLayout:
        """`kv_cache_bytes`: per device (under tensor parallelism each holds 1/tp of a base page
        and a whole residual page)."""
        policy = get_policy(policy)
        dtype = jnp.dtype(dtype).name
        probe = cls(num_layers, num_kv_heads, head_dim, lora_rank, page_size, dtype, 0, 0, policy,
                    tensor_parallel)
        bb, rb = probe.base_page_bytes, probe.res_page_bytes
        if not policy.uses_residual:
            res_pages = 1
        else:
            if residual_fraction is None:
                copies = max(1, residual_copies)
                residual_fraction = copies * rb / (bb + copies * rb)
            if not 0.0 < residual_fraction < 1.0:
                raise ValueError(f"residual_fraction must be in (0, 1), got {residual_fraction}")
            res_pages = int(kv_cache_bytes * residual_fraction) // rb
        base_pages = (kv_cache_bytes - res_pages * rb) // bb
        if base_pages < 2 or res_pages < (2 if policy.uses_residual else 1):
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} gives {base_pages} base and {res_pages} residual pages "
                f"(page 0 is the sink, so each pool needs 2); one base page is {bb} bytes, one "
                f"residual page {rb} bytes"
            )
        return probe._replace(base_pages=int(base_pages), res_pages=int(res_pages))

    @property
    def base_page_bytes(self) -> int:
        """Bytes of a base page on one device."""
        heads = self.num_kv_heads // self.tensor_parallel
        return 2 * self.num_layers * heads * self.page_size * self.head_dim * jnp.dtype(self.dtype).itemsize

    @property
    def res_page_bytes(self) -> int:
        return 2 * self.num_layers * self.page_size * self.lora_rank * jnp.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.base_pages * self.base_page_bytes + self.res_pages * self.res_page_bytes

    def allocate(self) -> KVPools:
        """Zero-filled device pools (separate from sizing so device-free code never allocates)."""
        base = (self.num_layers, self.num_kv_heads, self.base_pages, self.page_size, self.head_dim)
        res = (self.num_layers, self.res_pages, self.page_size, self.lora_rank)
        on = functools.partial(sharding, self.tensor_parallel)
        return KVPools(*(jnp.zeros(shape, self.dtype, device=on(spec))
                         for shape, spec in zip((base, base, res, res), KV_SPECS)))


def residual_copies_for(policy: str, adapters: int, max_loras: int, given: int | None = None) -> int:
    """`PoolLayout.from_budget`'s `residual_copies`: `given`, else under `forkkv` one per adapter
    that can be in a device slot at once (of `adapters` loaded, `max_loras` slots with the base
    model's), else one."""
    if given:
        return given
    return max(1, min(adapters, max_loras - 1)) if get_policy(policy).name == "forkkv" else 1


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
