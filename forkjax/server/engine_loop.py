"""The engine thread: the one owner of the Engine, which is not thread-safe.

The HTTP side (asyncio) never touches the engine. It sends commands (closures) through a queue
and gets their results through futures; every request's new tokens come back through the
request's `sink`, called on this thread after each step. Between steps the thread runs all
queued commands, so a request waits at most one step to be admitted or aborted.

Unloading (or replacing) an adapter waits until the requests running on it finish, and
meanwhile the loop keeps stepping, so every other stream keeps flowing; requests for that
adapter that arrive during the wait are held and admitted after the change (a removed adapter
then answers "unknown"). A request that fans out to the adapter (writes its residual KV) counts
as one on it: after the swap it would write the slot's new weights under the old adapter's key.

When the server stops, `stop_requests` (or `shutdown`) aborts every request the loop holds: the
running and queued ones end with finish reason "shutdown", those held for an adapter change and
any added later fail with ShuttingDown, so every client gets an answer rather than a cut
connection.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time
from typing import Callable

from forkjax.engine.sequence import SamplingParams, Sequence, Status
from forkjax.server.latency import latencies

log = logging.getLogger("forkjax.serve")


@dataclasses.dataclass
class Output:
    """New tokens of one request since its last Output; `finish_reason` set on the last one."""
    index: int
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "shutdown"
    error: Exception | None = None
    logprobs: list | None = None  # per new token (logprob, top ids, top logprobs) if asked for


@dataclasses.dataclass(eq=False)
class RequestHandle:
    index: int  # position of this sequence among its HTTP request's choices
    prompt: list[int]
    adapter: str | None
    params: SamplingParams
    sink: Callable[[Output], None]
    session_id: str | None = None
    session_end: bool = False
    session_tokens: int | None = None
    session_next_s: float | None = None
    cache_salt: str | None = None
    fanout_adapters: list[str] | None = None  # None: the engine's residual_fanout setting
    seq: Sequence | None = None
    sent: int = 0  # output tokens already passed to the sink
    failure: Exception | None = None  # set when the engine itself failed under this request
    stopped: bool = False  # aborted because the HTTP side found a stop string: it ended "stop"
    shut_down: bool = False  # aborted because the server is stopping: it ended "shutdown"
    last_token_at: float | None = None  # time.monotonic() when its last tokens were published


class ShuttingDown(Exception):
    """The server is stopping: the request was not admitted."""


@dataclasses.dataclass(eq=False)
class _Barrier:
    """`action` runs once no request on adapter `name` is live; adds for it wait here."""
    name: str
    action: Callable[[], object]
    future: concurrent.futures.Future
    held: list = dataclasses.field(default_factory=list)  # (handles, future) of deferred adds


class EngineLoop:
    def __init__(self, engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, RequestHandle] = {}  # seq.id -> handle
        self._barriers: list[_Barrier] = []
        self._closing = False
        self._stopping = False  # requests are refused: the server is stopping
        # Read by the HTTP side without locks: replaced whole, never mutated in place.
        self.adapters: dict[str, str] = self._adapter_sources()
        self.generation_tokens = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.latency = latencies()  # written on the engine thread, read by metrics.snapshot
        self._thread = threading.Thread(target=self._run, name="forkjax-engine", daemon=True)

    # ---- called from any thread -----------------------------------------------------------

    def start(self):
        self._thread.start()

    def stop_requests(self):
        """Abort every request, as the server stops: running and queued ones end "shutdown";
        those held for an adapter change, and any added from now on, fail with ShuttingDown."""
        self._commands.put((self._stop_requests, None))

    def shutdown(self):
        """Stop the thread, once the requests it holds have ended as `stop_requests` says."""
        self.stop_requests()
        self._commands.put((self._close, None))
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread between steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        return fut

    def add(self, handles: list[RequestHandle]) -> concurrent.futures.Future:
        """Queue all of `handles` or, if the engine refuses one (ValueError / KeyError), none."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((lambda: self._add(handles, fut), None))
        return fut

    def abort(self, handles: list[RequestHandle], *, stop: bool = False):
        """Cancel `handles` (and free their pages); `stop`: they ended at a stop string."""
        self._commands.put((lambda: self._abort(handles, stop), None))

    def after_drain(self, name: str, action: Callable[[], object]) -> concurrent.futures.Future:
        """Run `action()` once the requests on adapter `name` have finished."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((lambda: self._barriers.append(_Barrier(name, action, fut)), None))
        return fut

    # ---- the engine thread ----------------------------------------------------------------

    def _run(self):
        while not self._closing:
            self._run_commands(block=not self.engine.scheduler.has_work)
            if self.engine.scheduler.has_work:
                try:
                    self.engine.step()
                except Exception as e:  # an engine bug: fail the requests, keep serving
                    log.exception("engine step failed; failing the requests in flight")
                    self._fail_all(e)
            self._publish()
            self._release_barriers()

    def _run_commands(self, block: bool):
        while True:
            try:
                item = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            fn, fut = item
            try:
                result = fn()
            except Exception as e:
                if fut is None:
                    log.exception("engine command failed")
                else:
                    fut.set_exception(e)
            else:
                if fut is not None:
                    fut.set_result(result)

    def _add(self, handles: list[RequestHandle], fut: concurrent.futures.Future):
        if self._stopping:
            fut.set_exception(ShuttingDown())
            return
        held = next((b for b in self._barriers if any(self._uses(h, b.name) for h in handles)), None)
        if held is not None:
            held.held.append((handles, fut))
            return
        done = []
        try:
            for h in handles:
                h.seq = self.engine.add_request(h.prompt, h.adapter, h.params, session_id=h.session_id,
                                                session_end=h.session_end,
                                                session_tokens=h.session_tokens,
                                                session_next_s=h.session_next_s,
                                                fanout_adapters=h.fanout_adapters,
                                                cache_salt=h.cache_salt)
                done.append(h)
        except Exception as e:
            for h in done:
                self.engine.abort(h.seq)
            fut.set_exception(e)
            return
        for h in handles:
            self._live[h.seq.id] = h
        fut.set_result(None)

    def _abort(self, handles: list[RequestHandle], stop: bool):
        for h in handles:
            if h.seq is not None and h.seq.id in self._live:
                h.stopped = stop
                self.engine.abort(h.seq)

    def _stop_requests(self):
        self._stopping = True
        for h in self._live.values():
            h.shut_down = True
            try:
                self.engine.abort(h.seq)
            except Exception:
                log.exception("could not abort request %d", h.seq.id)
        for b in self._barriers:
            for _, fut in b.held:
                fut.set_exception(ShuttingDown())
            b.held.clear()

    def _close(self):
        self._closing = True  # the loop ends after publishing what the aborts finished

    def _fail_all(self, error: Exception):
        for h in self._live.values():
            h.failure = error
            try:
                self.engine.abort(h.seq)
            except Exception:
                log.exception("could not abort request %d", h.seq.id)

    def _publish(self):
        for sid, h in list(self._live.items()):
            seq = h.seq
            done = seq.status is Status.FINISHED
            new = seq.output[h.sent:]
            if not new and not done:
                continue
            now = time.monotonic()
            if new:
                self._observe_tokens(h, len(new), now)
            h.sent += len(new)
            self.generation_tokens += len(new)
            out = Output(h.index, list(new), logprobs=None if h.params.logprobs is None
                         else seq.output_logprobs[h.sent - len(new):h.sent])
            if done:
                del self._live[sid]
                self.latency["e2e_request_latency_seconds"].observe(now - seq.arrival)
                if seq.first_admitted is not None:
                    self.latency["request_queue_time_seconds"].observe(seq.first_admitted - seq.arrival)
                out.finish_reason, out.error = seq.finish_reason, seq.error
                if h.failure is not None:
                    out.finish_reason, out.error = "error", h.failure
                elif h.stopped and out.finish_reason == "abort":
                    out.finish_reason = "stop"
                elif h.shut_down and out.finish_reason == "abort":
                    out.finish_reason = "shutdown"
                self.finished[out.finish_reason] += 1
            try:
                h.sink(out)
            except Exception:  # the HTTP side is gone (shutdown); the request is over anyway
                log.debug("dropped an output of request %d", sid)

    def _observe_tokens(self, h: RequestHandle, n: int, now: float):
        """The first token's latency from arrival; each later token's share of the time since
        the previous tokens were published (tokens published together share it)."""
        if h.sent == 0:
            self.latency["time_to_first_token_seconds"].observe(now - h.seq.arrival)
            n -= 1
        if n:
            since = now - (h.last_token_at if h.last_token_at is not None else now)
            self.latency["inter_token_latency_seconds"].observe(since / n, n)
        h.last_token_at = now

    def _uses(self, h: RequestHandle, name: str) -> bool:
        """Whether request `h` runs on adapter `name` or writes its residuals."""
        if h.adapter == name:
            return True
        if h.seq is not None:  # queued: the engine resolved its fan-out targets
            return name in h.seq.targets.values()
        if h.fanout_adapters is None:
            return self.engine.config.residual_fanout
        return name in h.fanout_adapters

    def _release_barriers(self):
        for b in list(self._barriers):
            if any(self._uses(h, b.name) for h in self._live.values()):
                continue
            self._barriers.remove(b)
            try:
                b.future.set_result(b.action())
            except Exception as e:
                b.future.set_exception(e)
            finally:
                self.adapters = self._adapter_sources()
            for handles, fut in b.held:
                self._add(handles, fut)

    def _adapter_sources(self) -> dict[str, str]:
        return {name: display_path(adapter.source)
                for name, adapter in self.engine.slots.by_name.items()}

    @property
    def num_held(self) -> int:
        """Requests waiting for an adapter change (not yet in the engine's queue)."""
        return sum(len(hs) for b in self._barriers for hs, _ in b.held)


def display_path(path: str) -> str:
    """A path as valid Unicode: file names that are not UTF-8 come from the OS as lone
    surrogates, which no JSON response can carry."""
    return os.fsencode(path).decode("utf-8", errors="replace")
