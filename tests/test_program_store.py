"""The program store (runtime/program_store.py) across processes: a program is loaded where it was
written, and a program it lacks is compiled anew and written even where jax's cache holds the
same module from another store key (another forkjax, another engine), whose executable would not
serialize whole again."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np

from forkjax.runtime.program_store import ProgramStore

ROOT = pathlib.Path(__file__).resolve().parent.parent

# argv: the cache directory, then the descriptions of the stores that compile program f in turn
SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from forkjax.runtime.program_store import ProgramStore
f = jax.jit(lambda x: jnp.arange(8.0) * x)
out = {}
for description in sys.argv[2:]:
    store = ProgramStore.beside_jax_cache(jax.devices()[:1], description)
    exe = store.lowering(("f",), lambda: f.trace(1.0).lower())().compile()
    out[description] = dict(y=exe(2.0).tolist(), loaded=store.loaded, saved=store.saved)
print(json.dumps(out))
"""


def _run(cache, *descriptions) -> dict:
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(cache), *descriptions], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_program_is_written_once_compiled_and_loaded_by_the_next_process(tmp_path):
    want = (np.arange(8.0) * 2).tolist()
    assert _run(tmp_path, "a")["a"] == dict(y=want, loaded=0, saved=1)
    second = _run(tmp_path, "a", "b")
    assert second["a"] == dict(y=want, loaded=1, saved=0)
    # the same module under another key: compiled by XLA again, not taken from jax's cache
    assert second["b"] == dict(y=want, loaded=0, saved=1)
    # and whole: a process that loads it runs it
    assert _run(tmp_path, "b")["b"] == dict(y=want, loaded=1, saved=0)


def test_the_store_keeps_to_jax_cache_size_dropping_the_least_recently_used(tmp_path):
    """Past `jax_compilation_cache_max_size` bytes a write removes the programs used longest ago:
    one just loaded stays."""
    store = ProgramStore(str(tmp_path), jax.devices()[:1], "trim")
    for i, name in enumerate("abcd"):  # 100 bytes each, a used longest ago
        path = store.path(name)
        pathlib.Path(path).write_bytes(bytes(100))
        os.utime(path, (1000 + i, 1000 + i))
    os.utime(store.path("a"), (2000, 2000))  # a loaded since: the most recent
    before = jax.config.jax_compilation_cache_max_size
    jax.config.update("jax_compilation_cache_max_size", 250)
    try:
        store.trim()
    finally:
        jax.config.update("jax_compilation_cache_max_size", before)
    assert sorted(p.stem for p in tmp_path.glob("*.bin")) == ["a", "d"]
    store.trim()  # unbounded again: nothing more goes
    assert len(list(tmp_path.glob("*.bin"))) == 2
