"""The step's executables, one per shape key, each compiled once while an engine holds it.

A step asks `COMPILER.get(key, lower)`: the executable if one is alive, else it waits for the
compile another thread started, else it lowers and compiles it itself. The key holds everything
the program depends on (model structure, pool shapes, bucket shape), so engines of one model and
layout share their programs, as jit's own cache would. Warm-up is the same call made ahead of
time for every bucket:

- `compile_all`: every shape now, on several threads, each lowering (Python) and compiling
  (XLA) the next program of the list. Serving then never stalls on the compiler.
- `start_background`: the same on a daemon thread while the engine serves. A request whose
  shape is not compiled yet compiles it when it comes (or waits for the background thread's
  compile of it), so the first answer needs only the programs it runs (BENCHMARKS.md,
  Start-up).

Both hand each program to `on_compiled(key, executable)` as it is done: the engine holds its
programs, the compiler only refers to them (weakly). A program lives as long as an engine holds
it, and a process that builds engine after engine (tests, notebooks) holds only the live ones'
programs: an XLA:CPU program maps a hundred or more regions of memory, and past Linux's
vm.max_map_count (65,530) the next map fails inside XLA, which crashes the process.

A thread lowers and compiles its own programs: jax lowers a thread's programs into one MLIR
context that it reuses, and a module compiled on another thread would be read there while this
thread builds the next module in the same context.

A background warm-up stops (`BackgroundWarmup.stop`: its engine's `close()`; `stop_background`:
all of them, at interpreter exit too) once the compiles it already started finish.

`CompileTimes` sums the seconds jax reports tracing, lowering and compiling, for the benchmarks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Callable, Hashable

import jax

log = logging.getLogger("forkjax")

OnCompiled = Callable[[Hashable, object], None]


class BackgroundWarmup:
    """One `compile_all` on a daemon thread of its own, with its own stop event: stopping one
    engine's warm-up leaves another engine's running."""

    def __init__(self, run: Callable[[threading.Event], None]):
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=run, args=(self.stopping,), name="forkjax-warmup",
                                        daemon=True)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self):
        self._thread.start()

    def stop(self):
        """Lower and compile no more shapes; return once the compiles already started have
        finished (their programs are handed over as usual)."""
        self.stopping.set()
        if self._thread.ident is not None:  # started (a stop may come between add and start)
            self._thread.join()


class ShapeCompiler:
    def __init__(self):
        self._lock = threading.Lock()
        self._compiling: dict[Hashable, concurrent.futures.Future] = {}
        self._programs = weakref.WeakValueDictionary()  # key -> executable, while one is held
        self._background: set[BackgroundWarmup] = set()

    def get(self, key: Hashable, lower: Callable):
        """The executable of `key`; `lower()` -> jax Lowered, called only if this thread
        compiles it."""
        future, mine = self._claim(key)
        if mine and (program := self._lower(key, future, lower)) is not None:
            self._compile(key, future, program)
        return future.result()

    def compiled(self, key: Hashable) -> bool:
        """An executable of `key` is alive (an engine holds it)."""
        return self._programs.get(key) is not None

    def compile_all(self, items, workers: int, on_compiled: OnCompiled,
                    progress: Callable[[], None] | None = None, stop: threading.Event | None = None):
        """items: [(key, lower)], taken in turn by `workers` + 1 threads, so that `workers`
        compile while one lowers (one lowering at a time: it is Python, which runs on one
        core); a thread compiles what it lowered. `on_compiled(key, executable)` as each is
        done (also those another thread compiled). Returns when all are compiled, or, once
        `stop` is set, when the compiles this call started are (it lowers no more). The threads
        start with the call, not with each compile: once the interpreter exits (when the exit
        hook below stops a background warm-up) Python starts no new thread."""
        todo, lowering = iter(items), threading.Lock()
        mine, others = [], []

        def work():
            while True:
                with lowering:  # the next item, lowered by this thread alone
                    item = None if stop is not None and stop.is_set() else next(todo, None)
                    if item is None:
                        return
                    key, lower = item
                    future, claimed = self._claim(key)
                    (mine if claimed else others).append(future)
                    future.add_done_callback(
                        lambda f, key=key: f.exception() or on_compiled(key, f.result()))
                    program = self._lower(key, future, lower) if claimed else None
                if program is not None:
                    self._compile(key, future, program)
                if progress is not None:
                    progress()

        threads = [threading.Thread(target=work, name="forkjax-compile", daemon=True)
                   for _ in range(max(1, workers) + 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stopped = stop is not None and stop.is_set()
        for future in mine + ([] if stopped else others):
            future.result()  # raises a compile's error

    def start_background(self, items, workers: int, on_compiled: OnCompiled,
                         on_done: Callable[[], None]) -> BackgroundWarmup:
        """`compile_all` on a daemon thread, in the order given, while steps run; then
        `on_done()` unless stopped first. Shapes are claimed one at a time, so a step needing a
        shape the threads have not reached compiles it at once instead of waiting its turn."""
        def run(stopping: threading.Event):
            try:
                self.compile_all(items, workers, on_compiled, stop=stopping)
            except Exception:  # a step that needs it compiles it again and raises there
                log.exception("background warm-up stopped")
            else:
                if not stopping.is_set():
                    on_done()
            finally:
                with self._lock:
                    self._background.discard(warmup)

        warmup = BackgroundWarmup(run)
        with self._lock:
            self._background.add(warmup)
        warmup.start()
        return warmup

    def stop_background(self):
        """Stop every background warm-up of the process (`BackgroundWarmup.stop`)."""
        with self._lock:
            running = list(self._background)
        for warmup in running:
            warmup.stop()

    def _claim(self, key) -> tuple[concurrent.futures.Future, bool]:
        """(a future of `key`, whether the caller created it and must fill it): done at once
        when an executable is alive, another thread's while it compiles it."""
        with self._lock:
            program = self._programs.get(key)
            if program is not None:
                future = concurrent.futures.Future()
                future.set_result(program)
                return future, False
            future = self._compiling.get(key)
            if future is not None:
                return future, False
            future = self._compiling[key] = concurrent.futures.Future()
            return future, True

    def _lower(self, key, future, lower):
        """`lower()`, or None after its error failed the claim of `key`."""
        try:
            return lower()
        except BaseException as e:
            self._fail(key, future, e)
            return None

    def _compile(self, key, future, program):
        """`future`'s result: `program.compile()`, on the thread that lowered it, or its error
        (`future.result()` raises it)."""
        try:
            executable = program.compile()
        except BaseException as e:
            self._fail(key, future, e)
        else:
            with self._lock:
                self._programs[key] = executable
                self._compiling.pop(key, None)
            future.set_result(executable)

    def _fail(self, key, future, error):
        with self._lock:  # the next step that needs it tries again
            self._compiling.pop(key, None)
        future.set_exception(error)


# One per process, so that engines built in one process (tests, notebooks) share programs.
COMPILER = ShapeCompiler()
# At interpreter exit a warm-up still compiling would be cut off inside XLA once the interpreter
# tears down (the process aborts). threading's exit hooks run first thing at exit, before any
# `atexit` handler, and so before jax's, which clear its backends.
threading._register_atexit(COMPILER.stop_background)


class CompileTimes:
    """Seconds JAX spends tracing, lowering and compiling (summed over threads), from its
    monitoring events, since this object was made: the benchmarks' compile breakdowns."""

    EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
              "/jax/core/compile/backend_compile_duration": "backend_compile_s"}

    def __init__(self):
        self.totals = dict.fromkeys(self.EVENTS.values(), 0.0)
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name, secs, **_):
        if name in self.EVENTS:
            self.totals[self.EVENTS[name]] += secs

    def since(self, before: dict) -> dict:
        return {k: round(v - before[k], 3) for k, v in self.totals.items()}
