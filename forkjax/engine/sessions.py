"""Workflow sessions: what the requests of one `session_id` left in the trees stays held.

A session is one workflow's requests: ReAct agents taking turns, a MapReduce's mappers and its
reducer. When one of its requests ends, the session holds the path that request left in the
trees, one path per adapter (under `prefix` each agent has its own copy of the history, under
`forkkv` its own residual beside the shared base): the workflow's working set, until the session
has had no request for `ttl_s` seconds (KVFlow's idea: a workflow's prefix survives its tool
call). A session's age, its first request's arrival, decides under pressure which workflow keeps
its pages (admission.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable

from forkjax.cache import DualRadixCache, PrefixHold

# Seconds a session keeps its pages held after its last request ended: long enough for a tool
# call.
SESSION_TTL_S = 30.0


@dataclasses.dataclass
class Session:
    start: float  # arrival of its first request
    holds: dict = dataclasses.field(default_factory=dict)  # adapter key -> PrefixHold
    live: int = 0  # its requests queued or running
    expiry: float = float("inf")  # when it is forgotten (no request live)


class Sessions:
    def __init__(self, cache: DualRadixCache, *, hold: bool, ttl_s: float = SESSION_TTL_S):
        self.cache, self.hold, self.ttl_s = cache, hold, ttl_s
        self.by_id: dict[str, Session] = {}

    def added(self, sid: str, adapter_key: Hashable, arrival: float) -> float:
        """A request of session `sid` was queued; returns the session's age (its priority)."""
        s = self.by_id.setdefault(sid, Session(arrival))
        s.live += 1
        s.expiry = float("inf")
        old = s.holds.pop(adapter_key, None)
        if old is not None:
            old.release()  # the new request holds what it reuses of that agent's path
        return s.start

    def ended(self, sid: str, adapter_key: Hashable, tokens=None, fanout_keys=()) -> None:
        """A request of session `sid` ended, leaving `tokens` in the trees (None: nothing)."""
        s = self.by_id.get(sid)
        if s is None:
            return
        s.live -= 1
        if tokens is not None and self.hold:
            old = s.holds.pop(adapter_key, None)
            if old is not None:
                old.release()
            s.holds[adapter_key] = PrefixHold(self.cache, tokens, adapter_key, fanout_keys)
        if s.live == 0:
            s.expiry = time.monotonic() + self.ttl_s

    def expire(self) -> None:
        now = time.monotonic()
        for sid, s in list(self.by_id.items()):
            if s.expiry <= now:
                self._drop(s)
                del self.by_id[sid]

    def holds_younger_than(self, start: float) -> list[tuple[float, PrefixHold]]:
        return [(s.start, h) for s in self.by_id.values() if s.start > start for h in s.holds.values()]

    def release_all(self) -> None:
        """Drop every hold (the cache is being flushed); sessions with requests live stay."""
        for sid, s in list(self.by_id.items()):
            self._drop(s)
            if s.live == 0:
                del self.by_id[sid]

    @staticmethod
    def _drop(s: Session) -> None:
        for hold in s.holds.values():
            hold.release()
        s.holds.clear()
