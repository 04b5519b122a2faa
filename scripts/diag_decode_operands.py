"""CUPTI time of `mgpu_operands.decode_operands` at the Llama-3-8B decode shape (B=64, Hq=32,
Hkv=8, D=128, R=16, 9 adapter slots, LoRA on q) for each Triton warp count, median of 50.

    PYTHONPATH=. python3 scripts/diag_decode_operands.py      # on the GPU machine
"""

import functools
import statistics
import sys

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

sys.path.insert(0, "tests")
from test_mgpu_operands import _decode_case  # noqa: E402

from forkjax.pallas_kernels.mgpu_operands import decode_operands  # noqa: E402

args, static = _decode_case(0, 4, 16, 128, True, jnp.bfloat16, B=64, Hkv=8, N=9)
for warps in (1, 2, 4, 8):
    f = jax.jit(functools.partial(decode_operands, **static, n_q=16, num_warps=warps))
    jax.block_until_ready(f(*args))
    _, times = profiler.measure(f, iterations=50)(*args)
    print(f"num_warps={warps}: {statistics.median(times) * 1e3:.2f} us", flush=True)
