"""The residual decode's epilogue as one Triton kernel, for one split-K split (large batches).

The Mosaic residual decode (mgpu_decode.py) leaves its accumulators transposed, O^T [D, NQ] and
O_r^T [.., NQ] (row R: the softmax denominator l), with the G real query heads in the first
columns. The output is O = (O^T + B_v^T O_r^T)^T / l per (request, KV head), B_v the request's
adapter's. As XLA ops that was a fusion and a transpose kernel, 6.4 us of every layer of a B=64
decode step on the H200 (BENCHMARKS.md, twelfth session); here one program per (request, KV head)
reads its tiles once, applies B_v as R multiply-adds in float32 and writes [G, D] in the output
dtype.

    o_t     [B, 1, Hkv, D, NQ]   float32, O^T of the one split
    or_t    [B, 1, Hkv, RB, NQ]  float32, O_r^T (rows R+1.. unused; RB >= R + 1)
    b_v     [N, R, Hkv, D]       every adapter slot's B_v
    adapter_ids [B] int32
    out     [B, Hkv * G, D]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from forkjax.pallas_kernels.residual_attention import combine_splits


def _kernel(ids_ref, o_ref, or_ref, bv_ref, out_ref, *, groups: int, rank: int):
    b, h = pl.program_id(0), pl.program_id(1)
    g = pl.ds(0, groups)
    aid = ids_ref[b]
    acc = o_ref[:, g].T  # [G, D]
    for r in range(rank):  # row by row from the refs (Triton lowers no slice of a value)
        acc += or_ref[r, g][:, None] * bv_ref[aid, r, h, :].astype(jnp.float32)[None, :]
    l = or_ref[rank, g]
    out_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("groups", "dtype", "interpret"))
def residual_combine(o_t, or_t, b_v, adapter_ids, *, groups: int, dtype, interpret=False):
    """-> [B, Hkv * groups, D] in `dtype` (see the module docstring)."""
    B, splits, Hkv, D, NQ = o_t.shape
    R = b_v.shape[1]
    rows = pl.next_power_of_2(R + 1)
    if splits != 1 or or_t.shape[3] < rows or groups > NQ:
        raise ValueError(f"residual_combine: one split and R + 1 <= O_r^T rows, got o_t "
                         f"{o_t.shape}, or_t {or_t.shape}, R={R}, groups={groups}")
    out = pl.pallas_call(
        functools.partial(_kernel, groups=groups, rank=R),
        grid=(B, Hkv),
        in_specs=[pl.BlockSpec((B,), lambda b, h: (0,)),
                  pl.BlockSpec((None, None, None, D, NQ), lambda b, h: (b, 0, h, 0, 0)),
                  pl.BlockSpec((None, None, None, rows, NQ), lambda b, h: (b, 0, h, 0, 0)),
                  pl.BlockSpec(b_v.shape, lambda b, h: (0, 0, 0, 0))],
        out_specs=pl.BlockSpec((None, None, groups, D), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, groups, D), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="residual_combine",
    )(adapter_ids.astype(jnp.int32), o_t, or_t, b_v)
    return out.reshape(B, Hkv * groups, D)


def residual_combine_reference(o_t, or_t, b_v, adapter_ids, *, groups: int, dtype):
    """The same in XLA ops (any number of splits: m, unused with one, is taken as 0)."""
    B, splits, Hkv, D, _ = o_t.shape
    R = b_v.shape[1]
    o, o_r = o_t[..., :groups].swapaxes(-1, -2), or_t[..., :R, :groups].swapaxes(-1, -2)
    bv = b_v[adapter_ids.astype(jnp.int32)].astype(jnp.float32)
    m = jnp.zeros(o.shape[:-1], jnp.float32)
    out = combine_splits(o, m, or_t[..., R, :groups], o_r, bv)
    return out.reshape(B, Hkv * groups, D).astype(dtype)
