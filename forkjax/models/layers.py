"""Building blocks computed exactly as HF transformers computes them (Llama/Qwen2).

Weights keep HF's `[out, in]` layout, so a checkpoint loads by name with no transposition.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forkjax.lora.batched import lora_expand, lora_shrink

# Contract x [..., in] with w [out, in] (HF layout) -> [..., out].
_XW = (((1,), (1,)), ((), ()))


def linear(x, w, precision, bias=None):
    """x [T, in], w [out, in], bias [out] | None -> [T, out]; float32 accumulation, one rounding."""
    y = jax.lax.dot_general(x, w, _XW, precision=precision, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


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


class LoRALinear(nnx.Module):
    """A projection with stacked multi-adapter LoRA weights.

    `lora_a` [in, N, R] and `lora_b` [N, R, out] hold N adapter slots (slot 0 is the bare base
    model and stays zero), ranks zero-padded to R, the LoRA scale folded into `lora_b`.
    `__call__` returns the pair (xW + b, xA): K and V keep it (the cache stores the parts apart);
    `merged` adds xA·B at once for the other projections. With `lora=False` (a projection no
    adapter may target, see `lora_target_modules`) it is a plain linear layer: no slots, no work.
    """

    def __init__(self, d_in: int, d_out: int, *, bias: bool, num_slots: int, rank: int, dtype,
                 precision=None, lora: bool = True):
        self.weight = nnx.Param(jnp.zeros((d_out, d_in), dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        self.lora_a = nnx.Param(jnp.zeros((d_in, num_slots, rank), dtype)) if lora else None
        self.lora_b = nnx.Param(jnp.zeros((num_slots, rank, d_out), dtype)) if lora else None
        self.precision = precision

    def base(self, x):
        """x [T, in] -> xW + b [T, out]."""
        return linear(x, self.weight[...], self.precision,
                      None if self.bias is None else self.bias[...])

    def __call__(self, x, group_sizes):
        """x [T, in], group_sizes [N] (tokens grouped by slot) -> (xW + b [T, out], xA [T, R])."""
        return self.base(x), lora_shrink(x, self.lora_a[...], group_sizes, self.precision)

    def expand(self, xa, group_sizes):
        """xA [T, R] -> xA·B [T, out]."""
        return lora_expand(xa, self.lora_b[...], group_sizes, self.precision)

    def merged(self, x, group_sizes):
        if self.lora_a is None:
            return self.base(x)
        y, xa = self(x, group_sizes)
        return y + self.expand(xa, group_sizes)
