"""Batched multi-LoRA matmul over tokens grouped by adapter slot (SGMV-style segments).

The batch's tokens are laid out so that all tokens of adapter slot 0 come first, then slot 1, ...
(`group_sizes[s]` tokens for slot `s`; the host orders requests by slot when it builds a batch);
the model takes each token's slot (`token_slots`), N where no adapter acts on it.
Each half of LoRA is one dense GEMM against all N slots side by side: shrink x [T, d_in] @ A^T
(A [N·R, d_in]; the model appends A to its projection's weight, so this GEMM is the projection's)
and keep only the token's own R columns, selected, not multiplied by a 0/1 mask (another slot's
xA may be inf or NaN, and 0 × inf is NaN: a token's output depends on its own slot's weights
alone); expand multiplies that [T, N·R] row, exact zeros outside the slot, by B [N·R, d_out].

Why not `jax.lax.ragged_dot` (the grouped GEMM): XLA's GPU lowering of it costs about N× the
single-group time, more than the base projection at N = 8, while this formulation stays near the
one-adapter time, N·R = 128 columns being still a thin GEMM (BENCHMARKS.md, "Many adapters").

Cost for T tokens, N adapter slots, rank R, a projection d_in -> d_out:
  FLOPs  2·T·N·R·(d_in + d_out): N× the grouped minimum, a few % of the base projection for
         N·R << d_out (the base is 2·T·d_in·d_out).
  bytes  N·R·(d_in + d_out) of adapter weights read once, plus the activations.
Never materialised: a per-token [d_in, R] weight (T·d_in·R elements), the naive gather
formulation `lora_naive_reference`, which exists only for tests.
Rows past sum(group_sizes) (batch padding) come out as zeros.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class OwnRows:
    """Slot rows of the `sgmv` LoRA path (layers.py): each token's own xA [T, R] and its
    slot [T] (N: padding), where the dense path keeps [T, N, R] with zeros outside the slot."""
    xa: jax.Array
    slots: jax.Array


def lora_shrink(x, a, group_sizes, precision=None):
    """x [T, d_in] · a [N, R, d_in] grouped by `group_sizes` [N] int32 -> slot rows [T, N, R].

    a lies like a weight ([out, in] rows, N·R of them), so the model appends it to the base
    weight's rows and gets xA from the projection's own GEMM (`LoRALinear`)."""
    n, r, d_in = a.shape
    xa = jax.lax.dot_general(x, a.reshape(n * r, d_in), (((1,), (1,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
    return slot_rows(xa.astype(x.dtype).reshape(-1, n, r), slots_from_group_sizes(group_sizes, x.shape[0]), n)


def slot_rows(xa, slots, n: int):
    """xa [T, ..., N or 1, R] (every slot's xA, or one slot's broadcast to the N slots), slots [T]
    int32 (N: none) -> [T, ..., N, R] with zeros outside each token's own slot: the rows
    `lora_expand` multiplies by all N B's at once. `own_slot` reads xA [T, ..., R] back. A token
    of slot N (padding, or an aLoRA request's token before its invocation) gets all zeros."""
    own = slots[:, None] == jnp.arange(n)  # [T, N]
    own = own.reshape(own.shape[:1] + (1,) * (xa.ndim - 3) + (n, 1))
    return jnp.where(own, xa, jnp.zeros((), xa.dtype))


def own_slot(rows):
    """Slot rows [T, ..., N, R] (or `OwnRows`) -> xA [T, ..., R] of each token's slot."""
    return rows.xa if isinstance(rows, OwnRows) else jnp.sum(rows, axis=-2)


def lora_expand(rows, b, precision=None):
    """Slot rows [T, N, R] · b [N, R, d_out] (LoRA scale folded in) -> [T, d_out] (rows' dtype)."""
    n, r, d_out = b.shape
    return jnp.dot(rows.reshape(-1, n * r), b.reshape(n * r, d_out), precision=precision,
                   preferred_element_type=jnp.float32).astype(rows.dtype)


def slots_from_group_sizes(group_sizes, num_tokens: int):
    """[N] group sizes -> [T] adapter slot of every token (padding rows get slot N)."""
    # Count the group ends at or before each row: jnp.searchsorted lowers to a while loop, which
    # XLA's GPU runtime drives from the host, on every step.
    ends = jnp.cumsum(group_sizes)
    return jnp.sum(jnp.arange(num_tokens)[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def token_slots(group_sizes, positions, lora_starts):
    """The LoRA slot of every token [T] int32: its group's (`group_sizes` [N]), or N (no
    adapter) before its row's activation position. positions [T] int32; lora_starts [B] int32
    (T = B·C, C positions a row): the first position the row's adapter acts on (Activated LoRA:
    its invocation's start; -1 for a plain adapter, which acts everywhere)."""
    n, t = group_sizes.shape[0], positions.shape[0]
    start = jnp.repeat(lora_starts, t // lora_starts.shape[0])  # [T]
    return jnp.where(positions >= start, slots_from_group_sizes(group_sizes, t), n)


def lora_naive_reference(x, a, b, slots):
    """x [T, d_in], a [N, R, d_in], b [N, R, d_out], slots [T] -> x A_s B_s [T, d_out] in float32.

    Gathers a per-token [d_in, R] weight: the formulation the grouped one avoids. Tests only.
    """
    a_tok = a.transpose(0, 2, 1)[slots].astype(jnp.float32)  # [T, d_in, R]
    b_tok = b[slots].astype(jnp.float32)  # [T, R, d_out]
    xa = jnp.einsum("td,tdr->tr", x.astype(jnp.float32), a_tok, precision="highest")
    return jnp.einsum("tr,tro->to", xa, b_tok, precision="highest")
