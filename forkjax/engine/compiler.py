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
  compile of it), so the first answer needs only the programs it runs: the 30 unrolled layers of
  a small model take seconds a program to compile on a 2-core CPU, a whole warm-up minutes
  (BENCHMARKS.md, Start-up).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Hashable

log = logging.getLogger("forkjax")


class ShapeCompiler:
    def __init__(self):
        self._lock = threading.Lock()
        self._futures: dict[Hashable, concurrent.futures.Future] = {}
        self._stop, self._background = threading.Event(), []

    def get(self, key: Hashable, lower: Callable):
        """The executable of `key`; `lower()` -> jax Lowered, called only if this thread
        compiles it."""
        future, mine = self._claim(key)
        if mine:
            self._fill(key, future, lambda: lower().compile())
        return future.result()

    def compiled(self, key: Hashable) -> bool:
        future = self._futures.get(key)
        return future is not None and future.done() and future.exception() is None

    def compile_all(self, items, workers: int, progress: Callable[[], None] | None = None,
                    stop: threading.Event | None = None):
        """items: [(key, lower)]: lowered in turn on this thread (Python), each compiled on one
        of `workers` threads as soon as one is free; returns when all are compiled, or, once
        `stop` is set, when those already started are."""
        free, jobs = threading.Semaphore(max(1, workers)), []
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            for key, lower in items:
                free.acquire()  # no backlog of lowered programs: a stop waits for few compiles
                future, mine = self._claim(key) if not (stop and stop.is_set()) else (None, False)
                if not mine:  # compiled, being compiled by another thread, or stopped
                    free.release()
                    jobs.append(future)
                    continue
                try:
                    lowered = lower()
                except BaseException as e:
                    self._fail(key, future, e)
                    raise
                jobs.append(pool.submit(self._fill, key, future, lowered.compile))
                jobs[-1].add_done_callback(lambda _: (free.release(), progress and progress()))
        for job in jobs:
            if job is not None:
                job.result()  # raises a compile's error

    def start_background(self, items, workers: int, on_done: Callable[[], None]):
        """`compile_all` on a daemon thread, in the order given, while steps run; then
        `on_done()`. Shapes are claimed one at a time, so a step needing a shape the thread
        has not reached compiles it at once instead of waiting its turn."""
        def run():
            try:
                self.compile_all(items, workers, stop=self._stop)
            except Exception:  # a step that needs it compiles it again and raises there
                log.exception("forkjax: background warm-up stopped")
            else:
                if not self._stop.is_set():
                    on_done()

        thread = threading.Thread(target=run, name="forkjax-warmup", daemon=True)
        self._background.append(thread)
        thread.start()

    def stop_background(self):
        """Start no more background compiles and wait for those running (an exiting process
        would wait for them anyway)."""
        self._stop.set()
        for thread in self._background:
            thread.join()
        self._background = []
        self._stop.clear()

    def _claim(self, key) -> tuple[concurrent.futures.Future, bool]:
        """(the future of `key`, whether the caller created it and must fill it)."""
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                return future, False
            future = self._futures[key] = concurrent.futures.Future()
            return future, True

    def _fill(self, key, future, compile_fn):
        try:
            future.set_result(compile_fn())
        except BaseException as e:
            self._fail(key, future, e)
            raise

    def _fail(self, key, future, error):
        with self._lock:  # the next step that needs it tries again
            self._futures.pop(key, None)
        future.set_exception(error)


# One per process, so that engines built in one process (tests, notebooks) share programs.
COMPILER = ShapeCompiler()
