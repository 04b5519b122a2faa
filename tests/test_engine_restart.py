"""A restart compiles nothing: a second process starting the same engine on the compile cache the
first filled (jax's persistent compilation cache, `forkjax.serve`'s --compilation-cache-dir)
loads its step and sampling programs from the program store beside it without tracing or lowering
them (runtime/program_store.py), and finds the small programs around them in jax's cache."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from forkjax.runtime.program_store import STORE_DIR

ROOT = pathlib.Path(__file__).resolve().parent.parent

START = r"""
import json, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from jax._src import dispatch, monitoring
counts = {}
count = lambda name, *_, **__: counts.__setitem__(name, counts.get(name, 0) + 1)
monitoring.register_event_listener(count)
monitoring.register_event_duration_secs_listener(count)
import forkjax
# `prefix`: no fan-out programs, so the warm-up (done thrice) stays short
engine = forkjax.Engine.from_pretrained("tiny-llama", warmup=True, progress=False, max_batch_size=4,
                                        max_model_len=256, max_prefill_tokens=64, kv_cache_bytes=1 << 22,
                                        cache_policy="prefix")
tokens = engine.generate([[5, 6, 7, 8]], adapters=["coder"], max_new_tokens=4)[0]
store = engine.runner.store
print(json.dumps(dict(tokens=list(tokens), misses=counts.get("/jax/compilation_cache/cache_misses", 0),
                      hits=counts.get("/jax/compilation_cache/cache_hits", 0),
                      lowered=counts.get(dispatch.JAXPR_TO_MLIR_MODULE_EVENT, 0),
                      loaded=store.loaded, saved=store.saved)))
"""


def _start(cache) -> dict:
    run = subprocess.run([sys.executable, "-c", START, str(cache)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_restart_loads_every_program_and_lowers_none_of_them(tmp_path):
    first, second = _start(tmp_path), _start(tmp_path)
    # the warm-up compiled the buckets' step programs and the sampling programs, and stored them
    assert first["saved"] > 10 and first["loaded"] == 0
    assert second["loaded"] == first["saved"] and second["saved"] == 0
    # ... and lowered them, which the restart does not: it lowers only the small programs,
    # all of them found in jax's cache
    assert second["lowered"] == first["lowered"] - first["saved"]
    assert second["misses"] == 0 and second["hits"] == first["misses"] - first["saved"]
    assert second["tokens"] == first["tokens"]


def test_an_unreadable_program_is_compiled_again_and_not_written_from_jaxs_cache(tmp_path):
    first = _start(tmp_path)
    stored = sorted((tmp_path / STORE_DIR).glob("*.bin"))
    assert len(stored) == first["saved"]
    for path in stored[1:]:  # cut short, as by a disk that filled mid-write
        path.write_bytes(path.read_bytes()[:100])
    again = _start(tmp_path)
    assert again["loaded"] == 1 and again["tokens"] == first["tokens"]
    # compiled again from jax's cache, whose executables do not serialize whole on a CPU (a
    # process that loaded one would fail when it runs it): not written, and the unreadable
    # files are gone
    assert again["saved"] == 0 and sorted((tmp_path / STORE_DIR).glob("*.bin")) == stored[:1]
    third = _start(tmp_path)
    assert third["loaded"] == 1 and third["tokens"] == first["tokens"]
