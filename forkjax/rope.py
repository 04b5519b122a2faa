"""Rotary position embeddings (rotate-half, as HF Llama/Qwen2): frequencies, cos/sin tables and
the rotation, for the model and the attention kernels alike.

For a head vector x = (x1, x2) (halves of D/2) at position t, with angles a_j = t * w_j:

    RoPE_t(x) = x * [cos a, cos a] + rotate_half(x) * [sin a, sin a],  rotate_half(x) = (-x2, x1)
              = (x1 cos a - x2 sin a, x2 cos a + x1 sin a)

Two ways to form the angle, chosen by `rope_cos_sin(exact=)`:

* HF's (`exact=False`, the model's projections): t * w rounded to float32, then cos/sin of that.
  At t = 30k that angle is off by up to half an ulp, 1e-3 rad for the fastest frequency; the model
  matches HF by rounding where HF rounds.
* Exact (`exact=True`, the kernels): the kernels split a position into a block start and an
  offset and rotate by each separately (angle addition), so each part must be accurate on its
  own. The product t * w is split into four partial products that are exact in float32 (12-bit
  halves of t and of w) and the rotations by each part are composed: within a few 1e-7 of the
  float64 cos(t * w) for t < 2**24 (tests/test_paged_attention_kernels.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, llama3 scaling applied as HF does (float32)."""
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim)
    inv_freq = (f32(1.0) / (f32(theta) ** exponent)).astype(f32)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (f32(2 * math.pi) / inv_freq).astype(f32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / f32(factor), inv_freq).astype(f32)
    smooth = ((f32(old_len) / wavelen - f32(low)) / f32(high - low)).astype(f32)
    smoothed = ((1 - smooth) * scaled / f32(factor) + smooth * scaled).astype(f32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array, dtype=jnp.float32, *,
                 exact: bool = True, full: bool = False) -> tuple[jax.Array, jax.Array]:
    """positions int [...], inv_freq f32 [H] -> (cos, sin) [..., H] of positions * inv_freq, or
    [..., 2H] with `full` (each table twice along the last axis, as rotate-half multiplies x by
    it), rounded to `dtype` (HF rounds the model's tables to its dtype).

    exact: the angle from exact partial products (the kernels); False: rounded to float32 first,
    HF's way (the model). See the module docstring."""
    if not exact:  # HF: the angle in float32, duplicated, then cos/sin
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq
        if full:
            freqs = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(freqs).astype(dtype), jnp.sin(freqs).astype(dtype)
    c, s = _exact_cos_sin(positions, inv_freq)
    if full:
        c, s = jnp.concatenate([c, c], axis=-1), jnp.concatenate([s, s], axis=-1)
    return c.astype(dtype), s.astype(dtype)


def _exact_cos_sin(positions, inv_freq):
    """cos, sin f32 [..., H] of positions * inv_freq from exact partial products."""
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


def rotate_half(x: jax.Array) -> jax.Array:
    """HF rotate_half along the last axis: [x1, x2] -> [-x2, x1]."""
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rope(x, cos, sin):
    """x [T, H, D], cos/sin [T, D] (`rope_cos_sin(..., full=True)`): HF rotate-half RoPE."""
    rotated = rotate_half(x)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
