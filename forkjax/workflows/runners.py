"""Run a set of workflows on a clean cache and return (RunResult, the engine's stats for the run):
in process through the Engine API (driver.py), or over HTTP through a LocalServer around the
engine (http_driver.py, its statistics from the server's /metrics)."""

from __future__ import annotations

import asyncio

from forkjax.workflows.driver import run_in_process


class InProcess:
    """Runs workflows through the Engine API."""

    def __init__(self, engine, fanout: bool):
        self.engine, self.fanout = engine, fanout

    def fresh(self):
        self.engine.flush_cache()
        self.engine.reset_stats()

    def run(self, workflows, desc: str):
        return run_in_process(self.engine, workflows, fanout=self.fanout, desc=desc), self.engine.stats()


class OverHttp:
    """Runs workflows through the HTTP API of a LocalServer over the engine."""

    def __init__(self, server, fanout: bool):
        self.server, self.fanout = server, fanout

    def fresh(self):
        engine = self.server.loop.engine
        self.server.call(lambda: (engine.flush_cache(), engine.reset_stats()))

    def run(self, workflows, desc: str):
        from forkjax.workflows.http_driver import run_http, scrape, stats_between

        async def go():
            before = await scrape(self.server.url)
            result = await run_http(self.server.url, workflows, fanout=self.fanout, desc=desc)
            return result, stats_between(before, await scrape(self.server.url))
        return asyncio.run(go())
