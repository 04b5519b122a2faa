"""The split-K (flash-decoding) combine of the attention kernels' partials, plain jnp.

A kernel that splits a sequence's keys over KS programs writes, per split s and query row, the
unnormalised accumulator o_s = sum_t exp2(x_t - m_s) v_t, the running maximum m_s (base 2) and
the sum l_s = sum_t exp2(x_t - m_s). With w_s = exp2(m_s - max_s m_s):

    out = sum_s w_s o_s / sum_s w_s l_s

ResidualAttention also writes acc_r,s = sum_t p_t rV_t (rank R wide): V = bV + rV B_v is linear,
so B_v is applied once, to sum_s w_s acc_r,s, instead of inside every kernel's loop.
The Mosaic kernel's transposed epilogue, as one Triton kernel, is
`mosaic_operands.residual_combine`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def combine_splits(o, m, l, o_r=None, b_v=None):
    """Flash-decoding combine of split-K partials -> normalised float32 [B, Hkv, rows, D].

    o [B, KS, Hkv, rows, D], m / l [B, KS, Hkv, rows] (running max in base 2, unnormalised sum);
    for ResidualAttention also o_r [B, KS, Hkv, rows, R] and each request's B_v [B, R, Hkv, D],
    applied once, to the combined accumulator. Rows no split saw (l = 0) come out as 0.
    """
    if o.shape[1] == 1:  # one split (large batches): nothing to rescale
        o_sum, l_sum = o[:, 0], l[:, 0]
        if o_r is not None:
            o_sum = o_sum + _apply_b_v(o_r[:, 0], b_v)
    else:
        m_max = lax.optimization_barrier(jnp.max(m, axis=1, keepdims=True))
        w = jnp.exp2(m - m_max)  # [B, KS, Hkv, rows]
        l_sum = jnp.sum(w * l, axis=1)
        o_sum = jnp.sum(w[..., None] * o, axis=1)
        if o_r is not None:  # acc + acc_r @ B_v
            o_sum = o_sum + _apply_b_v(jnp.sum(w[..., None] * o_r, axis=1), b_v)
    return o_sum / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]


def _apply_b_v(o_r, b_v):
    """o_r [B, Hkv, rows, R] @ b_v [B, R, Hkv, D] (each request's, as gathered) in float32 as R
    broadcast multiply-adds: all element-wise, so XLA fuses it with the combine and the gather,
    where a batched dot would be a GEMM kernel of its own."""
    out = o_r[..., 0, None] * b_v[:, 0, :, None]
    for r in range(1, o_r.shape[-1]):
        out = out + o_r[..., r, None] * b_v[:, r, :, None]
    return out
