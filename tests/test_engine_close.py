"""`Engine.close()` and interpreter exit: a process that leaves a warm-up compiling exits
cleanly, a closed engine refuses work, and closing one engine stops only its own background
warm-up (compiler.py's programs stay shared with the other engines of the model)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import pytest

import forkjax
from forkjax.runtime.compiler import ShapeCompiler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Pool shapes no other test file uses: the step programs (COMPILER's keys) are this file's own,
# so a background warm-up here has every shape still to compile.
KW = dict(dtype="float32", max_prefill_tokens=128, max_model_len=512, max_batch_size=4,
          kv_cache_bytes=24 << 20, progress=False)
# warmup=True compiles every program before returning: here decode and one chunk, the chunk's
# score step, six sampling programs of one row (warmup_plan.py; `prefix`: no fan-out programs),
# and the host tier's copies (a store and a load a block size).
TINY = dict(KW, max_prefill_tokens=16, max_model_len=64, max_batch_size=1, host_kv_bytes=1 << 20,
            cache_policy="prefix")

# Builds an engine in a `with` block, then one it leaves open, and exits while the second's
# background warm-up (if any) still compiles.
SCRIPT = """
import forkjax
kw = {kw!r}
with forkjax.Engine.from_pretrained("tiny-llama", warmup={mode!r}, **kw) as e:
    print("with", e.generate(["Hello"], max_new_tokens=8)[0])
e = forkjax.Engine.from_pretrained("tiny-llama", warmup={mode!r}, **kw)
print("open", e.generate(["Hello"], max_new_tokens=8)[0])
w = e.runner.background_warmup
print("compiling at exit", w is not None and w.running, flush=True)
"""


@pytest.fixture(scope="module")
def reference():
    """(an engine built before the others, its greedy tokens for "Hello")."""
    engine = forkjax.Engine.from_pretrained("tiny-llama", warmup=False, **KW)
    return engine, engine.generate(["Hello"], max_new_tokens=8)


@pytest.mark.parametrize("mode", [False, True, "background"])
def test_process_exits_cleanly_with_and_without_close(mode, reference):
    """Every warm-up mode: the `with` engine and the engine left open both generate, and the
    process exits 0 without XLA aborting it, a background warm-up in flight included."""
    want = reference[1][0]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # real compiles
    env.update(JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    kw = TINY if mode is True else KW
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(kw=kw, mode=mode)], env=env,
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert f"with {want}" in run.stdout and f"open {want}" in run.stdout, out
    assert f"compiling at exit {mode == 'background'}" in run.stdout, out
    for crash in ("terminate called", "FATAL", "Traceback"):
        assert crash not in out, out


def test_closed_engine_refuses_work():
    with forkjax.Engine.from_pretrained("tiny-llama", warmup=False, **KW) as engine:
        assert len(engine.generate(["Hello"], max_new_tokens=2)[0]) == 2
    assert engine.closed
    engine.close()  # a second close does nothing
    for use in (lambda: engine.generate(["Hello"], max_new_tokens=2), engine.step,
                lambda: engine.score([1, 2, 3]), lambda: engine.unload_adapter("planner")):
        with pytest.raises(RuntimeError, match="engine is closed"):
            use()
    assert "planner" in engine.slots.by_name


def test_close_stops_the_background_warmup_and_spares_other_engines(reference):
    """close() during a background warm-up returns once its compiles in progress finish; the
    engine built earlier still gives the same greedy tokens."""
    other, want = reference
    engine = forkjax.Engine.from_pretrained("tiny-llama", warmup="background", **KW)
    warmup = engine.runner.background_warmup
    assert warmup.running
    t = time.monotonic()
    engine.close()
    assert time.monotonic() - t < 60
    assert not warmup.running and not engine.runner.warm
    assert other.generate(["Hello"], max_new_tokens=8) == want


class Executable:
    """A compiled program (the compiler refers to it weakly, as to jax's)."""


class SlowProgram:
    """A lowered program whose compile says it started, then blocks until `release` is set."""

    def __init__(self, started: threading.Event, release: threading.Event):
        self.started, self.release = started, release

    def compile(self):
        self.started.set()
        assert self.release.wait(30)
        return Executable()


def test_stop_waits_for_started_compiles_and_lowers_no_more():
    """A stopped warm-up finishes the compiles it started (their programs handed over), lowers
    nothing more and never reports done; another warm-up of the same compiler, running
    meanwhile, runs on to the end; a shape the stopped one never reached compiles when a step
    asks for it; the compiler keeps no program that nothing else holds."""
    compiler = ShapeCompiler()
    release, lowered, done, held = threading.Event(), [], [], {}

    def start(name: str, n: int):
        started = threading.Event()

        def lowering(key):
            def lower():
                lowered.append(key)
                return SlowProgram(started, release)
            return lower

        warmup = compiler.start_background([((name, i), lowering((name, i))) for i in range(n)],
                                           1, held.__setitem__, lambda: done.append(name))
        assert started.wait(30)  # its first compile is running
        return warmup

    stopped, other = start("a", 5), start("b", 3)
    stopper = threading.Thread(target=stopped.stop)
    stopper.start()
    assert stopped.stopping.wait(30)
    release.set()
    stopper.join(30)
    assert not stopper.is_alive() and not stopped.running
    # two threads (one compile at a time and one lowering): the stop found one or two started
    started_a = [k for k in lowered if k[0] == "a"]
    assert started_a in ([("a", 0)], [("a", 0), ("a", 1)])
    assert all(compiler.compiled(("a", i)) == (("a", i) in started_a) for i in range(5))
    deadline = time.monotonic() + 30
    while other.running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert done == ["b"] and all(compiler.compiled(("b", i)) for i in range(3))
    assert sorted(held) == started_a + [("b", i) for i in range(3)]
    program = compiler.get(("a", 4), lambda: SlowProgram(threading.Event(), release))
    assert isinstance(program, Executable) and compiler.compiled(("a", 4))
    del program  # nothing holds them: the compiler does not keep them alive
    for key in started_a:
        del held[key]
    gc.collect()
    assert not any(compiler.compiled(("a", i)) for i in range(5))
    assert compiler.compiled(("b", 0))
