"""The paged attention contract in plain jnp: dense gather, reconstruct, masked softmax, all in
float32 (HIGHEST precision). The kernels are tested against these (and against a float64 numpy
model); the engine runs them off the GPU.

    decode   one new token per request: q [B, Hq, D], lengths [B] (the current token included,
             already written to the pools) -> [B, Hq, D]
    extend   a chunk of new tokens per request, causal: q [B, T, Hq, D] padded per request,
             prefix_lengths [B] cached tokens before the chunk, chunk_lengths [B] <= T new ones;
             new token t sits at position prefix_lengths[b] + t -> [B, T, Hq, D], rows past the
             chunk zero
    pools    base [Hkv, P, S, D] (or [L, Hkv, P, S, D] with `layer`), residual [Pr, S, R] (or
             [L, Pr, S, R]); page tables [B, M] int32

ResidualAttention (`residual_*`) attends to K = bK + RoPE(rK B_k), V = bV + rV B_v with each
request's adapter's B_k, B_v [A, R, Hkv, D]; unified attention (`unified_*`) to merged K/V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from forkjax.rope import rope_cos_sin, rotate_half


def _gather_pool(pool, pages, layer):
    """[(L,) H, P, S, X] pool, [B, M] pages -> [B, H, M*S, X] f32; [(L,) P, S, X] -> [B, M*S, X]."""
    if layer is not None:
        pool = pool[layer]
    if pool.ndim == 4:
        g = pool[:, pages]  # [H, B, M, S, X]
        h, b, m, s, x = g.shape
        return g.reshape(h, b, m * s, x).transpose(1, 0, 2, 3).astype(jnp.float32)
    g = pool[pages]  # [B, M, S, X]
    b, m, s, x = g.shape
    return g.reshape(b, m * s, x).astype(jnp.float32)


def _reference(q, k_base, v_base, base_pages, prefix_lengths, chunk_lengths, res, layer,
               sm_scale):
    hi = lax.Precision.HIGHEST
    B, T, Hq, D = q.shape
    Hkv = k_base.shape[-4]
    G = Hq // Hkv
    k = _gather_pool(k_base, base_pages, layer)  # [B, Hkv, N, D]
    v = _gather_pool(v_base, base_pages, layer)
    N = k.shape[2]
    if res is not None:
        k_res, v_res, res_pages, b_k, b_v, adapter_ids, inv_freq = res
        rk = _gather_pool(k_res, res_pages, layer)  # [B, N, R]
        rv = _gather_pool(v_res, res_pages, layer)
        bk = b_k[adapter_ids].astype(jnp.float32)  # [B, R, Hkv, D]
        bv = b_v[adapter_ids].astype(jnp.float32)
        y = jnp.einsum("bnr,brhd->bhnd", rk, bk, precision=hi)
        c, s = rope_cos_sin(jnp.arange(N), inv_freq, full=True)  # [N, D]
        k = k + y * c + rotate_half(y) * s
        v = v + jnp.einsum("bnr,brhd->bhnd", rv, bv, precision=hi)
    total = (prefix_lengths + chunk_lengths).astype(jnp.int32)
    kv = jnp.arange(N)
    kv_ok = kv[None, :] < total[:, None]  # [B, N]
    v = jnp.where(kv_ok[:, None, :, None], v, 0.0)
    pos = prefix_lengths[:, None] + jnp.arange(T)[None, :]  # [B, T]
    vis = (kv[None, None, :] <= pos[:, :, None]) & kv_ok[:, None, :]  # [B, T, N]
    qf = q.astype(jnp.float32).reshape(B, T, Hkv, G, D)
    scale = D ** -0.5 if sm_scale is None else sm_scale
    logits = jnp.einsum("bthgd,bhnd->bthgn", qf, k, precision=hi) * scale
    logits = jnp.where(vis[:, :, None, None, :], logits, -jnp.inf)
    mx = jnp.max(logits, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.exp(logits - mx)
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den > 0, den, 1.0)
    out = jnp.einsum("bthgn,bhnd->bthgd", p, v, precision=hi).reshape(B, T, Hq, D)
    live = jnp.arange(T)[None, :] < chunk_lengths[:, None]
    return jnp.where(live[:, :, None, None], out, 0.0).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def residual_attention_decode_reference(q, k_base, v_base, k_res, v_res, base_pages, res_pages,
                                        lengths, b_k, b_v, adapter_ids, inv_freq, *,
                                        sm_scale=None, layer=None):
    """Same contract as `residual_attention_decode`; dense, float32."""
    lengths = lengths.astype(jnp.int32)
    return _reference(q[:, None], k_base, v_base, base_pages, lengths - 1,
                      jnp.ones_like(lengths),
                      (k_res, v_res, res_pages, b_k, b_v, adapter_ids, inv_freq),
                      layer, sm_scale)[:, 0]


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def residual_attention_extend_reference(q, k_base, v_base, k_res, v_res, base_pages, res_pages,
                                        prefix_lengths, chunk_lengths, b_k, b_v, adapter_ids,
                                        inv_freq, *, sm_scale=None, layer=None):
    """Same contract as `residual_attention_extend`; dense, float32."""
    return _reference(q, k_base, v_base, base_pages, prefix_lengths.astype(jnp.int32),
                      chunk_lengths.astype(jnp.int32),
                      (k_res, v_res, res_pages, b_k, b_v, adapter_ids, inv_freq),
                      layer, sm_scale)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def unified_attention_decode_reference(q, k_pages, v_pages, page_table, lengths, *,
                                       sm_scale=None, layer=None):
    """Same contract as `unified_attention_decode`; dense, float32."""
    lengths = lengths.astype(jnp.int32)
    return _reference(q[:, None], k_pages, v_pages, page_table, lengths - 1,
                      jnp.ones_like(lengths), None, layer, sm_scale)[:, 0]


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def unified_attention_extend_reference(q, k_pages, v_pages, page_table, prefix_lengths,
                                       chunk_lengths, *, sm_scale=None, layer=None):
    """Same contract as `unified_attention_extend`; dense, float32."""
    return _reference(q, k_pages, v_pages, page_table, prefix_lengths.astype(jnp.int32),
                      chunk_lengths.astype(jnp.int32), None, layer, sm_scale)
