"""The paged attention backend the model calls inside the jitted step.

Per layer: scatter the step's new K/V into the pools (only slots the cache marked as misses; the
rest go to the sink page), then attend over the pools through the page tables, so attention
always reads K/V from the cache after the write. Residual policies store (xW, xA) apart and
attend with ResidualAttention; `prefix` / `full_reuse` store merged K/V and attend with the
unified kernel. Which implementation runs is the kernels' api.py's choice: `use_pallas=False`
asks for the plain-jnp references, `use_pallas=True` for the automatic choice among the Pallas
kernels (interpreted where jax has no GPU).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from forkjax.models.attention import QKV
from forkjax.pallas_kernels.kv_write import KVPools
from forkjax.pallas_kernels.kv_write import api as kv_write
from forkjax.pallas_kernels.paged_attention import api as attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedMeta:
    base_slots: jax.Array  # [T] int32 flat write slot (page·S + offset), 0 = do not write
    res_slots: jax.Array  # [T] int32
    base_pages: jax.Array  # [B, M] int32 page tables
    res_pages: jax.Array  # [B, M] int32
    prefix_lengths: jax.Array  # [B] int32 tokens before this step's chunk
    chunk_lengths: jax.Array  # [B] int32 tokens in the chunk (1 in decode)
    adapter_ids: jax.Array  # [B] int32 LoRA slot whose B attention applies to a row's residual
    # Residual fan-out, F targets a token at most (None in programs without it): [T, F] int32
    # residual slot of each target's row (0: none) and [T, F] int32 its adapter slot
    fan_slots: jax.Array | None = None
    fan_adapters: jax.Array | None = None
    # [T] bool under a residual policy in programs that may hold Activated LoRA rows (else None):
    # the token's LoRA K/V goes into its base K/V. An aLoRA request keeps merged K/V in the base
    # pool, as under `prefix` (its part before the invocation is then the base model's own, which
    # every aLoRA agent shares exactly), and no residual: attention sees its row as the bare base
    # model's (adapter id 0, B = 0).
    fold: jax.Array | None = None


class PagedState(NamedTuple):
    """What the layers thread through attention: the pools, and with residual fan-out whether
    every fan-out residual written so far is finite (another agent's A on this one's hidden
    states may overflow; the host then keeps those pages out of that agent's tree)."""
    pools: KVPools
    fan_ok: jax.Array | None = None  # [T, F] bool, per fan-out target of each token


def paged_attention(layer, qkv: QKV, batch, state: PagedState, *, kind: str, residual: bool,
                    inv_freq, use_pallas: bool):
    """T tokens (T = B in decode, B·C in extend) of layer `layer` (int32 scalar) -> ([T, Hq, D],
    the state with this layer's K/V written)."""
    pools, fan_ok = state
    m = batch.attn
    hq, hkv, hd = qkv.heads
    b_k, b_v = qkv.b("k_proj"), qkv.b("v_proj")
    n, r = b_k.shape[:2]
    b_k4, b_v4 = b_k.reshape(n, r, hkv, hd), b_v.reshape(n, r, hkv, hd)
    run = dict(backend=_backend(use_pallas), interpret=None)  # None: interpreted off a GPU
    checks = []  # this layer's fan-out finiteness [T, F], appended by the write
    write = _with_fanout(_kv_writer(use_pallas, pools), qkv, m.fan_slots, m.fan_adapters, checks)

    def done(out, pools):
        return out, PagedState(pools, fan_ok if fan_ok is None else fan_ok & checks[0])
    # (not with aLoRA rows: the fused kernel reads a row's LoRA slot from adapter_ids, which
    # theirs give up)
    if (kind == "decode" and residual and m.fold is None and qkv.proj.lora_path == "fused"
            and attention.fused_decode_supported(qkv.heads, pools.base_k.shape[-2],
                                                 pools.res_k.shape[-1], pools.base_k.dtype, **run)):
        # one kernel from the q|k|v GEMM's output to the attention kernel's operands and the
        # K/V to write, where XLA would run several
        b_q = qkv.b("q_proj") if "q_proj" in qkv.proj.lora else None
        ops, kb, vb, kr, vr = attention.fused_decode_operands(
            qkv.y, *qkv.rope, b_q, b_k4, m.adapter_ids, heads=qkv.heads, cols=qkv.columns(),
            dtype=pools.base_k.dtype, interpret=None)
        pools = write(pools, layer, m.base_slots, m.res_slots, kb, vb, kr, vr)
        out = attention.fused_residual_decode(
            ops, pools.base_k, pools.base_v, pools.res_k, pools.res_v, m.base_pages,
            m.res_pages, m.prefix_lengths + 1, b_k4, b_v4, m.adapter_ids, inv_freq, layer=layer,
            interpret=None)
        return done(out, pools)
    q = qkv.q()
    t = q.shape[0]
    if residual:
        (kb, kr), (vb, vr) = qkv.k(), qkv.v()
        kb, vb = _fold(qkv, m.fold, kb, vb, kr, vr)
        pools = write(pools, layer, m.base_slots, m.res_slots, kb, vb, kr, vr)
    else:
        keys, values = qkv.merged_kv()
        pools = write(pools, layer, m.base_slots, m.res_slots, keys, values)
    nb = m.prefix_lengths.shape[0]
    if kind == "decode":
        lengths = m.prefix_lengths + 1
        if residual:
            out = attention.residual_attention_decode(
                q, pools.base_k, pools.base_v, pools.res_k, pools.res_v, m.base_pages,
                m.res_pages, lengths, b_k4, b_v4, m.adapter_ids, inv_freq, layer=layer, **run)
        else:
            out = attention.unified_attention_decode(
                q, pools.base_k, pools.base_v, m.base_pages, lengths, layer=layer, **run)
        return done(out, pools)
    q4 = q.reshape(nb, t // nb, hq, hd)
    if residual:
        out = attention.residual_attention_extend(
            q4, pools.base_k, pools.base_v, pools.res_k, pools.res_v, m.base_pages, m.res_pages,
            m.prefix_lengths, m.chunk_lengths, b_k4, b_v4, m.adapter_ids, inv_freq, layer=layer,
            **run)
    else:
        out = attention.unified_attention_extend(
            q4, pools.base_k, pools.base_v, m.base_pages, m.prefix_lengths, m.chunk_lengths,
            layer=layer, **run)
    return done(out.reshape(t, hq, hd), pools)


def _fold(qkv: QKV, fold, kb, vb, kr, vr):
    """Base K/V [T, Hkv, D] with the LoRA K/V of the tokens in `fold` [T] bool (None: none)
    added: residuals kr, vr [T, R]."""
    if fold is None:
        return kb, vb
    k_lora, v_lora = qkv.lora_kv(kr, vr)
    f = fold[:, None, None]
    return (jnp.where(f, kb + k_lora.astype(kb.dtype), kb),
            jnp.where(f, vb + v_lora.astype(vb.dtype), vb))


def _with_fanout(write, qkv: QKV, fan_slots, fan_adapters, checks: list):
    """Residual fan-out: the K/V write also stores every token's x·A_j of the adapter slots j in
    `fan_adapters` [T, F] at `fan_slots` [T, F] (0: not written), beside its own residual, in
    the same kernel; `checks` gets their finiteness [T, F]. F, not the N adapter slots, sets the
    rows a token writes: the kernel takes each row as an operand of its own."""
    if fan_slots is None:
        return write

    def write_all(pools, layer, base_slots, res_slots, k, v, xa_k=None, xa_v=None):
        res_slots = jnp.concatenate([res_slots[:, None], fan_slots], axis=1)  # [T, 1 + F]
        fan_k, fan_v = (jnp.take_along_axis(qkv.all_slots_xa(part), fan_adapters[..., None], axis=1)
                        for part in ("k_proj", "v_proj"))  # [T, F, R]
        finite_k, finite_v = jnp.isfinite(fan_k), jnp.isfinite(fan_v)
        checks.append(finite_k.all(-1) & finite_v.all(-1))
        # A non-finite residual is reported (never cached) and written as zeros: its page outlives
        # this request, and a later reader weighting the stale value by 0 would still get NaN.
        xa_k, xa_v = (jnp.concatenate([own[:, None].astype(qkv.y.dtype), jnp.where(finite, fan, 0)], axis=1)
                      for own, fan, finite in ((xa_k, fan_k, finite_k), (xa_v, fan_v, finite_v)))  # [T, 1 + F, R]
        return write(pools, layer, base_slots, res_slots, k, v, xa_k, xa_v)
    return write_all


def _backend(use_pallas: bool) -> str | None:
    """The kernels' backend argument: None (their automatic choice) or the references."""
    return None if use_pallas else "reference"


def _kv_writer(use_pallas: bool, pools):
    """The K/V write of the engine's kernel path or of its reference path (kv_write/api.py:
    the Mosaic kernel on a GPU where it supports the pools, else XLA's scatters)."""
    return kv_write.kv_writer(pools, backend=_backend(use_pallas), interpret=None)
