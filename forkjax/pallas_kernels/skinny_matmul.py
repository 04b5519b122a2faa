"""Decode-step projections x @ w^T (at most 64 tokens) as a Triton kernel.

In a B=64 decode step every projection is a weight stream: 64 rows of x against a [N, K] weight
read once from HBM. cuBLAS reaches 2.6-3.7 TB/s of the H200's 4.3 there, XLA's autotuned Triton
GEMMs 1.9-4.0 (their configs are timed with the weights in L2: BENCHMARKS.md). A program here
owns a [block_n] slice of the outputs and one of `k_splits` slices of K, and streams its weight
tiles through Triton's software pipeline (`num_stages`); each split writes a float32 partial,
summed by the caller (XLA fuses the sum into the consumer).

    x    [M, K]     M <= 64 (padded to 64 rows)
    w    [N, K]     HF layout; N a multiple of block_n, K of block_k * k_splits
    out  [S, M, N]  float32 partials (`skinny_matmul` sums them)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

ROWS = 64


def _kernel(x_ref, w_ref, o_ref, *, block_n, block_k, k_steps):
    n, s = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(n * block_n, block_n), block_n)
    first = s * k_steps * block_k

    def step(i, acc):
        ks = pl.ds(pl.multiple_of(first + i * block_k, block_k), block_k)
        return acc + plgpu.dot(x_ref[:, ks], w_ref[cols, ks], trans_b=True)

    o_ref[...] = lax.fori_loop(0, k_steps, step, jnp.zeros((ROWS, block_n), jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "k_splits", "num_stages",
                                             "num_warps", "interpret"))
def skinny_matmul_partials(x, w, *, block_n: int = 128, block_k: int = 128, k_splits: int = 1,
                           num_stages: int = 4, num_warps: int = 4, interpret: bool = False):
    """x [M, K], w [N, K] -> float32 partials [k_splits, M, N] (their sum is x @ w^T)."""
    m, k = x.shape
    n = w.shape[0]
    if m > ROWS or n % block_n or k % (block_k * k_splits):
        raise ValueError(f"skinny_matmul: no kernel for M={m} K={k} N={n} block_n={block_n} "
                         f"block_k={block_k} k_splits={k_splits}")
    out = pl.pallas_call(
        functools.partial(_kernel, block_n=block_n, block_k=block_k,
                          k_steps=k // block_k // k_splits),
        grid=(n // block_n, k_splits),
        in_specs=[pl.BlockSpec((ROWS, k), lambda i, s: (0, 0)),
                  pl.BlockSpec((n, k), lambda i, s: (0, 0))],
        out_specs=pl.BlockSpec((None, ROWS, block_n), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((k_splits, ROWS, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="skinny_matmul",
    )(jnp.pad(x.astype(w.dtype), ((0, ROWS - m), (0, 0))), w)
    return out[:, :m]


def skinny_matmul(x, w, **kw):
    """x [M, K], w [N, K] -> x @ w^T [M, N] float32."""
    return skinny_matmul_partials(x, w, **kw).sum(0)
