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

`fifo` (the engine's earlier policy, kept for comparison): arrival order, the head of the queue
blocks the rest, a request needs its prompt's pages beyond its hits, nothing is held.

With nothing running, a candidate that fits in the whole pool is always admitted: holds never
deadlock the engine.
"""

from __future__ import annotations

import time

from forkjax.cache import DualRadixCache
from forkjax.engine.sequence import Sequence

# Generated tokens a request is assumed to need pages for (SGLang's CLIP_MAX_NEW_TOKENS): a
# request asking for the whole context must not hold the pool up front.
DECODE_CLIP = 4096


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class Admission:
    def __init__(self, cache: DualRadixCache, policy: str = "lpm", max_wait_s: float = 60.0):
        """policy: "lpm" | "fifo" (checked by EngineConfig)."""
        self.cache, self.policy, self.max_wait_s = cache, policy, max_wait_s
        self.S = cache.page_size

    @property
    def holds(self) -> bool:
        return self.policy == "lpm"

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

    def order(self, waiting, inflight_pages) -> list[Sequence]:
        """Waiting requests in the order admission tries them. inflight_pages(seq, pool index,
        first page) -> pages from there on that another running request will insert."""
        if self.policy == "fifo":
            return list(waiting)
        urgent, rest = [], []
        for seq in waiting:
            if self.is_urgent(seq):
                urgent.append(seq)
                continue
            lens = self.hits(seq)
            reuse = [max(n, (n // self.S + inflight_pages(seq, i, n // self.S)) * self.S)
                     for i, n in enumerate(lens)]
            rest.append((-min(reuse), -reuse[0], seq.arrival, seq.id, seq))
        rest.sort(key=lambda t: t[:4])
        return sorted(urgent, key=lambda s: (s.arrival, s.id)) + [t[-1] for t in rest]

    def is_urgent(self, seq: Sequence) -> bool:
        return self.policy == "fifo" or time.monotonic() - seq.arrival >= self.max_wait_s

    def need(self, seq: Sequence, inflight_pages) -> tuple[int, int]:
        """(base, residual) pages a waiting request would allocate itself."""
        target = _pages(self.target_len(seq), self.S)
        need = []
        for i, n in enumerate(self.hits(seq)):
            # a hit ending inside a page borrows that page, and copies it to write past n
            need.append(max(0, target - n // self.S - inflight_pages(seq, i, n // self.S)))
        return need[0], sum(need[1:])
