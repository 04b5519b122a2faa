"""A restart compiles nothing: a second process starting the same engine on the compile cache the
first filled (jax's persistent compilation cache, `forkjax.serve`'s --compilation-cache-dir)
finds every program there, step programs and the small ones around them alike."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

START = r"""
import json, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from jax._src import monitoring
counts = {}
monitoring.register_event_listener(lambda name, **_: counts.__setitem__(name, counts.get(name, 0) + 1))
import forkjax
# `prefix`: no fan-out programs, so the warm-up (done twice) stays short
engine = forkjax.Engine.from_pretrained("tiny-llama", warmup=True, progress=False, max_batch_size=4,
                                        max_model_len=256, max_prefill_tokens=64, kv_cache_bytes=1 << 22,
                                        cache_policy="prefix")
tokens = engine.generate([[5, 6, 7, 8]], adapters=["coder"], max_new_tokens=4)[0]
print(json.dumps(dict(tokens=list(tokens), misses=counts.get("/jax/compilation_cache/cache_misses", 0),
                      hits=counts.get("/jax/compilation_cache/cache_hits", 0))))
"""


def _start(cache) -> dict:
    run = subprocess.run([sys.executable, "-c", START, str(cache)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_restart_finds_every_program_in_the_compile_cache(tmp_path):
    first, second = _start(tmp_path), _start(tmp_path)
    assert first["misses"] > 10  # the warm-up compiled the buckets' step programs and more
    assert second["misses"] == 0 and second["hits"] == first["misses"]
    assert second["tokens"] == first["tokens"]
