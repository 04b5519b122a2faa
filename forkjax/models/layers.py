"""Building blocks computed exactly as HF transformers computes them (Llama/Qwen2).

The projections are `forkjax.lora.layers.LoRALinear` (its matmul: `forkjax.linear`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
