"""Do the Mosaic GPU pieces a warp-specialised paged decode kernel needs work here?

    PYTHONPATH=. python3 scripts/diag_mosaic_gpu.py      # compiled on a GPU, interpreted on a CPU

Tiny Pallas Mosaic GPU kernels, each checked against jnp:
  1. TMA copies GMEM -> SMEM with a barrier, one wgmma into a register accumulator, TMA store;
     again with the A operand in registers, and with the accumulator carried as a value
     (`run_state`). In jax 0.11.2 the CPU interpreter supports neither of those two variants.
  2. Warp specialisation: warpgroup 0 loads tiles (TMA, one barrier per buffer), warpgroup 1
     waits, multiplies and releases the buffer through a second barrier, over a loop.
  3. A paged gather: page ids read from a GMEM table, one TMA copy per page of an [P, S, D] pool
     into consecutive rows of a shared-memory tile (one barrier per page).
Under interpretation (`InterpretGPUParams`, the CPU) the interpreter also checks the barrier
protocol: every phase a barrier completes must be observed by a waiting thread.
A diagnostic for the next decode kernel (BENCHMARKS.md, Kernels), not a test of forkjax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F16 = jnp.float16
M = N = K = 64


def _kernel(body, out_type, **kw):
    interpret = plgpu.InterpretGPUParams() if jax.default_backend() != "gpu" else None
    return jax.jit(plgpu.kernel(body, out_type=out_type, interpret=interpret, **kw))


def matmul_once(how="smem"):
    """how: "smem" (both operands in shared memory, a scoped accumulator), "registers_a" (A
    loaded into registers first, as P is in P @ V) or "run_state" (the accumulator passed in as
    a value, as FlashAttention-3 carries it across its loop)."""
    def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, o_smem, bar):
        for src, dst, i in ((a_gmem, a_smem, 0), (b_gmem, b_smem, 1)):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
            plgpu.barrier_wait(bar.at[i])
        a = plgpu.layout_cast(a_smem[...], plgpu.Layout.WGMMA) if how == "registers_a" else a_smem

        def mma(acc):  # an accumulator lives in its own scope (registers)
            plgpu.wgmma(acc, a, b_smem)
            plgpu.wgmma_wait(0)
            return acc[...]

        if how == "run_state":
            zero = plgpu.layout_cast(jnp.zeros((M, N), jnp.float32), plgpu.Layout.WGMMA)
            out = pl.run_state(lambda acc: plgpu.wgmma(acc, a_smem, b_smem))(plgpu.ACC.init(zero))
        else:
            out = pl.run_scoped(mma, plgpu.ACC((M, N), jnp.float32))
        o_smem[...] = out.astype(F16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    a, b = (jax.random.normal(jax.random.key(i), (M, K), F16) for i in range(2))
    f = _kernel(body, jax.ShapeDtypeStruct((M, N), F16),
                scratch_types=[plgpu.SMEM((M, K), F16), plgpu.SMEM((K, N), F16),
                               plgpu.SMEM((M, N), F16), plgpu.Barrier(num_barriers=2)])
    return f(a, b), a.astype(jnp.float32) @ b.astype(jnp.float32)


def warp_specialised(steps=3):
    def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, o_smem, ready, done):
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)  # producer
        def _():
            def step(i, c):
                @pl.when(i > 0)
                def _():
                    plgpu.barrier_wait(done)  # the consumer released the buffers

                plgpu.copy_gmem_to_smem(a_gmem.at[i], a_smem, ready.at[0])
                plgpu.copy_gmem_to_smem(b_gmem, b_smem, ready.at[1])
                return c

            lax.fori_loop(0, steps, step, 0)
            plgpu.barrier_wait(done)  # observe the last release too

        @pl.when(wg == 1)  # consumer
        def _():
            def run(acc):
                def step(i, c):
                    plgpu.barrier_wait(ready.at[0])
                    plgpu.barrier_wait(ready.at[1])
                    plgpu.wgmma(acc, a_smem, b_smem)
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(done)
                    return c

                lax.fori_loop(0, steps, step, 0)
                return acc[...]

            o_smem[...] = pl.run_scoped(run, plgpu.ACC((M, N), jnp.float32)).astype(F16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)

    a = jax.random.normal(jax.random.key(0), (steps, M, K), F16)
    b = jax.random.normal(jax.random.key(1), (K, N), F16)
    f = _kernel(body, jax.ShapeDtypeStruct((M, N), F16),
                scratch_types=[plgpu.SMEM((M, K), F16), plgpu.SMEM((K, N), F16),
                               plgpu.SMEM((M, N), F16), plgpu.Barrier(num_barriers=2),
                               plgpu.Barrier()],
                num_threads=2, thread_name="wg")
    return f(a, b), a.astype(jnp.float32).sum(0) @ b.astype(jnp.float32)


def paged_gather(pages=(5, 17, 3, 30), P=32, S=16, D=64):
    n = len(pages)

    def body(pool_gmem, pt_gmem, o_gmem, rows_smem, bar):
        for i in range(n):
            plgpu.copy_gmem_to_smem(pool_gmem.at[pt_gmem[i]], rows_smem.at[pl.ds(i * S, S)],
                                    bar.at[i])
        for i in range(n):
            plgpu.barrier_wait(bar.at[i])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(rows_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    pool = jax.random.normal(jax.random.key(2), (P, S, D), F16)
    pt = jnp.asarray(pages, jnp.int32)
    f = _kernel(body, jax.ShapeDtypeStruct((n * S, D), F16),
                scratch_types=[plgpu.SMEM((n * S, D), F16), plgpu.Barrier(num_barriers=n)])
    return f(pool, pt), pool[pt].reshape(n * S, D)


def main():
    print(f"backend {jax.default_backend()}, jax {jax.__version__}")
    checks = {"matmul": matmul_once, "matmul, A in registers": lambda: matmul_once("registers_a"),
              "matmul, run_state accumulator": lambda: matmul_once("run_state"),
              "warp specialised": warp_specialised, "paged gather": paged_gather}
    for name, check in checks.items():
        try:
            out, ref = check()
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            print(f"{name}: max abs error {err:.4f} (fp16 output)")
        except Exception as e:  # noqa: BLE001  a diagnostic: report and go on
            print(f"{name}: FAILED {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")


if __name__ == "__main__":
    main()
