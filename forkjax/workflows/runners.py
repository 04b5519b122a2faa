"""Run a set of workflows on a clean cache and return (RunResult, the engine's stats for the run):
in process through the Engine API (driver.py; an Engine, or replay.py's ReplayEngine on its
virtual clock), or over HTTP against a `python -m forkjax.serve` process (local_server.py's
ServerProcess; http_driver.py, its statistics from the server's /metrics)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from forkjax.workflows.driver import run_in_process


class InProcess:
    """Runs workflows through the Engine API; `clock` and `sleep` are the driver's time (a
    replay passes its virtual clock's)."""

    def __init__(self, engine, fanout: bool, session_hints: bool = True, *,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self.engine, self.fanout, self.session_hints = engine, fanout, session_hints
        self.clock, self.sleep = clock, sleep

    def fresh(self):
        self.engine.flush_cache()
        self.engine.reset_stats()

    def run(self, workflows, desc: str):
        result = run_in_process(self.engine, workflows, fanout=self.fanout,
                                session_hints=self.session_hints, desc=desc, clock=self.clock,
                                sleep=self.sleep)
        return result, self.engine.stats()


class OverHttp:
    """Runs workflows through the HTTP API of a ServerProcess. The server's counters cannot be
    reset: a run's stats are the differences of /metrics around it (http_driver.stats_between)."""

    def __init__(self, server, fanout: bool, session_hints: bool = True):
        self.server, self.fanout, self.session_hints = server, fanout, session_hints

    def fresh(self):
        self.server.flush()

    def run(self, workflows, desc: str):
        from forkjax.workflows.http_driver import run_http, scrape, stats_between

        async def go():
            before = await scrape(self.server.url)
            result = await run_http(self.server.url, workflows, fanout=self.fanout,
                                    session_hints=self.session_hints, desc=desc)
            return result, stats_between(before, await scrape(self.server.url))
        return asyncio.run(go())
