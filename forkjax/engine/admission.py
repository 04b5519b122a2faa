"""Cache-aware admission: which waiting request runs next, and whether its pages are there.

* Whole workflows: a request of a session (sessions.py) that is not admitted yet goes in only if
  the projected peak working sets of the admitted sessions plus its own fit in each pool; later
  requests of an admitted session go in within its reservation, and its path stays held between
  its turns. So the engine runs as many workflows as fit, each with its cache, instead of all of
  them with caches that evict each other (ReAct's N agents take turns: by recency alone every
  turn evicts the pages the next turn of another workflow needs). Requests without a session
  pass no such gate.
* Every waiting request holds the cached prefix it would reuse (`PrefixHold`; not the requests
  of a session that waits at the gate), so admitting others does not evict it, and a request's
  match is kept fresh as the trees change.
* Order (`lpm`, the default; SGLang's longest-prefix-match policy): the tokens a request would
  reuse (full hits, then base hits, pages that a running request in flight will insert for it
  included), then arrival; with more than LPM_MAX_WAITING requests waiting, arrival alone
  (SGLang's rule: matching every waiting request at every step costs more host time than the
  order saves). `fifo` (a baseline to compare with): arrival order, and a request that does
  not fit blocks the ones behind it. Nothing else differs.
* A request needs the pages it will allocate itself: its prompt and `min(max_new_tokens,
  DECODE_CLIP)` generated tokens, less its hits and less the pages in flight for it. It is
  admitted when that fits in the room (free pages and unheld evictable ones, held ones too with
  a host tier: dual_cache.py) less what the running requests still need by the same count.
* When none fits (a projection proved wrong, or a request without a session), the oldest
  blocked one (a request's age is its session's, else its own) may take held pages: first those
  of idle sessions (no request live, for longer than the usual wait between two turns: a
  session between turns is about to come back), longest idle first, then those of younger
  workflows and waiting requests, youngest first. A session whose holds are taken is suspended whole (it is
  recomputed when it comes back through the gate) rather than losing the tails of several.
* Starvation: a request that has waited `max_wait_s` becomes urgent. Urgent requests go first,
  in arrival order, and one that does not fit stops admission until it does; one whose workflow
  does not fit at the gate closes the gate to younger workflows (admitted ones go on, and make
  room as they end). So no request waits longer than `max_wait_s` plus the time the requests
  (or workflows) admitted then take to finish. The gate is never bypassed: in a closed loop of
  more workflows than fit, new ones wait longer than `max_wait_s` by design, and letting them
  in would only make the admitted ones evict each other.

With nothing running, a candidate that fits in the whole pool is always admitted: holds never
deadlock the engine. Nor does its own hit: a cached path can take a page more than its tokens at
each fork inside a page, and a request that then finds no pages alone runs again without it
(`Scheduler._preempt_one`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from forkjax.cache import DualRadixCache, PrefixHold
from forkjax.engine.gate import Gate
from forkjax.engine.inflight import InflightPages
from forkjax.engine.sequence import Sequence
from forkjax.engine.sessions import Session, Sessions

# Generated tokens a request is assumed to need pages for (SGLang's CLIP_MAX_NEW_TOKENS): a
# request asking for the whole context must not hold the pool up front.
DECODE_CLIP = 4096
LPM_MAX_WAITING = 128  # SGLang's bound for its longest-prefix-match order


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class Admission:
    def __init__(self, cache: DualRadixCache, inflight: InflightPages, sessions: Sessions,
                 policy: str = "lpm", max_wait_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 in_slots: Callable[[Sequence], bool] = lambda seq: True):
        """policy: "lpm" | "fifo" (checked by EngineConfig). `inflight`: the scheduler's record
        of the pages running requests will insert (inflight.py), counted as hits.
        `in_slots(seq)`: whether its adapters are in device slots (those go first)."""
        self.cache, self.inflight, self.sessions = cache, inflight, sessions
        self.in_slots = in_slots
        self.policy, self.max_wait_s, self.clock = policy, max_wait_s, clock
        self.S = cache.page_size
        self.holds: dict[int, PrefixHold] = {}  # waiting request id -> the prefix it would reuse
        self._failed_take = None  # the admission state in which taking held pages last failed

    def check_capacity(self, seq: Sequence, total: int) -> None:
        """ValueError unless a request of `total` tokens fits in the whole of each of its pools
        (every residual copy it writes too): then it can always be admitted, with nothing else
        running, and it fails at once otherwise, before anything is queued."""
        pages = _pages(total, self.S)
        capacity = {"base": self.cache.base_tree.allocator.num_pages - 1}
        copies = (self.cache.policy.res_ns(seq.adapter_key) is not None) + len(seq.fanout)
        if self.cache.res_tree is not None and copies:
            capacity["residual"] = (self.cache.res_tree.allocator.num_pages - 1) // copies
        for pool, cap in capacity.items():
            if pages + 1 > cap:  # +1: the copy-on-write page of a fork inside a shared page
                raise ValueError(f"request needs {pages} pages of {self.S} tokens plus one "
                                 f"spare page, but the whole {pool} pool holds {cap}: raise "
                                 f"kv_cache_bytes")

    def target_len(self, seq: Sequence) -> int:
        """Tokens the request is sized for: prompt and generation, the generation clipped to
        DECODE_CLIP tokens past what it has."""
        if seq.score:
            return len(seq)
        return min(len(seq.prompt) + seq.params.max_new_tokens, len(seq) + DECODE_CLIP)

    # ---- waiting requests -----------------------------------------------------------------

    def on_wait(self, seq: Sequence) -> None:
        """A request joined the queue (new, or preempted)."""
        s = self.sessions.of(seq)
        if s is None or s.admitted:
            self.holds[seq.id] = self.cache.hold(seq.tokens, seq.adapter_key,
                                                 list(seq.fanout.values()))

    def on_leave(self, seq: Sequence) -> None:
        """A request left the queue (admitted, finished or aborted)."""
        hold = self.holds.pop(seq.id, None)
        if hold is not None:
            hold.release()

    def hits(self, seq: Sequence) -> list[int]:
        """Cached tokens per pool: [base, own residual (or none), fan-out residuals...]."""
        hold = self.holds.get(seq.id)
        if hold is not None:
            hold.refresh()
            return hold.lengths
        return self.cache.match_lengths(seq.tokens, seq.adapter_key, list(seq.fanout.values()))

    def order(self, waiting) -> list[Sequence]:
        """Waiting requests in the order admission tries them: the urgent ones, the others that
        may go in now (those whose adapters are in device slots first; then lpm: by reuse), then
        those of workflows not admitted yet (by arrival)."""
        urgent, rest, gated = [], [], []
        by_reuse = self.policy == "lpm" and len(waiting) <= LPM_MAX_WAITING
        for seq in waiting:
            session = self.sessions.of(seq)
            if self.is_urgent(seq):
                urgent.append(seq)
            elif session is not None and not session.admitted:
                gated.append(seq)
            elif not by_reuse:
                rest.append((not self.in_slots(seq), seq.arrival, seq.id, seq))
            else:
                lens = self.hits(seq)
                reuse = [max(n, (n // self.S + self.inflight.pages_for(seq, i, n // self.S)) * self.S)
                         for i, n in enumerate(lens)]
                rest.append((not self.in_slots(seq), -min(reuse), -reuse[0], seq.arrival, seq.id, seq))
        rest.sort(key=lambda t: t[:-1])
        by_arrival = lambda s: (s.arrival, s.id)  # noqa: E731
        return sorted(urgent, key=by_arrival) + [t[-1] for t in rest] + sorted(gated, key=by_arrival)

    def is_urgent(self, seq: Sequence) -> bool:
        return self.clock() - seq.arrival >= self.max_wait_s

    def need(self, seq: Sequence) -> tuple[int, int]:
        """(base, residual) pages a waiting request would allocate itself."""
        target = _pages(self.target_len(seq), self.S)
        need = []
        for i, n in enumerate(self.hits(seq)):
            # a hit ending inside a page borrows that page, and copies it to write past n
            first = n // self.S
            need.append(max(0, target - first - self.inflight.pages_for(seq, i, first)))
        return need[0], sum(need[1:])

    # ---- admitting ------------------------------------------------------------------------

    def admit(self, waiting, running: list[Sequence], max_batch_size: int,
              start: Callable[[Sequence], bool]) -> None:
        """Start the waiting requests that fit, in `order`'s order, while the batch has room;
        `start(seq)` moves a request from `waiting` (the scheduler's queue) to `running` (its
        list), or returns False while its adapters find no device slot (those of running
        requests keep theirs): others go first, unless it is urgent. When none fits, the oldest
        blocked one may take held pages."""
        if not waiting or len(running) >= max_batch_size:
            return
        room, blocked, gate = None, [], Gate(self.sessions)
        gate_closed = False  # an urgent workflow waits at the gate: no younger one overtakes it
        for seq in self.order(waiting):
            if len(running) >= max_batch_size:
                return
            session = self.sessions.of(seq)
            if session is not None and not session.admitted:
                if gate_closed or not gate.fits(session):
                    gate_closed |= self.is_urgent(seq)
                    continue  # its workflow waits until the admitted ones leave room
                gate.admit(session)
            need = self.need(seq)
            if running:
                if room is None:
                    room = self.room(running)
                fits = need[0] <= room[0] and need[1] <= room[1]
            else:  # nothing else will free pages: holds give way
                fits = True
            if fits:
                if not start(seq):
                    if self.is_urgent(seq):
                        break  # nobody overtakes it while it waits for a slot
                    continue
                if room is not None:
                    room = (room[0] - need[0], room[1] - need[1])
                continue
            blocked.append((seq, need))
            if self.is_urgent(seq) or self.policy == "fifo":
                break  # nobody overtakes it while it waits for room
        if blocked and running:
            seq, need = min(blocked, key=lambda t: (t[0].priority, t[0].id))
            state = (seq.id, need, self.cache.versions, len(running),
                     self.cache.base_tree.allocator.num_free)
            if state != self._failed_take:  # nothing changed since it last failed: skip
                if self._take_held(seq, need, running, waiting):
                    start(seq)
                else:
                    self._failed_take = state

    def room(self, running: list[Sequence]) -> tuple[int, int]:
        """(base, residual) pages admission may still give out: the cache's room less what the
        running requests will still allocate."""
        (base, res), (b, r) = self.cache.room(), self._outstanding_total(running)
        return base - b, res - r

    def _outstanding_total(self, running: list[Sequence]) -> tuple[int, int]:
        needs = [self._outstanding(seq) for seq in running]
        return sum(n[0] for n in needs), sum(n[1] for n in needs)

    def _outstanding(self, seq: Sequence) -> tuple[int, int]:
        """Pages a running request will still allocate (beyond those in flight for it)."""
        b, r = seq.cache.pages_needed(self.target_len(seq))
        if seq.in_prefill:  # a follower gets pages from its leader
            first = seq.num_computed // self.S
            b -= self.inflight.pages_for(seq, 0, first)
            r -= sum(self.inflight.pages_for(seq, i, first) for i in range(1, len(seq.key_ns)))
        return max(b, 0), max(r, 0)

    def _take_held(self, seq: Sequence, need: tuple[int, int], running, waiting) -> bool:
        """Release held pages until `seq`'s need fits: stale idle sessions' (longest idle first:
        `Sessions.stale`, not those between two turns), then younger workflows' (their holds
        and their waiting requests') and younger waiting requests', youngest first; evict what it
        needs now (else the holds would come back) and suspend the sessions taken from. True if
        it fits; if it cannot fit, every hold is taken again."""
        idle = [s for s in self.sessions.stale() if s.holds]
        younger: dict = {s: list(s.holds.values()) for s in self.sessions.by_id.values()
                         if s.start > seq.priority and s not in idle}
        for w in waiting:
            if w is not seq and w.id in self.holds and w.priority > seq.priority:
                younger.setdefault(self.sessions.of(w) or w, []).append(self.holds[w.id])
        victims = [(s, list(s.holds.values())) for s in idle]
        victims += sorted(younger.items(), key=lambda t: -_age(t[0]))
        for i, (_, holds) in enumerate(victims):
            for hold in holds:
                hold.release()
            room = self.room(running)
            if need[0] <= room[0] and need[1] <= room[1]:
                out = self._outstanding_total(running)
                self.cache.evict_unheld((need[0] + out[0], need[1] + out[1]))
                for v, _ in victims[:i + 1]:
                    if isinstance(v, Session):
                        self.suspend(v, waiting)
                return True
        for _, holds in victims:
            for hold in holds:
                hold.refresh()
        return False

    def suspend(self, session: Session, waiting) -> None:
        """Take a session's pages: its holds and its waiting requests' holds drop, and its next
        request goes through the workflow gate again."""
        self.sessions.suspend(session)
        for w in waiting:
            if self.sessions.of(w) is session:
                self.on_leave(w)


def _age(victim) -> float:
    """A victim's age: its session's start, or a sessionless request's arrival."""
    return victim.start if isinstance(victim, Session) else victim.priority
