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


class OverRouter:
    """Runs workflows through a gateway in front of several servers (`python -m forkjax.cluster`,
    at `url`): each workflow's calls carry its routing key, and a run's stats add up every
    worker's /metrics differences (http_driver.stats_across). The workers are the ones the
    gateway lists (SMG's GET /workers); the base model's name is the first of its /v1/models.
    `api_key`: the cluster's (`--api-key`, which guards the gateway and every worker alike), sent
    as `Authorization: Bearer` (`headers`) on every call but /metrics, which no key guards."""

    def __init__(self, url: str, fanout: bool, session_hints: bool = True, api_key: str | None = None):
        import httpx
        self.url, self.fanout, self.session_hints = url.rstrip("/"), fanout, session_hints
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        get = lambda path: httpx.get(f"{self.url}{path}", headers=self.headers, timeout=30)  # noqa: E731
        self.workers = [w["url"] for w in get("/workers").raise_for_status().json()["workers"]]
        self.base_model = get("/v1/models").raise_for_status().json()["data"][0]["id"]

    def fresh(self):
        import httpx
        for w in self.workers:
            httpx.post(f"{w}/flush_cache", headers=self.headers, timeout=600).raise_for_status()

    def run(self, workflows, desc: str):
        from forkjax.workflows.http_driver import run_http, scrape, stats_across

        async def go():
            before = [await scrape(w) for w in self.workers]
            result = await run_http(self.url, workflows, fanout=self.fanout, session_hints=self.session_hints,
                                    api_key=self.api_key or "EMPTY", desc=desc, base_model=self.base_model)
            return result, stats_across(before, [await scrape(w) for w in self.workers])
        return asyncio.run(go())
