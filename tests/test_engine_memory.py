"""The defaults the device's memory sets (engine/memory.py): the batch by platform and device
size, the KV budget less the step workspace, and the workspace bound against what XLA actually
allocates for the largest programs of a real engine."""

from __future__ import annotations

import os

import jax
import pytest

import forkjax
from forkjax.config import ModelConfig
from forkjax.engine import memory
from forkjax.models.builtin import BUILTIN_CONFIGS

GIB = 1 << 30


@pytest.mark.parametrize("on_gpu,device_bytes,want", [
    (False, 0, 16), (True, 141 * GIB, 256), (True, 40 * GIB, 256), (True, 24 * GIB, 128),
    (True, 8 * GIB, 64)])
def test_default_batch_by_platform(on_gpu, device_bytes, want):
    assert memory.default_max_batch_size(on_gpu, device_bytes) == want


def test_engine_defaults_follow_the_platform():
    on_gpu = jax.default_backend() == "gpu"
    with forkjax.Engine.from_pretrained("tiny-llama", warmup=False, progress=False) as engine:
        batch = engine.scheduler.max_batch_size
        assert batch == memory.default_max_batch_size(on_gpu, memory.device_memory()[0])
        assert batch == (256 if on_gpu else 16)  # every GPU this runs on has 40 GiB or more
        assert engine.runner.buckets.decode_sizes == [2 ** i for i in range(2, batch.bit_length())]
        if not on_gpu:
            assert engine.runner.layout.nbytes <= memory.DEFAULT_CPU_KV_BYTES


def test_host_tier_default_by_platform(monkeypatch):
    """Off on a CPU; on a GPU half the available host memory, at most twice the KV budget and
    0.8 of XLA's pinned host limit, which the command lines raise to fit a larger request."""
    pinned = 64 * GIB
    assert memory.default_host_kv_bytes(False, 60 * GIB, 128 * GIB, pinned) == 0
    assert memory.default_host_kv_bytes(True, 60 * GIB, 100 * GIB, pinned) == 50 * GIB
    assert memory.default_host_kv_bytes(True, 10 * GIB, 100 * GIB, pinned) == 20 * GIB
    assert memory.default_host_kv_bytes(True, 60 * GIB, 200 * GIB, pinned) == int(0.8 * 64 * GIB)
    monkeypatch.setenv(memory.PINNED_HOST_ENV, "64")  # so that the test's own setting is undone
    monkeypatch.delenv(memory.PINNED_HOST_ENV)
    assert memory.host_kv_bytes(70 * GIB, False, GIB) == 70 * GIB  # no pinned allocator on a CPU
    with pytest.raises(ValueError, match=f"{memory.PINNED_HOST_ENV}=88 "):
        memory.host_kv_bytes(70 * GIB, True, GIB)
    memory.reserve_pinned_host(70 * GIB)
    assert os.environ[memory.PINNED_HOST_ENV] == "88" and memory.host_kv_bytes(70 * GIB, True, GIB) == 70 * GIB
    memory.reserve_pinned_host(GIB)  # a smaller request leaves the limit as it is
    assert memory.pinned_host_limit() == 88 * GIB
    assert memory.host_memory_available() > 0  # Linux, here and on the GPU machines
    on_gpu = jax.default_backend() == "gpu"
    with forkjax.Engine.from_pretrained("tiny-llama", warmup=False, progress=False) as engine:
        assert (engine.stats()["host_bytes_total"] > 0) == on_gpu


def test_kv_budget_sets_the_workspace_aside():
    llama = ModelConfig.from_hf(BUILTIN_CONFIGS["llama3.1-8b-random"])
    ws = memory.step_workspace_bytes(llama, 256, 2048)
    # Llama-3-8B at batch 256 and 2,048-token chunks: a scoring chunk's [2048, 128256] float32
    # logits twice (2.1 GB) dominate; the whole is a few GB, small beside an H200's ~90 GB free.
    assert 2.1e9 < ws < 6e9
    free = 90 * GIB
    assert memory.default_kv_cache_bytes(True, free, ws) == int(free * memory.MEMORY_UTILIZATION) - ws
    assert memory.default_kv_cache_bytes(True, ws, ws) == memory.DEFAULT_CPU_KV_BYTES
    assert memory.default_kv_cache_bytes(False, free, ws) == memory.DEFAULT_CPU_KV_BYTES
    # More rows, more workspace.
    assert memory.step_workspace_bytes(llama, 64, 2048) < ws < memory.step_workspace_bytes(llama, 256, 8192)


def test_workspace_bounds_the_compiled_programs():
    """XLA's temporary bytes of every program an engine ran, a scoring program (every token's
    logits and hidden states) included, stay within the estimate."""
    kw = dict(dtype="float32", max_batch_size=8, max_prefill_tokens=128, max_model_len=512,
              kv_cache_bytes=32 << 20, progress=False, warmup=False)  # conftest.SMALL's shapes
    with forkjax.Engine.from_pretrained("tiny-llama", **kw) as engine:
        engine.score(list(range(1, 200)), return_hidden_states=True)  # two chunks
        engine.generate(["Hello"] * 8, max_new_tokens=2)
        exes = engine.runner._exes  # {(kind, B, C, W, all_logits, hidden, fanout): executable}
        assert any(shape[4] and shape[5] for shape in exes) and any(s[0] == "decode" for s in exes)
        temps = [exe.memory_analysis().temp_size_in_bytes for exe in exes.values()]
        bound = memory.step_workspace_bytes(engine.model_cfg, 8, 128)
    assert 0 < max(temps) <= bound
