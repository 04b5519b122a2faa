"""What an attention backend receives: `QKV`, a layer's q|k|v projection, from which the backend
(runtime/paged_attention.py) builds q and the (base, residual) K and V pairs.

The residual policies store the pairs apart; the merged-pool ones (`prefix`, `full_reuse`) store
`merged_kv`: K = bK + RoPE(rK·B_k), V = bV + rV·B_v. RoPE is linear, so this equals RoPE of the
merged projection, as HF computes it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from forkjax.lora.batched import own_slot
from forkjax.rope import apply_rope


@dataclasses.dataclass
class QKV:
    """A layer's q|k|v projection of T tokens with LoRA's B and RoPE not yet applied. A backend
    builds what it needs (`q`, `k`, `v`), or a fused kernel reads the GEMM output `y` itself
    (`pallas_kernels.paged_attention.api.fused_decode_operands`: q's LoRA expand, RoPE and the
    slices in one kernel instead of several XLA ones)."""
    y: jax.Array  # [T, O + L·N·R] float32 `LoRALinear.project` of the stacked q|k|v projection
    proj: Any  # that LoRALinear: lora_b, a_rows
    heads: tuple[int, int, int]  # (Hq, Hkv, D)
    rope: tuple  # (cos, sin) [T, D]
    slots: jax.Array  # [T] int32 each token's adapter slot (N: none)
    x: jax.Array | None = None  # [T, in] the projection's input (the sgmv path's fan-out)

    @functools.cached_property
    def _parts(self) -> dict:
        return self.proj.split(self.y, self.slots)

    def b(self, part: str):
        """LoRA B of `part` [N, R, out] (the LoRA scale folded in)."""
        return self.proj.lora_b[part][...]

    def columns(self) -> tuple:
        """First column in y of q, k, v, then of slot 0's A of q (None: q has no slots), k, v
        (slot s's R columns follow at + s·R)."""
        hq, hkv, hd = self.heads
        a = [self.proj.a_rows(p, 0) if p in self.proj.lora else None
             for p in ("q_proj", "k_proj", "v_proj")]
        return (0, hq * hd, (hq + hkv) * hd, *a)

    def all_slots_xa(self, part: str):
        """-> xA of `part` for every adapter slot [T, N, R] (float32, from the GEMM output; on
        the sgmv path, which computes each token's own slot only, a GEMM of its own)."""
        if self.proj.lora_path != "fused":
            return self.proj.all_slots_xa(self.x, part)
        n, r = self.proj.slots
        first = self.proj.a_rows(part, 0)
        return self.y[:, first:first + n * r].reshape(-1, n, r)

    def q(self):
        """-> q [T, Hq, D], LoRA and RoPE applied."""
        hq, _, hd = self.heads
        q, rows = self._parts["q_proj"]
        if rows is not None:
            q = q + self.proj.expand("q_proj", rows)
        return apply_rope(q.reshape(-1, hq, hd), *self.rope)

    def k(self):
        """-> (base keys [T, Hkv, D] with RoPE, residual xA_k [T, R])."""
        _, hkv, hd = self.heads
        kb, rows = self._parts["k_proj"]
        return apply_rope(kb.reshape(-1, hkv, hd), *self.rope), own_slot(rows)

    def v(self):
        """-> (base values [T, Hkv, D], residual xA_v [T, R])."""
        _, hkv, hd = self.heads
        vb, rows = self._parts["v_proj"]
        return vb.reshape(-1, hkv, hd), own_slot(rows)

    def merged_kv(self):
        """-> full K (RoPE) and V, each [T, Hkv, D]: the (base, residual) pairs merged."""
        (kb, kr), (vb, vr) = self.k(), self.v()
        k_lora, v_lora = self.lora_kv(kr, vr)
        return kb + k_lora, vb + v_lora

    def lora_kv(self, kr, vr):
        """Residuals xA_k, xA_v [T, R] -> the LoRA terms RoPE(xA_k·B_k), xA_v·B_v [T, Hkv, D]
        of each token's slot."""
        _, hkv, hd = self.heads
        k_lora, v_lora = (self.proj.expand(part, self.proj.rows_of(xa, self.slots)).reshape(-1, hkv, hd)
                          for xa, part in ((kr, "k_proj"), (vr, "v_proj")))
        return apply_rope(k_lora, *self.rope), v_lora
