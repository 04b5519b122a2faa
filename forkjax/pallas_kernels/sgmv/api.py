"""The SGMV kernels as the model calls them (lora/layers.py, `lora_path="sgmv"`): any token
count (padded up to the kernels' token block with padding rows, which come out zero), blocks
chosen for the shapes, interpreted where jax has no GPU."""

from __future__ import annotations

from forkjax.pallas_kernels.padding import pad_axis
from forkjax.pallas_kernels.sgmv.triton import SgmvConfig, sgmv_expand, sgmv_shrink
from forkjax.pallas_kernels.tuning import on_gpu


def _padded(rows, slots, num_slots: int, block_t: int):
    t = rows.shape[0]
    size = -(-t // block_t) * block_t
    return pad_axis(rows, 0, size), pad_axis(slots - num_slots, 0, size) + num_slots  # padding: slot N


def shrink(x, a, slots):
    """x [T, d_in], a [N, Rp, d_in], slots [T] int32 (ascending, N: padding) -> x·A_slot^T [T, Rp]."""
    n, _, d_in = a.shape
    cfg = SgmvConfig.for_shapes(d_in, d_in, interpret=not on_gpu())
    xp, sp = _padded(x, slots, n, cfg.block_t)
    return sgmv_shrink(xp, a, sp, cfg)[:x.shape[0]]


def expand(xa, b, slots):
    """xa [T, Rp], b [N, Rp, d_out], slots [T] int32 -> xa·B_slot [T, d_out]."""
    n, _, d_out = b.shape
    cfg = SgmvConfig.for_shapes(b.shape[1], d_out, interpret=not on_gpu())
    xp, sp = _padded(xa, slots, n, cfg.block_t)
    return sgmv_expand(xp, b, sp, cfg)[:xa.shape[0]]
