"""The program store (runtime/program_store.py) across processes: a program is loaded where it was
written, and a program it lacks is compiled anew and written even where jax's cache holds the
same module from another store key (another forkjax, another engine), whose executable would not
serialize whole again."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np

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
