"""The matmul of every projection: x times an HF-layout weight, accumulated in float32.

Weights keep HF's `[out, in]` layout (a checkpoint loads by name, with no transposition); the
product is rounded once, to x's dtype, as HF rounds it. Shared by the LoRA projections
(lora/layers.py) and the model's logits (models/transformer.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Contract x [..., in] with w [out, in] (HF layout) -> [..., out].
_XW = (((1,), (1,)), ((), ()))


def linear(x, w, precision, bias=None):
    """x [T, in], w [out, in], bias [out] | None -> [T, out]; float32 accumulation, one rounding."""
    return linear_f32(x, w, precision, bias).astype(x.dtype)


def linear_f32(x, w, precision, bias=None):
    """`linear` before its rounding: [T, out] float32."""
    y = jax.lax.dot_general(x, w, _XW, precision=precision, preferred_element_type=jnp.float32)
    return y if bias is None else y + bias.astype(jnp.float32)
