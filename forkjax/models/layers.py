"""Building blocks computed exactly as HF transformers computes them (Llama/Qwen2).

The projections are `forkjax.lora.layers.LoRALinear` (its matmul: `forkjax.linear`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):  # x [..., dim]
        # HF: normalise in float32, cast back to the input dtype, then scale.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


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


def rope_cos_sin(positions, inv_freq, dtype):
    """positions [T] int, inv_freq [D/2] f32 -> (cos, sin) [T, D] in `dtype` (HF rounds them too)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x, cos, sin):
    """x [T, H, D], cos/sin [T, D]: HF rotate-half RoPE."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
