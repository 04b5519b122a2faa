"""Segmented multi-LoRA matmuls (Punica's SGMV) in Pallas/Triton: each token's shrink x·A_s^T and
expand xa·B_s against its own adapter slot s only, so the cost follows the adapters in the batch,
not the slots the model holds (the dense one-hot form of `forkjax.lora.batched` sends every
token through all N slots).

Tokens come grouped by slot (`slots` [T] ascending, as the engine lays out a step: all of slot
0's tokens, then slot 1's, ...; padding rows carry slot N and come out zero). A program takes a
block of `block_t` tokens and loops over the slots present in it — a contiguous range, the
tokens being sorted; slots without a token in the block are skipped — reading each of those
slots' A (or B) once; a row takes only its own slot's product (selected, never mixed: another
slot's weights may hold inf). So a decode batch of T
tokens on K adapters reads K adapters' weights, and a prefill chunk of one adapter reads one.

    shrink  x [T, d_in] · a [N, Rp, d_in] -> xa [T, Rp]    grid (T / block_t,)
    expand  xa [T, Rp] · b [N, Rp, d_out] -> y [T, d_out]   grid (T / block_t, d_out / block_n)

Rp, the stored rank, is ≥ 16 and a power of two (a dot with a contraction or output dimension
of 8 gives wrong results on the H200); d_in and d_out are multiples of the
blocks (`SgmvConfig.for_shapes` picks power-of-two divisors). Plain-jnp reference: reference.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class SgmvConfig:
    """Options of both kernels: token rows a program (block_t), the d_in chunk of the shrink's
    loop (block_k) and the d_out columns of an expand program (block_n); Triton's warps and
    stages; interpret (the CPU's Pallas interpreter)."""
    block_t: int = 16
    block_k: int = 256
    block_n: int = 256
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool = False

    @classmethod
    def for_shapes(cls, d_in: int, d_out: int, **kw) -> SgmvConfig:
        """Blocks that divide d_in and d_out: the largest powers of two up to the defaults."""
        def block(dim, most):
            return min(most, dim & -dim)
        return cls(block_k=block(d_in, cls.block_k), block_n=block(d_out, cls.block_n), **kw)

    def params(self):
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _dot(a, b, trans_b=False):
    """a·b (or a·bᵀ) accumulated in float32; float32 inputs at full precision, not TF32."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_b=trans_b, precision=prec)


def _slot_range(slots, num_slots: int):
    """The first and last slot of a block's rows (sorted); an all-padding block has none."""
    return jnp.min(slots), jnp.minimum(jnp.max(slots), num_slots - 1)


def _has(slots, s):
    """Whether slot `s` has a row in the block (a sum: Triton's lowering has no reduce_or)."""
    return jnp.sum((slots == s).astype(jnp.int32)) > 0


def _shrink_kernel(slots_ref, x_ref, a_ref, o_ref, *, num_slots, rank, block_k, d_in):
    slots = slots_ref[...]  # [block_t]
    first, last = _slot_range(slots, num_slots)

    def one_slot(s, out):
        def chunk(j, acc):
            xk = x_ref[:, pl.ds(j * block_k, block_k)]  # [block_t, block_k]
            ak = a_ref[pl.ds(s * rank, rank), pl.ds(j * block_k, block_k)]  # [Rp, block_k]
            return acc + _dot(xk, ak, trans_b=True)

        def product(out):
            acc = jax.lax.fori_loop(0, d_in // block_k, chunk, jnp.zeros(out.shape, jnp.float32))
            return jnp.where((slots == s)[:, None], acc, out)
        return jax.lax.cond(_has(slots, s), product, lambda out: out, out)  # empty slots: skip

    out = jax.lax.fori_loop(first, last + 1, one_slot, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = out.astype(o_ref.dtype)


def _expand_kernel(slots_ref, xa_ref, b_ref, o_ref, *, num_slots, rank):
    slots = slots_ref[...]  # [block_t]
    xa = xa_ref[...]  # [block_t, Rp]
    first, last = _slot_range(slots, num_slots)

    def one_slot(s, acc):
        mine = (slots == s)[:, None]
        # Other rows' products are dropped, not zeroed first: 0 × inf in B would be NaN.
        product = lambda acc: acc + jnp.where(mine, _dot(xa, b_ref[pl.ds(s * rank, rank), :]), 0.0)  # noqa: E731
        return jax.lax.cond(_has(slots, s), product, lambda acc: acc, acc)  # empty slots: skip

    acc = jax.lax.fori_loop(first, last + 1, one_slot, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _check(t: int, rank: int, config: SgmvConfig, dims: dict):
    if t % config.block_t:
        raise ValueError(f"{t} tokens: a multiple of block_t={config.block_t} expected (pad with slot N rows)")
    if rank < 16 or rank & (rank - 1):
        raise ValueError(f"stored rank {rank}: a power of two >= 16 expected (zero-pad the adapters)")
    for name, (dim, block) in dims.items():
        if dim % block:
            raise ValueError(f"{name}={dim} is not a multiple of its block {block} (SgmvConfig.for_shapes)")


@functools.partial(jax.jit, static_argnames="config")
def sgmv_shrink(x, a, slots, config: SgmvConfig = SgmvConfig()):
    """x [T, d_in], a [N, Rp, d_in], slots [T] int32 (ascending; N: padding) -> x·A_slot^T
    [T, Rp] in x's dtype (float32 accumulation)."""
    n, rank, d_in = a.shape
    t = x.shape[0]
    _check(t, rank, config, {"d_in": (d_in, config.block_k)})
    kernel = functools.partial(_shrink_kernel, num_slots=n, rank=rank, block_k=config.block_k, d_in=d_in)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((t, rank), x.dtype), grid=(t // config.block_t,),
        in_specs=[pl.BlockSpec((config.block_t,), lambda i: (i,)),
                  pl.BlockSpec((config.block_t, d_in), lambda i: (i, 0)),
                  pl.BlockSpec((n * rank, d_in), lambda i: (0, 0))],  # every slot: indexed in the kernel
        out_specs=pl.BlockSpec((config.block_t, rank), lambda i: (i, 0)),
        compiler_params=config.params(), interpret=config.interpret,
    )(slots, x, a.reshape(n * rank, d_in))


@functools.partial(jax.jit, static_argnames="config")
def sgmv_expand(xa, b, slots, config: SgmvConfig = SgmvConfig()):
    """xa [T, Rp], b [N, Rp, d_out], slots [T] int32 (ascending; N: padding) -> xa·B_slot
    [T, d_out] in xa's dtype (float32 accumulation)."""
    n, rank, d_out = b.shape
    t = xa.shape[0]
    _check(t, rank, config, {"d_out": (d_out, config.block_n)})
    kernel = functools.partial(_expand_kernel, num_slots=n, rank=rank)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((t, d_out), xa.dtype),
        grid=(t // config.block_t, d_out // config.block_n),
        in_specs=[pl.BlockSpec((config.block_t,), lambda i, j: (i,)),
                  pl.BlockSpec((config.block_t, rank), lambda i, j: (i, 0)),
                  pl.BlockSpec((n * rank, config.block_n), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((config.block_t, config.block_n), lambda i, j: (i, j)),
        compiler_params=config.params(), interpret=config.interpret,
    )(slots, xa, b.reshape(n * rank, d_out))
