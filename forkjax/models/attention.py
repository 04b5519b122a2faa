"""Dense causal attention over a flat batch of whole sequences: the no-cache reference backend.

K and V arrive as (base, residual) pairs and are merged at once: K = bK + RoPE(rK·B_k),
V = bV + rV·B_v. RoPE is linear, so this equals RoPE of the merged projection, as HF computes it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from forkjax.lora.batched import lora_expand, slot_rows
from forkjax.models.layers import apply_rope


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseMeta:
    segment_ids: jax.Array  # [T] int32 sequence of every token; -1 for padding


def merge_kv(k, v, b_k, b_v, rope, group_sizes, precision=None):
    """(base [T,Hkv,D], res [T,R]) pairs -> full K (RoPE) and V, each [T, Hkv, D]."""
    (kb, kr), (vb, vr) = k, v
    t, hkv, hd = kb.shape
    # kr[:, None] [T, 1, R]: slot_rows broadcasts it over the N slots
    k_lora = lora_expand(slot_rows(kr[:, None], group_sizes), b_k, precision)
    v_lora = lora_expand(slot_rows(vr[:, None], group_sizes), b_v, precision)
    k_lora, v_lora = k_lora.reshape(t, hkv, hd), v_lora.reshape(t, hkv, hd)
    return kb + apply_rope(k_lora, *rope), vb + v_lora


def dense_attention(layer, q, k, v, b_k, b_v, rope, batch, state, precision=None):
    """Causal attention within each segment. q [T, Hq, D] (RoPE applied) -> [T, Hq, D]."""
    del layer
    keys, values = merge_kv(k, v, b_k, b_v, rope, batch.group_sizes, precision)
    t, hq, hd = q.shape
    group = hq // keys.shape[1]
    keys = jnp.repeat(keys, group, axis=1)
    values = jnp.repeat(values, group, axis=1)
    seg, pos = batch.attn.segment_ids, batch.positions
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None]) & (seg[:, None] >= 0)
    scores = jnp.einsum("qhd,khd->hqk", q, keys, precision=precision,
                        preferred_element_type=jnp.float32) * (hd ** -0.5)
    scores = jnp.where(mask[None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("hqk,khd->qhd", probs, values, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.astype(q.dtype), state
