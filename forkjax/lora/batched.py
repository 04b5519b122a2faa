"""Batched multi-LoRA matmul over tokens grouped by adapter slot (SGMV-style segments).

The batch's tokens are laid out so that all tokens of adapter slot 0 come first, then slot 1, ...
(`group_sizes[s]` tokens for slot `s`; the host orders requests by slot when it builds a batch, so
no permutation is needed on the device). Both halves of LoRA are then one grouped GEMM each
(`jax.lax.ragged_dot`): group `s` of the rows is multiplied by adapter `s`'s matrix.

Cost for T tokens, N adapter slots, rank R, a projection d_in -> d_out:
  FLOPs  2·T·R·(d_in + d_out) on a backend with a grouped GEMM (GPU Pallas/XLA ragged dot, TPU);
         the generic XLA lowering (CPU) masks the rows per group, 2·N·T·R·(d_in + d_out).
  bytes  N·R·(d_in + d_out) of adapter weights read once, plus the activations.
Never materialised: a per-token [d_in, R] weight (T·d_in·R elements), the naive gather
formulation `lora_naive_reference`, which exists only for tests.
Rows past sum(group_sizes) (batch padding) come out as zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lora_shrink(x, a, group_sizes, precision=None):
    """x [T, d_in] · a [N, d_in, R] grouped by `group_sizes` [N] int32 -> xA [T, R] (x's dtype)."""
    return jax.lax.ragged_dot(x, a, group_sizes, precision=precision,
                              preferred_element_type=jnp.float32).astype(x.dtype)


def lora_expand(xa, b, group_sizes, precision=None):
    """xa [T, R] · b [N, R, d_out] (LoRA scale folded in) -> [T, d_out] (xa's dtype)."""
    return jax.lax.ragged_dot(xa, b, group_sizes, precision=precision,
                              preferred_element_type=jnp.float32).astype(xa.dtype)


def slots_from_group_sizes(group_sizes, num_tokens: int):
    """[N] group sizes -> [T] adapter slot of every token (padding rows get slot N)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(num_tokens), side="right").astype(jnp.int32)


def lora_naive_reference(x, a, b, slots):
    """x [T, d_in], a [N, d_in, R], b [N, R, d_out], slots [T] -> x A_s B_s [T, d_out] in float32.

    Gathers a per-token [d_in, R] weight: the formulation the grouped one avoids. Tests only.
    """
    a_tok = a[slots].astype(jnp.float32)  # [T, d_in, R]
    b_tok = b[slots].astype(jnp.float32)  # [T, R, d_out]
    xa = jnp.einsum("td,tdr->tr", x.astype(jnp.float32), a_tok, precision="highest")
    return jnp.einsum("tr,tro->to", xa, b_tok, precision="highest")
