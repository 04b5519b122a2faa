"""Timing helpers the benchmark scripts share (scripts/ is on sys.path when a script runs, so
they `import timing`).

`time_ms` is the median of CUPTI kernel-time sums per call (every kernel the call launches),
with wall-clock timing as the fallback where CUPTI is missing; `copy_bandwidth` the device's
copy rate as those times see it, the roofline the benchmarks divide by.
"""

from __future__ import annotations

import collections
import glob
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp


def time_ms(f, args, iters: int = 20, *, quick: bool = False, log=print):
    """Median ms per call of f(*args), and how it was timed ("cupti" or "wall"). quick: one
    iteration of one repetition on the wall-clock path (a smoke run, interpreted on the CPU)."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, times = profiler.measure(f, iterations=iters)(*args)
        if times:
            return statistics.median(times), "cupti"
    except Exception as e:  # noqa: BLE001
        log(f"  cupti unavailable ({type(e).__name__}: {e}); wall clock")
    jax.block_until_ready(f(*args))
    reps = []
    iters = 1 if quick else iters
    for _ in range(1 if quick else 5):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        reps.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(reps), "wall"


_TORCH_COPY = """
import statistics, torch
src = torch.empty(1 << 30, dtype=torch.float32, device="cuda").normal_()
dst = torch.empty_like(src)
for _ in range(3):
    dst.copy_(src)
times = []
for _ in range(10):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); dst.copy_(src); b.record(); b.synchronize()
    times.append(a.elapsed_time(b))
print(2 * src.numel() * 4 / (statistics.median(times) * 1e-3))
"""


def torch_copy_bandwidth(log=print):
    """Device-to-device copy through PyTorch (4 GiB read + 4 GiB written, CUDA events), run in
    a child process before JAX takes the GPU memory; None where that fails."""
    try:
        r = subprocess.run([sys.executable, "-c", _TORCH_COPY], capture_output=True, text=True,
                           timeout=120)
        return float(r.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001
        log(f"  torch copy unavailable: {type(e).__name__}: {str(e)[:200]}")
        return None


def copy_bandwidth(*, quick: bool = False, log=print):
    """Best of XLA elementwise passes over 2-4 GiB (bytes read + written per second, timed by
    `time_ms`) -> (bytes/s, ms, how timed). quick: 64k elements."""
    best = (0.0, 0.0, "")
    n = 1 << (16 if quick else 30)
    for dtype, f in ((jnp.bfloat16, lambda a: a * 2), (jnp.float32, lambda a: a + 1.0)):
        x = jax.random.normal(jax.random.key(0), (n,), dtype)
        ms, how = time_ms(jax.jit(f), (x,), quick=quick, log=log)
        bw = 2 * x.nbytes / (ms * 1e-3)
        log(f"  xla copy {jnp.dtype(dtype).name}: {bw / 1e12:.2f} TB/s")
        if bw > best[0]:
            best = (bw, ms, how)
        del x
    return best


def trace_summary(fn, top: int = 12) -> dict:
    """Run fn() under JAX's profiler (C++ host spans and device kernels, no Python tracer) ->
    {plane: [(line, span name, total ms, count)]}, the `top` longest spans of each plane by
    total time: where a call's host and device time goes, without a trace viewer. Spans nest
    (a jit call holds its argument transfers), so the totals overlap."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level, options.host_tracer_level = 0, 2
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, profiler_options=options)
        try:
            fn()
        finally:
            jax.profiler.stop_trace()
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    out = {}
    for plane in data.planes:
        total, count = collections.Counter(), collections.Counter()
        for line in plane.lines:
            for ev in line.events:
                total[(line.name, ev.name)] += ev.duration_ns
                count[(line.name, ev.name)] += 1
        if total:
            out[plane.name] = [(line, name, round(ns / 1e6, 3), count[(line, name)])
                               for (line, name), ns in total.most_common(top)]
    return out
