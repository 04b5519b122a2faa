"""Cache-aware admission: which waiting request runs next, and whether its pages are there.

`lpm` (the default; SGLang's longest-prefix-match policy, and more):

* every waiting request holds the cached prefix it would reuse (`PrefixHold`), and a workflow
  (`session_id`) whose request just ended holds what it left in the trees for a while, so
  admitting others does not evict either, and a request's match is kept fresh as the trees change;
* candidates go in order of the tokens they would reuse (full hits, then base hits, pages that a
  running request in flight will insert for them included), then of arrival;
* a request needs the pages it will allocate itself: its prompt and `min(max_new_tokens,
  DECODE_CLIP)` generated tokens, less its hits and less the pages in flight for it. It is
  admitted when that fits in the room (free pages and unheld evictable ones) less what the
  running requests still need by the same count;
* under pressure the older workflow wins (a request's age is its session's, else its own): when
  no candidate fits, the oldest one may take the pages held for younger workflows and requests,
  which are evicted for it. So the engine runs fewer workflows at a time, each with its cache,
  instead of all of them with caches that evict each other (ReAct's N agents take turns: by
  recency alone every turn evicts the pages the next turn of another workflow needs);
* starvation: a request that has waited `max_wait_s` becomes urgent. Urgent requests go first,
  in arrival order, and one that does not fit stops admission until it does. So no request waits
  longer than `max_wait_s` plus the time the requests running then take to finish.

`fifo` (a baseline to compare with): arrival order, the head of the queue blocks the rest, a
request needs its prompt's pages beyond its hits, nothing is held.

With nothing running, a candidate that fits in the whole pool is always admitted: holds never
deadlock the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from forkjax.cache import DualRadixCache
from forkjax.engine.inflight import InflightPages
from forkjax.engine.sequence import Sequence
from forkjax.engine.sessions import Sessions

# Generated tokens a request is assumed to need pages for (SGLang's CLIP_MAX_NEW_TOKENS): a
# request asking for the whole context must not hold the pool up front.
DECODE_CLIP = 4096


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class Admission:
    def __init__(self, cache: DualRadixCache, inflight: InflightPages, policy: str = "lpm",
                 max_wait_s: float = 60.0):
        """policy: "lpm" | "fifo" (checked by EngineConfig). `inflight`: the scheduler's record
        of the pages running requests will insert (inflight.py), counted as hits."""
        self.cache, self.inflight = cache, inflight
        self.policy, self.max_wait_s = policy, max_wait_s
        self.S = cache.page_size
        self._failed_take = None  # the admission state in which taking younger holds last failed

    @property
    def holds(self) -> bool:
        return self.policy == "lpm"

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
        DECODE_CLIP tokens past what it has (`fifo`: the tokens it has)."""
        if seq.score or self.policy == "fifo":
            return len(seq)
        return min(len(seq.prompt) + seq.params.max_new_tokens, len(seq) + DECODE_CLIP)

    # ---- waiting requests -----------------------------------------------------------------

    def on_wait(self, seq: Sequence) -> None:
        """A request joined the queue (new, or preempted)."""
        if self.holds:
            seq.hold = self.cache.hold(seq.tokens, seq.adapter_key, list(seq.fanout.values()))

    def on_leave(self, seq: Sequence) -> None:
        """A request left the queue (admitted, finished or aborted)."""
        if seq.hold is not None:
            seq.hold.release()
            seq.hold = None

    def hits(self, seq: Sequence) -> list[int]:
        """Cached tokens per pool: [base, own residual (or none), fan-out residuals...]."""
        if seq.hold is not None:
            seq.hold.refresh()
            return seq.hold.lengths
        return self.cache.match_lengths(seq.tokens, seq.adapter_key, list(seq.fanout.values()))

    def order(self, waiting) -> list[Sequence]:
        """Waiting requests in the order admission tries them."""
        if self.policy == "fifo":
            return list(waiting)
        urgent, rest = [], []
        for seq in waiting:
            if self.is_urgent(seq):
                urgent.append(seq)
                continue
            lens = self.hits(seq)
            reuse = [max(n, (n // self.S + self.inflight.pages_for(seq, i, n // self.S)) * self.S)
                     for i, n in enumerate(lens)]
            rest.append((-min(reuse), -reuse[0], seq.arrival, seq.id, seq))
        rest.sort(key=lambda t: t[:4])
        return sorted(urgent, key=lambda s: (s.arrival, s.id)) + [t[-1] for t in rest]

    def is_urgent(self, seq: Sequence) -> bool:
        return self.policy == "fifo" or time.monotonic() - seq.arrival >= self.max_wait_s

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

    def admit(self, waiting, running: list[Sequence], max_batch_size: int, sessions: Sessions,
              start: Callable[[Sequence], None]) -> None:
        """Start the waiting requests that fit, in `order`'s order, while the batch has room;
        `start(seq)` moves a request from `waiting` (the scheduler's queue) to `running` (its
        list). When none fits, the oldest blocked one may take younger workflows' holds."""
        if not waiting or len(running) >= max_batch_size:
            return
        room, blocked = None, []
        for seq in self.order(waiting):
            if len(running) >= max_batch_size:
                return
            need = self.need(seq)
            if running:
                if room is None:
                    room = self.room(running)
                fits = need[0] <= room[0] and need[1] <= room[1]
            else:  # nothing else will free pages: holds give way
                fits = True
            if fits:
                start(seq)
                if room is not None:
                    room = (room[0] - need[0], room[1] - need[1])
                continue
            blocked.append((seq, need))
            if self.is_urgent(seq):
                break  # it goes first: nobody overtakes it while it waits for room
        if blocked and running and self.holds:
            seq, need = min(blocked, key=lambda t: (t[0].priority, t[0].id))
            state = (seq.id, need, self.cache.versions, len(running),
                     self.cache.base_tree.allocator.num_free)
            if state != self._failed_take:  # nothing changed since it last failed: skip
                if self._take_younger_holds(seq, need, running, waiting, sessions):
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

    def _take_younger_holds(self, seq: Sequence, need: tuple[int, int], running, waiting,
                            sessions: Sessions) -> bool:
        """Release the holds of workflows and requests younger than `seq`, youngest first,
        until its need fits, and evict what it needs now (else the holds would come back);
        True if it fits. If it cannot fit, the holds are taken again."""
        younger = sessions.holds_younger_than(seq.priority)
        younger += [(w.priority, w.hold) for w in waiting
                    if w is not seq and w.hold is not None and w.priority > seq.priority]
        younger.sort(key=lambda t: -t[0])
        for _, hold in younger:
            hold.release()
            room = self.room(running)
            if need[0] <= room[0] and need[1] <= room[1]:
                out = self._outstanding_total(running)
                self.cache.evict_unheld((need[0] + out[0], need[1] + out[1]))
                return True
        for _, hold in younger:
            hold.refresh()
        return False
