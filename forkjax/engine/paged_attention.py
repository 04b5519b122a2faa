"""The paged attention backend the model calls inside the jitted step.

Per layer: scatter the step's new K/V into the pools (only slots the cache marked as misses; the
rest go to the sink page), then attend over the pools through the page tables, so attention
always reads K/V from the cache after the write. Residual policies store (xW, xA) apart and
attend with ResidualAttention; `prefix` / `full_reuse` store merged K/V and attend with the
unified kernel. On the CPU the plain-jnp references stand in for the Pallas kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from forkjax import pallas_kernels as pk
from forkjax.cache import write_kv
from forkjax.models.attention import QKV
from forkjax.pallas_kernels import kv_write, mgpu_decode, mgpu_operands


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedMeta:
    base_slots: jax.Array  # [T] int32 flat write slot (page·S + offset), 0 = do not write
    res_slots: jax.Array  # [T] int32
    base_pages: jax.Array  # [B, M] int32 page tables
    res_pages: jax.Array  # [B, M] int32
    prefix_lengths: jax.Array  # [B] int32 tokens before this step's chunk
    chunk_lengths: jax.Array  # [B] int32 tokens in the chunk (1 in decode)
    adapter_ids: jax.Array  # [B] int32 LoRA slot of each request
    # [T, N] int32 residual slot of each token for every adapter slot it fans out to (0: none);
    # None in programs without residual fan-out
    fan_slots: jax.Array | None = None


def paged_attention(layer, qkv: QKV, batch, pools, *, kind: str, residual: bool, inv_freq,
                    use_pallas: bool, precision=None, fan_checks: list | None = None):
    """T tokens (T = B in decode, B·C in extend) -> ([T, Hq, D], pools).

    fan_checks: with residual fan-out, each layer appends [T, N] bool: the fan-out residuals it
    wrote for adapter slot j are finite (another agent's A on this one's hidden states may
    overflow; `_forward` reduces them, and the host then keeps those pages out of j's tree)."""
    m = batch.attn
    hq, hkv, hd = qkv.heads
    b_k, b_v = qkv.b("k_proj"), qkv.b("v_proj")
    n, r = b_k.shape[:2]
    b_k4, b_v4 = b_k.reshape(n, r, hkv, hd), b_v.reshape(n, r, hkv, hd)
    write = _with_fanout(_kv_writer(use_pallas, pools), qkv, m.fan_slots, fan_checks)
    if kind == "decode" and residual and use_pallas and _fused_decode(qkv, pools):
        # one Triton kernel from the q|k|v GEMM's output to the Mosaic kernel's operands and
        # the K/V to write (was ~8 XLA kernels and `query_operands`)
        n_q = mgpu_decode.query_rows(hq // hkv, True)
        b_q = qkv.b("q_proj") if "q_proj" in qkv.proj.lora else None
        qx, w, kb, vb, kr, vr = mgpu_operands.decode_operands(
            qkv.y, *qkv.rope, b_q, b_k4, m.adapter_ids, heads=qkv.heads, cols=qkv.columns(),
            n_q=n_q, dtype=pools.base_k.dtype)
        pools = write(pools, layer, m.base_slots, m.res_slots, kb, vb, kr, vr)
        out = mgpu_decode.mgpu_residual_decode(
            (qx, w), pools.base_k, pools.base_v, pools.res_k, pools.res_v, m.base_pages,
            m.res_pages, m.prefix_lengths + 1, b_k4, b_v4, m.adapter_ids, inv_freq, layer=layer)
        return out, pools
    q = qkv.q()
    t = q.shape[0]
    if residual:
        (kb, kr), (vb, vr) = qkv.k(), qkv.v()
        pools = write(pools, layer, m.base_slots, m.res_slots, kb, vb, kr, vr)
    else:
        keys, values = qkv.merged_kv(precision)
        pools = write(pools, layer, m.base_slots, m.res_slots, keys, values)
    nb = m.prefix_lengths.shape[0]
    ops = _KERNELS if use_pallas else _REFERENCES
    # Off the GPU the kernels run interpreted (slow; tests of the kernel path through the engine).
    extra = {"interpret": jax.default_backend() != "gpu"} if use_pallas else {}
    if kind == "decode":
        lengths = m.prefix_lengths + 1
        if residual:
            out = ops["res_decode"](q, pools.base_k, pools.base_v, pools.res_k, pools.res_v,
                                    m.base_pages, m.res_pages, lengths, b_k4, b_v4,
                                    m.adapter_ids, inv_freq, layer=layer, **extra)
        else:
            out = ops["uni_decode"](q, pools.base_k, pools.base_v, m.base_pages, lengths,
                                    layer=layer, **extra)
        return out, pools
    q4 = q.reshape(nb, t // nb, hq, hd)
    if residual:
        out = ops["res_extend"](q4, pools.base_k, pools.base_v, pools.res_k, pools.res_v,
                                m.base_pages, m.res_pages, m.prefix_lengths, m.chunk_lengths,
                                b_k4, b_v4, m.adapter_ids, inv_freq, layer=layer, **extra)
    else:
        out = ops["uni_extend"](q4, pools.base_k, pools.base_v, m.base_pages, m.prefix_lengths,
                                m.chunk_lengths, layer=layer, **extra)
    return out.reshape(t, hq, hd), pools


def _with_fanout(write, qkv: QKV, fan_slots, checks: list | None):
    """Residual fan-out: the K/V write also stores every token's x·A_j of the adapter slots j in
    `fan_slots` [T, N] (0: not written), beside its own residual, in the same kernel; `checks`
    gets their finiteness [T, N]."""
    if fan_slots is None:
        return write

    def write_all(pools, layer, base_slots, res_slots, k, v, xa_k=None, xa_v=None):
        res_slots = jnp.concatenate([res_slots[:, None], fan_slots], axis=1)  # [T, 1 + N]
        xa_k, xa_v = (jnp.concatenate([own[:, None].astype(qkv.y.dtype), qkv.all_slots_xa(part)],
                                      axis=1)  # [T, 1 + N, R]
                      for own, part in ((xa_k, "k_proj"), (xa_v, "v_proj")))
        if checks is not None:
            checks.append(jnp.isfinite(xa_k[:, 1:]).all(-1) & jnp.isfinite(xa_v[:, 1:]).all(-1))
        return write(pools, layer, base_slots, res_slots, k, v, xa_k, xa_v)
    return write_all


def _fused_decode(qkv: QKV, pools) -> bool:
    """Whether a residual decode runs `decode_operands` and the Mosaic kernel: on a GPU, where
    `residual_attention_decode` would run that kernel and Triton's blocks fit the shapes."""
    hq, hkv, hd = qkv.heads
    r = pools.res_k.shape[-1]
    return (mgpu_decode.serves(hq, hkv, hd, pools.base_k.shape[-2], r, pools.base_k.dtype)
            and mgpu_operands.supported(hq // hkv, r, hd))


def _kv_writer(use_pallas: bool, pools):
    """On a GPU's kernel path one Mosaic GPU kernel for all of a layer's K/V writes (kv_write.py:
    four XLA scatters cost ~4x its time in a decode step), else XLA's scatters (`write_kv`)."""
    if use_pallas and jax.default_backend() == "gpu" and kv_write.supports(pools):
        return kv_write.kv_write
    return write_kv


_KERNELS = dict(res_decode=pk.residual_attention_decode, res_extend=pk.residual_attention_extend,
                uni_decode=pk.unified_attention_decode, uni_extend=pk.unified_attention_extend)
_REFERENCES = dict(res_decode=pk.residual_attention_decode_reference,
                   res_extend=pk.residual_attention_extend_reference,
                   uni_decode=pk.unified_attention_decode_reference,
                   uni_extend=pk.unified_attention_extend_reference)
