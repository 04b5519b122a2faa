"""K-LoRA scores q . RoPE_t(rK_t @ B_k) of every cached position: a prepass of residual decode.

ResidualAttention's decode kernel can rebuild RoPE(rK B_k) inside its KV loop
(residual_attention.py), but there the rotation tiles hold registers for the whole loop (255 and
spills: two programs per SM, 61% of the copy rate at B=32, L=8k on the H200). This kernel
computes the same term first, for every position, as a score per query head:

    s[b, t, n] = q_n . RoPE_t(rK_t @ B_k[a_b, :, h(n)])       (n = h * Gp + g)

and the attention kernel adds s to q . bK, so its loop streams only the base K/V and the V
residual. The scores cost 4 bytes per position and query head, written once and read once
(~6% of the K/V bytes at Llama-3-8B shapes).

A program owns `block_k` positions of one request and walks the KV heads: y = rK B_k^h on the
MMA, the rotation at each position's absolute angle (cos | sin tables of every position, shared
by all programs), then z @ Q^h, where Q^h [Hp, NQ] holds head h's query halves in its own
columns and zeros elsewhere, so every head accumulates into one [block_k, NQ] tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from forkjax.pallas_kernels.padding import flat_rows, lora_b_halves, next_pow2, pad_axis
from forkjax.pallas_kernels.rope import rope_cos_sin


def _scores_kernel(
    kr_ref,  # [Pr*S, Rp] or [L, Pr*S, Rp]  residual key activations (flat token rows)
    rpt_ref,  # [Mp] int32                  residual page table of this request
    len_ref,  # [] int32                    positions to score
    layer_ref,  # [] int32 or None
    bk1_ref,  # [Hkv, Rp, Hp]               B_k columns of the first rotate-half half
    bk2_ref,  # [Hkv, Rp, Hp]
    cos_ref,  # [Mp*S, Hp] float32          cos at every position
    sin_ref,  # [Mp*S, Hp] float32
    q1_ref,  # [Hkv, Hp, NQ]                first half of each head's queries, in its columns
    q2_ref,  # [Hkv, Hp, NQ]
    o_ref,  # [block_k, NQ] float32
    *,
    block_k: int,
    page_size: int,
):
    kb = pl.program_id(0)
    dt = q1_ref.dtype
    prec = lax.Precision.HIGHEST if dt == jnp.float32 else None
    dot = functools.partial(plgpu.dot, precision=prec)

    @pl.when(kb * block_k < len_ref[()])  # blocks past the length stay unwritten (never read)
    def _():
        i = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        rows = rpt_ref[kb * (block_k // page_size) + i // page_size] * page_size + i % page_size
        rk = kr_ref[layer_ref[()], rows] if layer_ref is not None else kr_ref[rows]
        c = cos_ref[pl.ds(kb * block_k, block_k), :]
        s = sin_ref[pl.ds(kb * block_k, block_k), :]

        def head(h, acc):
            y1 = dot(rk, bk1_ref[h])  # [block_k, Hp] float32
            y2 = dot(rk, bk2_ref[h])
            z1 = (y1 * c - y2 * s).astype(dt)
            z2 = (y2 * c + y1 * s).astype(dt)
            return acc + dot(z1, q1_ref[h]) + dot(z2, q2_ref[h])

        acc = jnp.zeros(o_ref.shape, jnp.float32)
        o_ref[...] = lax.fori_loop(0, bk1_ref.shape[0], head, acc)


def score_columns(hq: int, hkv: int) -> tuple[int, int]:
    """(Gp, NQ): query g of KV head h is column h * Gp + g of NQ (powers of two, NQ >= 16)."""
    gp = next_pow2(hq // hkv)
    return gp, max(16, next_pow2(hkv * gp))


@functools.partial(jax.jit, static_argnames=("block_k", "num_warps", "num_stages", "interpret"))
def k_lora_scores(
    q,  # [B, Hq, D]      queries, RoPE applied
    k_res,  # [Pr, S, R]      residual key activations; [L, Pr, S, R] with `layer`
    res_pages,  # [B, M] int32
    lengths,  # [B] int32       positions to score per request
    b_k,  # [A, R, Hkv, D]  LoRA scale folded in
    adapter_ids,  # [B] int32
    inv_freq,  # [D//2] float32
    layer=None,  # int32 scalar with layered pools
    *,
    block_k=64,
    num_warps=4,
    num_stages=2,
    interpret=False,
):
    """-> [B, Mp*S, NQ] float32 scores (Mp: M rounded up to whole blocks; see score_columns).
    Rows at or past lengths[b], rounded up to a block, are left unwritten."""
    B, Hq, D = q.shape
    S, R = k_res.shape[-2:]
    Hkv = b_k.shape[2]
    G = Hq // Hkv
    gp, nq = score_columns(Hq, Hkv)
    h, dt = D // 2, k_res.dtype
    hp, rp = max(16, next_pow2(h)), max(16, next_pow2(R))
    block_k = max(block_k, S)
    ppb = block_k // S
    n_blocks = -(-res_pages.shape[1] // ppb)
    rpt = pad_axis(res_pages.astype(jnp.int32), 1, n_blocks * ppb)
    kr = flat_rows(k_res, rp)
    bk1, bk2 = lora_b_halves(b_k, adapter_ids, rp, hp, dt)
    c, s = rope_cos_sin(jnp.arange(n_blocks * block_k), inv_freq)  # [positions, D/2]
    c, s = pad_axis(c, 1, hp), pad_axis(s, 1, hp)
    # Queries in their own columns: Q^h[d, h * gp + g] = q[h * G + g, d].
    qg = pad_axis(q.astype(dt).reshape(B, Hkv, G, D), 2, gp)
    place = jnp.eye(Hkv, dtype=dt)

    def columns(x):  # [B, Hkv, gp, h] -> [B, Hkv, hp, nq]
        x = jnp.einsum("bhgd,hk->bhdkg", pad_axis(x, 3, hp), place).reshape(B, Hkv, hp, Hkv * gp)
        return pad_axis(x, 3, nq)

    q1, q2 = columns(qg[..., :h]), columns(qg[..., h:])
    layered = layer is not None
    per_req = lambda *blk: pl.BlockSpec((None,) + blk, lambda i, b: (b,) + (0,) * len(blk))  # noqa: E731
    table = pl.BlockSpec(c.shape, lambda i, b: (0, 0))
    return pl.pallas_call(
        functools.partial(_scores_kernel, block_k=block_k, page_size=S),
        grid=(n_blocks, B),
        in_specs=[pl.BlockSpec(kr.shape, lambda i, b: (0,) * kr.ndim), per_req(rpt.shape[1]),
                  pl.BlockSpec((None,), lambda i, b: (b,)),
                  pl.BlockSpec((None,), lambda i, b: (0,)) if layered else None,
                  per_req(Hkv, rp, hp), per_req(Hkv, rp, hp), table, table,
                  per_req(Hkv, hp, nq), per_req(Hkv, hp, nq)],
        out_specs=pl.BlockSpec((None, block_k, nq), lambda i, b: (b, i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, n_blocks * block_k, nq), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"k_lora_scores_bk{block_k}",
    )(kr, rpt, lengths.astype(jnp.int32),
      jnp.asarray(layer, jnp.int32).reshape(1) if layered else None, bk1, bk2, c, s, q1, q2)


def k_lora_scores_reference(q, k_res, res_pages, lengths, b_k, adapter_ids, inv_freq, layer=None):
    """Plain jnp: [B, M*S, NQ] float32, zero past each length and in padding columns."""
    B, Hq, D = q.shape
    Hkv = b_k.shape[2]
    G, h = Hq // Hkv, D // 2
    gp, nq = score_columns(Hq, Hkv)
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    rk = (k_res[layer] if layer is not None else k_res)[res_pages].astype(f32)  # [B, M, S, R]
    rk = rk.reshape(B, -1, rk.shape[-1])  # [B, M*S, R]
    y = jnp.einsum("btr,brhd->bthd", rk, b_k[adapter_ids].astype(f32), precision=hi)
    c, s = rope_cos_sin(jnp.arange(rk.shape[1]), inv_freq)
    c, s = c[None, :, None], s[None, :, None]
    k = jnp.concatenate([y[..., :h] * c - y[..., h:] * s, y[..., h:] * c + y[..., :h] * s], -1)
    out = jnp.einsum("bthd,bhgd->bthg", k, q.astype(f32).reshape(B, Hkv, G, D), precision=hi)
    out = pad_axis(out, 3, gp).reshape(B, -1, Hkv * gp)
    live = jnp.arange(rk.shape[1])[None, :, None] < lengths[:, None, None]
    return pad_axis(jnp.where(live, out, 0.0), 2, nq)
