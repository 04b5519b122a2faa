"""Decode-step projections x @ w^T (at most 64 tokens) on Pallas' Mosaic GPU backend.

In a B=64 decode step every projection is a weight stream: 64 rows of x against a [N, K] weight
read once from HBM. cuBLAS reaches 2.6-3.7 TB/s of the H200's 4.3 there (BENCHMARKS.md, the
engine's GEMM table), mostly because N / 128 tiles leave SMs idle or run in uneven waves. Here
a work item is one (N tile, K split): CTA-sized pieces of the weight, many more than SMs, two
CTAs an SM (so one's pipeline fill overlaps the other's stream), each streaming its [block_n,
block_k] weight tiles and the matching x tiles by TMA through a ring of `stages` slots into a
wgmma with x as M = 64 rows. Every split writes a float32 partial; the caller's sum over splits
fuses into whatever consumes the projection.

    x    [M, K]        M <= 64 (padded to 64 rows), bf16 / f16
    w    [N, K]        HF layout, N a multiple of block_n, K of block_k * k_splits
    out  [S, M, N]     float32 partial products, summed by `skinny_matmul`
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # wgmma's M


def _tiles(cols: int, dtype) -> tuple:
    swizzle = min(128, cols * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _kernel(x_gmem, w_gmem, o_gmem, *, k_splits, block_n, block_k, stages):
    item = lax.axis_index("item")
    ni, si = lax.div(item, k_splits), lax.rem(item, k_splits)
    k_steps = x_gmem.shape[1] // block_k // k_splits
    first = si * k_steps
    dt = x_gmem.dtype

    def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            lambda _, x_smem, w_smem: plgpu.wgmma(acc_ref, x_smem, w_smem.T),
            grid=(k_steps,),
            in_specs=[
                plgpu.BlockSpec((ROWS, block_k), lambda k: (0, first + k),
                                transforms=_tiles(block_k, dt), delay_release=1),
                plgpu.BlockSpec((block_n, block_k), lambda k: (ni, first + k),
                                transforms=_tiles(block_k, dt), delay_release=1),
            ],
            max_concurrent_steps=stages,
        )(x_gmem, w_gmem)
        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((ROWS, block_n)))

    def store(o_smem):
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, :, pl.ds(ni * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((ROWS, block_n), jnp.float32))


def _kernel_ws(x_gmem, w_gmem, o_gmem, *, k_splits, block_n, block_k, stages):
    """Warp-specialised: a memory warpgroup issues the TMA copies, the compute one the wgmmas."""
    item = lax.axis_index("item")
    ni, si = lax.div(item, k_splits), lax.rem(item, k_splits)
    k_steps = x_gmem.shape[1] // block_k // k_splits
    first = si * k_steps
    dt = x_gmem.dtype

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=1,
            max_concurrent_steps=stages, compute_context=context,
            in_specs=[
                plgpu.BlockSpec((ROWS, block_k), lambda k: (0, first + k),
                                transforms=_tiles(block_k, dt)),
                plgpu.BlockSpec((block_n, block_k), lambda k: (ni, first + k),
                                transforms=_tiles(block_k, dt)),
            ])

    def mma(_, x_smem, w_smem, acc_ref):
        plgpu.wgmma(acc_ref, x_smem, w_smem.T)
        plgpu.wgmma_wait(0)
        return acc_ref

    ignore = lambda *_, **__: None  # noqa: E731  (allocations only)

    @functools.partial(pl.run_scoped,
                       allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
                       o_smem=plgpu.SMEM((ROWS, block_n), jnp.float32), collective_axes="wg")
    def scope(allocs, o_smem):
        def context(run):
            def acc_scope(acc_ref):
                run(acc_ref)
                o_smem[...] = acc_ref[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, :, pl.ds(ni * block_n, block_n)])
                plgpu.wait_smem_to_gmem(0)
            pl.run_scoped(acc_scope, plgpu.ACC((ROWS, block_n)))

        pipeline(mma, context)(x_gmem, w_gmem, allocations=allocs)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "k_splits", "stages",
                                             "ws", "interpret"))
def skinny_matmul_partials(x, w, *, block_n: int = 128, block_k: int = 64, k_splits: int = 1,
                           stages: int = 3, ws: bool = False, interpret: bool = False):
    """x [M, K], w [N, K] -> float32 partials [k_splits, M, N] (their sum is x @ w^T)."""
    m, k = x.shape
    n = w.shape[0]
    if m > ROWS or n % block_n or k % (block_k * k_splits) or stages < 2:
        raise ValueError(f"skinny_matmul: no kernel for M={m} K={k} N={n} block_n={block_n} "
                         f"block_k={block_k} k_splits={k_splits} stages={stages}")
    xp = jnp.pad(x.astype(w.dtype), ((0, ROWS - m), (0, 0)))
    out = plgpu.kernel(
        functools.partial(_kernel_ws if ws else _kernel, k_splits=k_splits, block_n=block_n, block_k=block_k,
                          stages=stages),
        out_type=jax.ShapeDtypeStruct((k_splits, ROWS, n), jnp.float32),
        grid=(n // block_n * k_splits,), grid_names=("item",),
        **(dict(num_threads=2, thread_name="wg") if ws else {}),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, w)
    return out[:, :m]


def skinny_matmul(x, w, **kw):
    """x [M, K], w [N, K] -> x @ w^T [M, N] float32."""
    return skinny_matmul_partials(x, w, **kw).sum(0)


def skinny_matmul_reference(x, w):
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32).T)
