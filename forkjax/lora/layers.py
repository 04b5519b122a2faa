"""`LoRALinear`: a model's projections with N stacked LoRA adapter slots.

The model (models/transformer.py) builds its attention and MLP projections from it; the slot
writer (slots.py) fills its A rows and B's; the batched matmul it runs is batched.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from forkjax.linear import linear_f32
from forkjax.lora.batched import OwnRows, lora_expand, slot_rows
from forkjax.pallas_kernels.sgmv import api as sgmv

LORA_PATHS = ("fused", "sgmv")


class LoRALinear(nnx.Module):
    """Projections that read the same input (q|k|v, gate|up, or a single one) as one GEMM, with
    stacked multi-adapter LoRA weights.

    `weight` [O + L·N·R, in] holds the HF weights of `parts` (name -> out features, O in all)
    stacked by rows, then the LoRA A's of the L parts that carry slots, as rows too (part l, slot
    s: rows O + (l·N + s)·R ...): one GEMM gives every part's xW and every slot's xA, where
    projections and A's stored apart would each be a kernel of their own. `lora_b[part]` [N, R, out] holds
    B (the LoRA scale folded in). Slot 0 is the bare base model and stays zero; ranks are
    zero-padded to R. A part without slots (`lora` leaves it out: no adapter may target it, see
    `lora_target_modules`) is a plain linear layer: no work.

    `lora_path="sgmv"`: the A's lie apart, `lora_a[part]` [N, R, in] (R a power of two >= 16),
    `weight` holds the O base rows only, and each token's shrink and expand run against its own
    slot in the SGMV kernels (pallas_kernels/sgmv): the cost follows the adapters in the batch,
    not N. `project` then returns xW + b and each part's own-slot xA [T, R] (not every slot's).

    `reduce` (a mesh axis name; tensor_parallel.py): a row-parallel projection, whose input and
    weight columns are one shard's: `project`'s partial sums, xW and xA alike, are all-reduced
    over that axis (S-LoRA: the shrink's R columns ride on the base output's all-reduce).
    """

    def __init__(self, d_in: int, parts: dict[str, int], *, bias: bool, num_slots: int,
                 rank: int, dtype, precision=None, lora: tuple[str, ...] = (), lora_path: str = "fused",
                 reduce: str | None = None):
        if lora_path not in LORA_PATHS:
            raise ValueError(f"lora_path={lora_path!r}: expected one of {', '.join(LORA_PATHS)}")
        if reduce and bias:
            raise ValueError("a row-parallel projection with a bias would add it once per shard")
        self.parts = tuple(parts.items())
        self.lora = tuple(p for p in parts if p in lora)
        self.out = sum(parts.values())
        self.lora_path = lora_path
        fused = lora_path == "fused"
        rows = self.out + (len(self.lora) * num_slots * rank if fused else 0)
        self.weight = nnx.Param(jnp.zeros((rows, d_in), dtype))
        self.bias = nnx.Param(jnp.zeros((self.out,), dtype)) if bias else None
        self.lora_a = None if fused else nnx.Dict(
            {p: nnx.Param(jnp.zeros((num_slots, rank, d_in), dtype)) for p in self.lora})
        self.lora_b = nnx.Dict({p: nnx.Param(jnp.zeros((num_slots, rank, parts[p]), dtype))
                                for p in self.lora})
        self.slots = (num_slots, rank)
        self.precision = precision
        self.reduce = reduce

    def a_rows(self, part: str, slot: int) -> int:
        """First row of `part`'s A for `slot` in `weight` (R rows; the fused path's layout)."""
        if self.lora_path != "fused":
            raise ValueError("the sgmv path keeps A apart, in lora_a")
        n, r = self.slots
        return self.out + (self.lora.index(part) * n + slot) * r

    def __call__(self, x, slots) -> dict:
        """x [T, in], slots [T] int32 (each token's slot, N: none; batched.token_slots) -> {part: (xW + b [T, out],
        slot rows [T, N, R] (xA in the token's slot, zeros in the others: `forkjax.lora.batched`;
        `OwnRows` on the sgmv path) or None for a part without slots)}."""
        return self.split(self.project(x, slots), slots)

    def project(self, x, slots=None):
        """x [T, in] -> the one GEMM's output [T, O + L·N·R] in float32, not yet rounded to x's
        dtype (`split` rounds it; a kernel reading it rounds as it loads, where XLA would run a
        convert kernel first): every part's xW + b, then every slot's xA of each part with
        slots (rows of `a_rows`). The sgmv path: xW + b, then each part's own-slot xA [T, R]
        (`slots` [T] needed)."""
        w = self.weight[...]
        bias = None
        if self.bias is not None:
            bias = jnp.pad(self.bias[...], (0, w.shape[0] - self.out))  # no bias on the A rows
        y = linear_f32(x, w, self.precision, bias)
        if self.lora_path != "fused" and self.lora:
            y = jnp.concatenate([y, *(sgmv.shrink(x, self.lora_a[p][...], slots).astype(y.dtype)
                                      for p in self.lora)], axis=1)
        return y if self.reduce is None else jax.lax.psum(y, self.reduce)

    def split(self, y, slots) -> dict:
        """`project`'s output -> what `__call__` returns."""
        y = y.astype(self.weight.dtype)
        out, start = {}, 0
        for name, size in self.parts:
            out[name] = y[:, start:start + size]
            start += size
        rows = {}
        if self.lora:
            n, r = self.slots
            if self.lora_path == "fused":
                xa_all = y[:, self.out:].reshape(y.shape[0], len(self.lora), n, r)
                rows = dict(zip(self.lora, jnp.unstack(slot_rows(xa_all, slots, n), axis=1)))
            else:
                xa = y[:, self.out:].reshape(y.shape[0], len(self.lora), r)
                rows = {p: self.rows_of(xa[:, i], slots) for i, p in enumerate(self.lora)}
        return {name: (y_part, rows.get(name)) for name, y_part in out.items()}

    def rows_of(self, xa, slots):
        """Each token's own xA [T, R] and slots [T] -> the slot rows `expand` takes."""
        if self.lora_path == "fused":
            return slot_rows(xa[:, None], slots, self.slots[0])  # [T, 1, R], broadcast over the N slots
        return OwnRows(xa, slots)

    def all_slots_xa(self, x, part: str):
        """x [T, in] -> xA of `part` for every slot [T, N, R] (float32; residual fan-out)."""
        n, r = self.slots
        a = self.lora_a[part][...].reshape(n * r, -1)
        return linear_f32(x, a, self.precision).reshape(-1, n, r)

    def expand(self, part: str, rows):
        """Slot rows [T, N, R] (or `OwnRows`) -> xA·B [T, out] of `part`."""
        if isinstance(rows, OwnRows):
            return sgmv.expand(rows.xa, self.lora_b[part][...], rows.slots)
        return lora_expand(rows, self.lora_b[part][...], self.precision)

    def merged(self, x, slots) -> list:
        """x [T, in], slots [T] -> [xW + b + xA·B [T, out] for each part] (LoRA applied at once)."""
        return [y if rows is None else y + self.expand(name, rows)
                for name, (y, rows) in self(x, slots).items()]
