import functools
import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Many tests compile the same tiny programs, in both xdist workers: share them on disk. XLA's CPU
# compiles, not the runs, dominate this suite's time on 2 cores.
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(os.path.dirname(__file__), "..", ".cache", "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
# The Mosaic GPU interpreter runs each warpgroup as a Python thread whose XLA executions block
# in callbacks on each other's barriers, under a callback of the kernel's own execution that
# waits for them all. Our reading: blocked callbacks hold threads of XLA's CPU intra-op pool (2
# here), so the other warpgroups' executions cannot run. test_mgpu_decode.py hung in 3 of 4
# runs (~0 % CPU; faulthandler: one thread in a barrier wait, three inside XLA executions).
# Without the pool (`--xla_cpu_multi_thread_eigen=false`, set before the CPU client exists)
# each execution runs on its caller's thread: 4 of 5 runs passed, in 45-54 s instead of ~3.5
# min; the fifth still hung, so test_mgpu_decode.py also runs its interpreted cases in child
# processes (`isolated`). Async dispatch off too (executions inline on the calling thread).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_multi_thread_eigen=false").strip()
jax.config.update("jax_cpu_enable_async_dispatch", False)


# Engines in tests compile lazily (warm-up compiles every bucket: minutes on 2 CPU cores) and
# keep buckets and page tables small.
SMALL = dict(warmup=False, max_prefill_tokens=128, max_model_len=512, max_batch_size=8,
             kv_cache_bytes=32 << 20)


@pytest.fixture(scope="session")
def hf_suite(tmp_path_factory):
    """Tiny random Llama (sharded) and Qwen2 checkpoints with PEFT adapters, built once."""
    from hf_utils import build_suite
    return build_suite(str(tmp_path_factory.mktemp("hf")))


@pytest.fixture(scope="session")
def engine_for(hf_suite):
    """engine_for(kind, dtype) -> a forkjax Engine over that checkpoint with all its adapters,
    under the exact `prefix` policy (forkkv shares base K/V across adapters: lossy by design)."""
    import forkjax

    @functools.lru_cache(maxsize=None)
    def make(kind, dtype):
        base, adapters = hf_suite[kind]
        return forkjax.Engine.from_pretrained(base, adapters=adapters, dtype=dtype,
                                              cache_policy="prefix", **SMALL)

    return make
