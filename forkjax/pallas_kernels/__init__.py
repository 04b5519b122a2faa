"""Pallas GPU kernels over the paged KV caches (interpret=True runs them on the CPU), one folder
per op, each with an `api.py` that is the only place choosing a backend (registry.py):

* paged_attention/: `residual_attention_decode` / `residual_attention_extend`:
  ResidualAttention (ForkKV Alg. 1) over a shared base pool (bCache) and a per-agent residual
  pool (rCache): `forkkv`, `lrshared`. `unified_attention_decode` / `unified_attention_extend`:
  plain paged attention over a merged pool: `prefix`, `full_reuse`. `*_reference`: dense
  plain-jnp versions of the same contracts (tests, CPU engine). Backends: mosaic.py (Mosaic GPU
  residual decode, with mosaic_operands.py), triton.py, reference.py; combine.py the split-K
  combine they share. Kernel options: one frozen `TritonConfig` / `MosaicConfig`, each with its
  backend and its table of tuned defaults.
* kv_write/: a layer's K/V cache writes, one Mosaic GPU kernel (mosaic.py) or XLA's scatters.

All take head-major base pools `[Hkv, P, S, D]` (or `[L, Hkv, P, S, D]` plus `layer=`, which
avoids slicing a layer out of the pool, a copy in XLA). For zero-copy calls make D and the
residual rank R powers of two >= 16 (pad R with zero columns of A / zero rows of B).
tuning.py: the device facts kernels size themselves by; RoPE tables: forkjax.rope.
"""

from forkjax.pallas_kernels.paged_attention.api import (
    MosaicConfig,
    TritonConfig,
    residual_attention_decode,
    residual_attention_decode_reference,
    residual_attention_extend,
    residual_attention_extend_reference,
    unified_attention_decode,
    unified_attention_decode_reference,
    unified_attention_extend,
    unified_attention_extend_reference,
)
from forkjax.rope import rope_cos_sin

__all__ = [
    "MosaicConfig",
    "TritonConfig",
    "residual_attention_decode",
    "residual_attention_decode_reference",
    "residual_attention_extend",
    "residual_attention_extend_reference",
    "unified_attention_decode",
    "unified_attention_decode_reference",
    "unified_attention_extend",
    "unified_attention_extend_reference",
    "rope_cos_sin",
]
