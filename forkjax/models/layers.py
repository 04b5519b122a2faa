"""Building blocks computed exactly as HF transformers computes them (Llama/Qwen2).

Weights keep HF's `[out, in]` layout, so a checkpoint loads by name with no transposition.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forkjax.lora.batched import lora_expand, slot_rows

# Contract x [..., in] with w [out, in] (HF layout) -> [..., out].
_XW = (((1,), (1,)), ((), ()))


def linear(x, w, precision, bias=None):
    """x [T, in], w [out, in], bias [out] | None -> [T, out]; float32 accumulation, one rounding."""
    return linear_f32(x, w, precision, bias).astype(x.dtype)


def linear_f32(x, w, precision, bias=None):
    """`linear` before its rounding: [T, out] float32."""
    y = jax.lax.dot_general(x, w, _XW, precision=precision, preferred_element_type=jnp.float32)
    return y if bias is None else y + bias.astype(jnp.float32)


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
    """Projections that read the same input (q|k|v, gate|up, or a single one) as one GEMM, with
    stacked multi-adapter LoRA weights.

    `weight` [O + L·N·R, in] holds the HF weights of `parts` (name -> out features, O in all)
    stacked by rows, then the LoRA A's of the L parts that carry slots, as rows too (part l, slot
    s: rows O + (l·N + s)·R ...): one GEMM gives every part's xW and every slot's xA. Stored
    apart, each projection and each A was a kernel of its own (2-5 µs each per layer in a decode
    step on the H200), and XLA ran gate and up as two GEMMs on 112 of the 132 SMs.
    `lora_b[part]` [N, R, out] holds B (the LoRA scale folded in). Slot 0 is the bare base model
    and stays zero; ranks are zero-padded to R. A part without slots (`lora` leaves it out: no
    adapter may target it, see `lora_target_modules`) is a plain linear layer: no work.
    """

    def __init__(self, d_in: int, parts: dict[str, int], *, bias: bool, num_slots: int,
                 rank: int, dtype, precision=None, lora: tuple[str, ...] = ()):
        self.parts = tuple(parts.items())
        self.lora = tuple(p for p in parts if p in lora)
        self.out = sum(parts.values())
        rows = self.out + len(self.lora) * num_slots * rank
        self.weight = nnx.Param(jnp.zeros((rows, d_in), dtype))
        self.bias = nnx.Param(jnp.zeros((self.out,), dtype)) if bias else None
        self.lora_b = nnx.Dict({p: nnx.Param(jnp.zeros((num_slots, rank, parts[p]), dtype))
                                for p in self.lora})
        self.slots = (num_slots, rank)
        self.precision = precision

    def a_rows(self, part: str, slot: int) -> int:
        """First row of `part`'s A for `slot` in `weight` (R rows)."""
        n, r = self.slots
        return self.out + (self.lora.index(part) * n + slot) * r

    def __call__(self, x, group_sizes) -> dict:
        """x [T, in], group_sizes [N] (tokens grouped by slot) -> {part: (xW + b [T, out],
        slot rows [T, N, R] (xA in the token's slot, zeros in the others: `forkjax.lora.batched`)
        or None for a part without slots)}."""
        return self.split(self.project(x), group_sizes)

    def project(self, x):
        """x [T, in] -> the one GEMM's output [T, O + L·N·R] in float32, not yet rounded to x's
        dtype (`split` rounds it; a kernel reading it rounds as it loads, where XLA would run a
        convert kernel first): every part's xW + b, then every slot's xA of each part with
        slots (rows of `a_rows`)."""
        w = self.weight[...]
        bias = None
        if self.bias is not None:
            bias = jnp.pad(self.bias[...], (0, w.shape[0] - self.out))  # no bias on the A rows
        return linear_f32(x, w, self.precision, bias)

    def split(self, y, group_sizes) -> dict:
        """`project`'s output -> what `__call__` returns."""
        y = y.astype(self.weight.dtype)
        out, start = {}, 0
        for name, size in self.parts:
            out[name] = y[:, start:start + size]
            start += size
        rows = {}
        if self.lora:
            n, r = self.slots
            xa_all = y[:, self.out:].reshape(y.shape[0], len(self.lora), n, r)
            rows = dict(zip(self.lora, jnp.unstack(slot_rows(xa_all, group_sizes), axis=1)))
        return {name: (y_part, rows.get(name)) for name, y_part in out.items()}

    def expand(self, part: str, rows):
        """Slot rows [T, N, R] -> xA·B [T, out] of `part`."""
        return lora_expand(rows, self.lora_b[part][...], self.precision)

    def merged(self, x, group_sizes) -> list:
        """x [T, in] -> [xW + b + xA·B [T, out] for each part] (LoRA applied at once)."""
        return [y if rows is None else y + self.expand(name, rows)
                for name, (y, rows) in self(x, group_sizes).items()]
