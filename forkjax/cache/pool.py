"""The device page pools' layout: their shapes, and their sizes from a byte budget (host
arithmetic; the runtime allocates them, runtime/kv_pools.py, and the K/V write op writes them).

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

from typing import NamedTuple

import ml_dtypes
import numpy as np

from forkjax.cache.policy import CachePolicy, get_policy


def _dtype(dtype) -> np.dtype:
    """A dtype or its name, bfloat16 included (ml_dtypes', as jax's), without jax."""
    return np.dtype(getattr(ml_dtypes, str(dtype), dtype))


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
        dtype = _dtype(dtype).name
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
        return 2 * self.num_layers * heads * self.page_size * self.head_dim * _dtype(self.dtype).itemsize

    @property
    def res_page_bytes(self) -> int:
        return 2 * self.num_layers * self.page_size * self.lora_rank * _dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.base_pages * self.base_page_bytes + self.res_pages * self.res_page_bytes


def residual_copies_for(policy: str, adapters: int, max_loras: int, given: int | None = None) -> int:
    """`PoolLayout.from_budget`'s `residual_copies`: `given`, else under `forkkv` one per adapter
    that can be in a device slot at once (of `adapters` loaded, `max_loras` slots with the base
    model's), else one."""
    if given:
        return given
    return max(1, min(adapters, max_loras - 1)) if get_policy(policy).name == "forkkv" else 1
