"""Workflow sessions: what the requests of one `session_id` left in the trees stays held, and how
much of the pools a whole workflow is expected to need.

A session is one workflow's requests: ReAct agents taking turns, a MapReduce's mappers and its
reducer. When one of its requests ends, the session holds the path that request left in the
trees, one path per adapter (under `prefix` each agent has its own copy of the history, under
`forkkv` its own residual beside the shared base): the workflow's working set, between its turns
(KVFlow's idea: a workflow's prefix survives its tool call). A session ends when a request that
says `session_end` finishes (its holds drop at once), or when it has had no request for `ttl_s`
seconds, about the longest tool call a client makes.

Whole-workflow admission (admission.py) admits a session's first request only if the projected
peak working sets of the admitted sessions plus its own fit in each pool; later requests of an
admitted session go in within its reservation. A session's projection per pool is its expected
final length in pages (`session_tokens` when the client gives it, else the mean final length of
the sessions that ended, else the longest request the engine takes) times the paths it keeps in
that pool (the namespaces it touched, at least the mean of ended sessions, whose branches count
in pages, else one per loaded adapter where the pool keeps one per adapter), and never less than
what its requests so far keep (`Session.grow`: a branch per request that leaves the others). A
session whose pages are taken after all (admission.py, scheduler.py) is suspended: its holds
drop, its reservation is given back, and its next request is admitted like a first one.

With a host tier, idle paths cost a copy, not a recompute: a session whose requests say they pause
longer than PREFETCH_LEAD_S before the next (`session_next_s`: a tool call) reserves on the device
only the paths its live requests use (at least one a pool it keeps paths in), and its whole
projection in host bytes, against the host budget. Its held pages still go after unheld ones, but
count as room (evicting them writes them back to the host), and come back when its next request is
admitted, or, for the agent expected next, shortly before it is due (`prefetch`). A session that
ends retires its paths (`RadixTree.retire`): nothing asks for them again, so they leave the host at
once and the device first, without a write-back; so does an agent's next request the part of the
agent's path its prompt leaves (in parallel rounds each answer is read again at another place). A
session that does not pause keeps its whole projection on the device, as without a tier: copying
its agents' paths out and back in at every turn, in the steps' stream, gains `prefix` ReAct
workflows under 10%, and where agents read one history at once (parallel rounds) the live paths
undercount what the next turn needs and requests are preempted and recomputed (BENCHMARKS.md,
"Host tier").
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from forkjax.cache import DualRadixCache, PrefixHold
from forkjax.cache.policy import agent_key, shared_part
from forkjax.cache.tree_node import common_prefix_len

# Seconds a session keeps its pages held after its last request ended, unless a request ended it
# (`session_end`): long enough for a tool call.
SESSION_TTL_S = 30.0
# With a host tier, an idle session's paths on the host are loaded back this long before its
# next request is due (`session_next_s`): a few steps, ample for a long history's copy (512 MB
# at the ~40 GB/s of the H200's host link is 13 ms).
PREFETCH_LEAD_S = 0.25
# An idle session counts as gone (`Sessions.stale`: its reservation and holds may be taken) this
# long past its announced pause and the longest recent one: a client's next request comes a
# round trip after its last answer (milliseconds), its think time is its tool call's.
STALE_AFTER_S = 1.0
# Ended sessions whose final length and paths per pool project the next ones.
HISTORY = 64
POOLS = ("base", "res")


@dataclasses.dataclass(eq=False)  # one object per session: identity is equality
class Session:
    start: float  # arrival of its first request: its age under pressure
    tokens_hint: int | None = None  # `session_tokens`: the final length the client expects
    holds: dict = dataclasses.field(default_factory=dict)  # adapter key -> PrefixHold
    live: int = 0  # its requests queued or running
    # request id -> the paths it keeps in each pool (base, residual), while queued or running
    live_paths: dict = dataclasses.field(default_factory=dict)
    idle_since: float | None = None  # when its last live request ended; None while one is live
    next_at: float | None = None  # when its next request is due (`session_next_s`), until prefetched
    pause_s: float = 0.0  # its latest request's `session_next_s`: the pause before the next
    ending: bool = False  # a request said session_end: it ends when none is live
    admitted: bool = False  # holds a reservation (admission.py)
    tokens: int = 0  # longest request so far: prompt + max_new_tokens
    # (pool, namespace) -> the branches of the paths it keeps there: [prompt, start, end]
    paths: dict = dataclasses.field(default_factory=dict)
    version: int = 0  # changes with tokens_hint, tokens and paths
    projected: tuple | None = None  # (what it was computed from, the projection)
    last_key: object = None  # the adapter key of its latest request
    # adapter key -> the key of the request that followed one of that key last time: the
    # agent a session is expected to run next (ReAct's agents take turns in a fixed order)
    successor: dict = dataclasses.field(default_factory=dict)

    def grow(self, pool: str, ns, prompt: np.ndarray, target: int) -> None:
        """A request of `target` tokens whose prompt is `prompt` [n] int32 keeps a path in
        namespace `ns` of `pool`: it continues the branch whose prompt it extends (a ReAct
        turn), or branches off where it leaves the others (MapReduce's mappers after their
        shared document); a branch holds positions [start, end)."""
        branches = self.paths.setdefault((pool, ns), [])
        shared = 0
        for b in branches:
            n = common_prefix_len(b[0], prompt)
            if n == len(b[0]) or n == len(prompt):  # extends this branch, or lies inside it
                b[0], b[2] = max(b[0], prompt, key=len), max(b[2], target)
                return
            shared = max(shared, n)
        branches.append([prompt, shared, target])

    def pages(self, page_size: int) -> tuple[int, int]:
        """(base, residual) pages of its paths: every branch, and the partly shared page a
        branch forks inside (copied)."""
        out = dict.fromkeys(POOLS, 0)
        for (pool, _), branches in self.paths.items():
            out[pool] += sum(-(-end // page_size) - start // page_size for _, start, end in branches)
        return out["base"], out["res"]


class Sessions:
    def __init__(self, cache: DualRadixCache, *, ttl_s: float = SESSION_TTL_S,
                 clock: Callable[[], float] = time.monotonic, max_tokens: int = 0,
                 num_agents: Callable[[], int] | None = None):
        """`max_tokens`: the longest request the engine takes, the final length projected when
        nothing else is known; `num_agents()`: adapters loaded (at most those that fit in device
        slots at once), the paths projected in a pool that keeps one per adapter before any
        session has ended."""
        self.cache, self.ttl_s, self.clock = cache, ttl_s, clock
        self.max_tokens = max_tokens
        self.num_agents = num_agents or (lambda: 1)
        self.by_id: dict[str, Session] = {}
        # ended sessions: (final tokens, paths in the base pool, paths in the residual pool)
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        self._learned: tuple[float, list[float]] | None = None  # their means
        self._learned_version = 0
        # Seconds between a session's request ending and its next one (tool calls): an idle
        # session that has waited longer than any of the last ones probably ended unsaid.
        self.gaps: collections.deque = collections.deque(maxlen=HISTORY)
        self.longest_gap = 0.0
        self.num_suspended = 0
        self.capacity = (cache.base_tree.allocator.num_usable,
                         cache.res_tree.allocator.num_usable if cache.res_tree else 0)
        self.host_capacity = cache.host_budget.capacity if cache.host_budget else 0
        self.page_bytes = (cache.base_page_bytes, cache.res_page_bytes)

    # ---- a session's requests -------------------------------------------------------------

    def added(self, seq) -> Session:
        """A request of session `seq.session_id` was queued; returns its session."""
        s = self.by_id.get(seq.session_id)
        if s is None:
            s = self.by_id[seq.session_id] = Session(seq.arrival)
        if seq.session_tokens is not None:
            s.tokens_hint = max(s.tokens_hint or 0, seq.session_tokens)
        s.live += 1
        s.version += 1
        if s.idle_since is not None:
            self.gaps.append(self.clock() - s.idle_since)
            self.longest_gap = max(self.gaps)
        s.idle_since = s.next_at = None
        agent = agent_key(seq.adapter_key)
        if s.last_key is not None:
            s.successor[s.last_key] = agent
        s.last_key = agent
        if seq.req.session_next_s is not None:
            s.pause_s = seq.req.session_next_s
        target = len(seq.prompt) + seq.params.max_new_tokens
        s.tokens = max(s.tokens, target)
        prompt = np.asarray(seq.prompt, np.int32)
        for pool, ns in seq.key_ns:
            s.grow(pool, ns, prompt, target)
        s.live_paths[seq.id] = tuple(sum(p == pool for p, _ in seq.key_ns) for pool in POOLS)
        old = s.holds.pop(agent, None)
        if old is not None:
            # The new request holds what it reuses of that agent's path; where its prompt leaves
            # the path, the rest is abandoned (parallel rounds: the next history reads an
            # answer at another place), and retired rather than written back to a host tier.
            old.retire(beyond=common_prefix_len(old.tokens, prompt))
        return s

    def ended(self, seq, tokens=None) -> None:
        """A request of `seq`'s session ended, leaving `tokens` in the trees (None: nothing)."""
        s = self.by_id.get(seq.session_id)
        if s is None:
            return
        s.live -= 1
        s.live_paths.pop(seq.id, None)
        s.ending |= seq.session_end
        if tokens is not None and s.admitted and not s.ending:
            # (an Activated LoRA agent's next turn invokes it again after this one's tokens:
            # its path past this invocation is freed, its base part held)
            agent, shared = agent_key(seq.adapter_key), shared_part(tokens, seq.adapter_key)
            old = s.holds.pop(agent, None)
            if old is not None:
                old.release()
            if len(shared) < len(tokens):
                self.cache.retire(tokens, seq.adapter_key, beyond=len(shared), drop=True)
            s.holds[agent] = PrefixHold(self.cache, shared, seq.adapter_key, list(seq.fanout.values()))
        if s.ending and tokens is not None:
            # Nothing asks for this path again, whichever of the session's last requests (they
            # may run at once) it is: the parts no live request locks are retired.
            self.cache.retire(tokens, seq.adapter_key, list(seq.fanout.values()))
        if s.live == 0:
            if s.ending:
                self._end(seq.session_id)
            else:
                s.idle_since = self.clock()
                if seq.req.session_next_s is not None:
                    s.next_at = s.idle_since + seq.req.session_next_s

    def prefetch(self) -> None:
        """Load back from the host the path of the agent that idle sessions whose next request
        is due within PREFETCH_LEAD_S are expected to run next (KVFlow's idea: the copy runs
        while the tool call finishes): the agent that followed the last one the previous time.
        Without such a guess nothing is loaded ahead; the request loads its path when it starts.
        Loading every agent's path would copy paths that are not used next, and push out paths
        of other sessions that are."""
        if self.cache.host_budget is None:
            return
        now = self.clock()
        for s in self.by_id.values():
            if s.next_at is not None and s.next_at - PREFETCH_LEAD_S <= now:
                s.next_at = None
                hold = s.holds.get(s.successor.get(s.last_key))
                if hold is not None:
                    self.cache.prefetch(hold.tokens, hold.adapter_key, hold.fanout_keys)

    def of(self, seq) -> Session | None:
        return None if seq.session_id is None else self.by_id.get(seq.session_id)

    def expire(self) -> None:
        now = self.clock()
        for sid, s in list(self.by_id.items()):
            if s.idle_since is not None and s.idle_since + self.ttl_s <= now:
                self._end(sid)

    def _end(self, sid: str) -> None:
        """Session `sid` ended: its paths are retired (`RadixTree.retire`: evicted first, not
        written back to the host), not only released."""
        s = self.by_id.pop(sid)
        for hold in s.holds.values():
            hold.retire()
        s.holds.clear()
        if s.tokens:
            S = self.cache.page_size
            per_path = -(-s.tokens // S)
            self.history.append((s.tokens, *(p / per_path for p in s.pages(S))))
            self._learned_version += 1
            n = len(self.history)
            self._learned = (sum(h[0] for h in self.history) / n,
                             [sum(h[i] for h in self.history) / n for i in (1, 2)])

    # ---- reservations ---------------------------------------------------------------------

    def projection(self, s: Session) -> tuple[float, float]:
        """(base, residual) pages session `s` is expected to hold at its end."""
        return tuple(max(paths * per_path, used) for paths, per_path, used in self._projected(s))

    def reservation(self, s: Session) -> tuple[tuple[float, float], float]:
        """((base, residual) device pages, host bytes) session `s` reserves: its whole
        projection on the device; with a host tier and a pause between its requests, the paths
        of its live requests there (at least one a pool), and the whole projection on the host,
        where all of it may wait during a pause."""
        if not self.host_capacity or s.pause_s <= PREFETCH_LEAD_S:
            return self.projection(s), 0.0
        live = [sum(n[i] for n in s.live_paths.values()) for i in range(len(POOLS))]
        device, host = [], 0.0
        for (paths, per_path, used), n, page_bytes in zip(self._projected(s), live,
                                                          self.page_bytes):
            whole = max(paths * per_path, used)
            device.append(min(whole, max(1, n) * per_path) if paths else whole)
            host += whole * page_bytes  # in a pause its live paths leave the device too
        return tuple(device), host

    def _projected(self, s: Session) -> tuple:
        """Per pool: (paths, pages a path, pages its requests so far keep)."""
        key = (s.version, self._learned_version, self.num_agents())
        if s.projected is None or s.projected[0] != key:  # admission asks every step
            s.projected = key, self._project(s)
        return s.projected[1]

    def _project(self, s: Session) -> tuple:
        S = self.cache.page_size
        seen = [len({ns for pool, ns in s.paths if pool == p}) for p in POOLS]
        if self._learned is not None:
            tokens, paths = self._learned
        else:
            tokens = self.max_tokens
            paths = [self._default_paths(p) for p in POOLS]
        tokens = max(s.tokens_hint or tokens, s.tokens)
        used = s.pages(S)
        return tuple((max(k, n), -(-tokens // S), u) for k, n, u in zip(paths, seen, used))

    def _default_paths(self, pool: str) -> int:
        policy = self.cache.policy
        if pool == "res":
            return 0 if policy.residual is None else (
                self.num_agents() if policy.residual == "per_adapter" else 1)
        return self.num_agents() if policy.base_per_adapter else 1

    def suspend(self, s: Session) -> None:
        """Take session `s`'s pages: its holds drop and its next request is admitted anew."""
        self.drop(s)
        s.admitted = False
        self.num_suspended += 1

    # ---- holds ----------------------------------------------------------------------------

    def idle(self) -> list[Session]:
        """Sessions with no request live, longest idle first."""
        return sorted((s for s in self.by_id.values() if s.idle_since is not None),
                      key=lambda s: s.idle_since)

    def stale(self) -> list[Session]:
        """Idle sessions not between two turns, longest idle first: idle for STALE_AFTER_S
        longer than the pause they announced (`session_next_s`) and than the longest recent
        wait between two requests of one session. A client's next request comes a round trip
        after its last one ended, over HTTP a few steps; a stale session's pages may go before
        a running workflow's."""
        now = self.clock()
        return [s for s in self.idle()
                if now - s.idle_since > max(s.pause_s, self.longest_gap) + STALE_AFTER_S]

    def release_all(self) -> None:
        """Drop every hold (the cache is being flushed); sessions with requests live stay."""
        for sid, s in list(self.by_id.items()):
            self.drop(s)
            if s.live == 0:
                del self.by_id[sid]

    @staticmethod
    def drop(s: Session) -> None:
        for hold in s.holds.values():
            hold.release()
        s.holds.clear()
