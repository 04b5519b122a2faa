"""The step's executables, one per shape key, each compiled once in the process.

A step asks `COMPILER.get(key, lower)`: the executable if it is compiled, else it waits for the
compile another thread started, else it lowers and compiles it itself. The key holds everything
the program depends on (model structure, pool shapes, bucket shape), so engines of one model and
layout share their programs, as jit's own cache would. Warm-up is the same call made ahead of
time for every bucket:

- `compile_all`: every shape now, XLA's compiles on several threads (lowering is Python, one
  shape after the other). Serving then never stalls on the compiler.
- `start_background`: the same on a daemon thread while the engine serves. A request whose
  shape is not compiled yet compiles it when it comes (or waits for the background thread's
  compile of it), so the first answer needs only the programs it runs (BENCHMARKS.md,
  Start-up).

A background warm-up stops (`BackgroundWarmup.stop`: its engine's `close()`; `stop_background`:
all of them, at interpreter exit too) once the compiles it already started finish; the programs
it compiled stay shared.

`CompileTimes` sums the seconds jax reports tracing, lowering and compiling, for the benchmarks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Hashable

import jax

log = logging.getLogger("forkjax")


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
        finished (their programs are kept)."""
        self.stopping.set()
        if self._thread.ident is not None:  # started (a stop may come between add and start)
            self._thread.join()


class ShapeCompiler:
    def __init__(self):
        self._lock = threading.Lock()
        self._futures: dict[Hashable, concurrent.futures.Future] = {}
        self._background: set[BackgroundWarmup] = set()

    def get(self, key: Hashable, lower: Callable):
        """The executable of `key`; `lower()` -> jax Lowered, called only if this thread
        compiles it."""
        future, mine = self._claim(key)
        if mine:
            self._fill(key, future, lambda: lower().compile())
        return future.result()

    def clear(self) -> None:
        """Forget the programs compiled (engines keep those they hold; compiles in flight stay)."""
        with self._lock:
            self._futures = {k: f for k, f in self._futures.items() if not f.done()}

    def compiled(self, key: Hashable) -> bool:
        future = self._futures.get(key)
        return future is not None and future.done() and future.exception() is None

    def compile_all(self, items, workers: int, progress: Callable[[], None] | None = None,
                    stop: threading.Event | None = None):
        """items: [(key, lower)]: lowered in turn on this thread (Python), each compiled on one
        of `workers` threads as soon as one is free; returns when all are compiled, or, once
        `stop` is set, when the compiles this call started are (it lowers no more). The threads
        start with the call, not with each compile: once the interpreter exits (when the exit
        hook below stops a background warm-up) Python starts no new thread."""
        free, lowered = threading.Semaphore(max(1, workers)), queue.SimpleQueue()
        threads = [threading.Thread(target=self._compile_each, args=(lowered, free, progress),
                                    name="forkjax-compile", daemon=True)
                   for _ in range(max(1, workers))]
        for thread in threads:
            thread.start()
        mine, others = [], []
        try:
            for key, lower in items:
                free.acquire()  # no backlog of lowered programs: a stop waits for few compiles
                if stop is not None and stop.is_set():
                    break
                future, claimed = self._claim(key)
                if not claimed:  # compiled, or being compiled by another thread
                    free.release()
                    others.append(future)
                    continue
                mine.append(future)
                lowered.put((key, future, self._lower(key, future, lower)))
        finally:
            for _ in threads:
                lowered.put(None)
            for thread in threads:
                thread.join()
        stopped = stop is not None and stop.is_set()
        for future in mine + ([] if stopped else others):
            future.result()  # raises a compile's error

    def start_background(self, items, workers: int, on_done: Callable[[], None]) -> BackgroundWarmup:
        """`compile_all` on a daemon thread, in the order given, while steps run; then
        `on_done()` unless stopped first. Shapes are claimed one at a time, so a step needing a
        shape the thread has not reached compiles it at once instead of waiting its turn."""
        def run(stopping: threading.Event):
            try:
                self.compile_all(items, workers, stop=stopping)
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
        """(the future of `key`, whether the caller created it and must fill it)."""
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                return future, False
            future = self._futures[key] = concurrent.futures.Future()
            return future, True

    def _lower(self, key, future, lower):
        """`lower()`; its error fails the claim of `key` and is raised."""
        try:
            return lower()
        except BaseException as e:
            self._fail(key, future, e)
            raise

    def _compile_each(self, lowered: queue.SimpleQueue, free: threading.Semaphore, progress):
        """One compile thread of `compile_all`: compiles (key, future, Lowered) items until None."""
        while (item := lowered.get()) is not None:
            key, future, program = item
            self._fill(key, future, program.compile)
            free.release()
            if progress is not None:
                progress()

    def _fill(self, key, future, compile_fn):
        """`future`'s result: compile_fn()'s, or its error (`future.result()` raises it)."""
        try:
            future.set_result(compile_fn())
        except BaseException as e:
            self._fail(key, future, e)

    def _fail(self, key, future, error):
        with self._lock:  # the next step that needs it tries again
            self._futures.pop(key, None)
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
