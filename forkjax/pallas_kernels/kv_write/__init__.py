"""A layer's K/V cache writes: the public functions are in api.py, which picks their backend
(mosaic.py, or the XLA scatters of reference.py's `write_kv`); `KVPools`, the pools they write,
is here."""

from __future__ import annotations

from typing import NamedTuple

import jax


class KVPools(NamedTuple):
    """The paged KV pools the write fills and attention reads (their layout: cache/pool.py;
    allocated by runtime/kv_pools.py)."""
    base_k: jax.Array  # [L, Hkv, P, S, D]
    base_v: jax.Array  # [L, Hkv, P, S, D]
    res_k: jax.Array  # [L, Pr, S, R]
    res_v: jax.Array  # [L, Pr, S, R]
