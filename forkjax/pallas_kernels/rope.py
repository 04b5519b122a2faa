"""Accurate RoPE cos/sin tables for the attention kernels.

`cos(t * inv_freq)` with the angle rounded to float32 (HF's way) is off by up to half an ulp of
the angle: 1e-3 rad at t = 30k for the fastest frequency. The kernels split a position into a
block start and an offset and rotate by each separately (angle addition), so they need each part
accurate on its own. Here the product t * w is split into four partial products that are exact in
float32 (12-bit halves of t and of w), and the rotations by each part are composed: the result is
within a few 1e-7 of the float64 `cos(t * w)` for t < 2**24 (checked in tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions int [...], inv_freq f32 [H] -> (cos, sin) f32 [..., H] of positions * inv_freq."""
    w = inv_freq.astype(jnp.float32)
    # High 12 significant bits of w; the low part w - w_hi is exact and has at most 12 bits too.
    w_hi = lax.bitcast_convert_type(
        lax.bitcast_convert_type(w, jnp.uint32) & jnp.uint32(0xFFFFF000), jnp.float32)
    w_lo = w - w_hi
    p = positions.astype(jnp.int32)[..., None]
    t_hi = ((p >> 12) << 12).astype(jnp.float32)  # a 12-bit integer times 4096: exact
    t_lo = (p & 4095).astype(jnp.float32)
    a1 = t_hi * w_hi  # 12 x 12 bits: exact, the large part of the angle
    a3 = t_lo * w_hi  # exact, up to 4096 * w
    a2 = t_hi * w_lo + t_lo * w_lo  # each product exact; the sum is small (~t * w / 4096)
    c1, s1 = jnp.cos(a1), jnp.sin(a1)
    c2, s2 = jnp.cos(a2), jnp.sin(a2)
    c3, s3 = jnp.cos(a3), jnp.sin(a3)
    c12 = c1 * c2 - s1 * s2
    s12 = s1 * c2 + c1 * s2
    return c12 * c3 - s12 * s3, s12 * c3 + c12 * s3


def rope_tables_full(positions: jax.Array, inv_freq: jax.Array, head_dim_padded: int):
    """(cos, sin) [..., head_dim_padded] with rotate-half duplication, zero past 2*len(inv_freq)."""
    c, s = rope_cos_sin(positions, inv_freq)
    c = jnp.concatenate([c, c], axis=-1)
    s = jnp.concatenate([s, s], axis=-1)
    pad = head_dim_padded - c.shape[-1]
    if pad:
        widths = [(0, 0)] * (c.ndim - 1) + [(0, pad)]
        c, s = jnp.pad(c, widths), jnp.pad(s, widths)
    return c, s


def rotate_half(x: jax.Array) -> jax.Array:
    """HF rotate_half along the last axis: [x1, x2] -> [-x2, x1]."""
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)
