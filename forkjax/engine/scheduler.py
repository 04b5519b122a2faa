"""Continuous batching over the dual radix cache: admission by free pages, chunked prefill,
decode, preemption by recompute.

Each `schedule()` returns one batch, either an *extend* batch (prefill chunks, at most
`max_prefill_tokens` tokens) or a *decode* batch (one token per running request). When both kinds
of work wait they alternate, so a long prompt being prefilled chunk by chunk never stalls the
running requests for more than one step.

Pages: a request reserves pages for all its tokens at admission (`SeqCache.reserve`, which
evicts unlocked LRU leaves of the short pool first). A waiting request that does not fit waits;
a running request that cannot get the page for its next token preempts the most recently admitted
request (its pages go back, it is recomputed later, its tokens so far kept). A request that could
never fit fails at `add` with a clear error and nothing else changes.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from forkjax.cache import DualRadixCache, OutOfPages
from forkjax.engine.buckets import Buckets
from forkjax.engine.sequence import Sequence, Status


@dataclasses.dataclass
class ScheduledBatch:
    kind: str  # "extend" | "decode"
    seqs: list[Sequence]  # ordered by adapter slot (the LoRA matmul groups tokens by slot)
    chunks: list[tuple[int, int]]  # per seq: positions [start, end) computed this step
    base_copies: list[tuple[int, int]]  # copy-on-write page pairs to copy before the step writes
    res_copies: list[tuple[int, int]]
    samples: list[int] = dataclasses.field(default_factory=list)  # requests that sample a token


class PreemptionNeeded(RuntimeError):
    """schedule(allow_preempt=False) found no page for a running request's next token."""


class Scheduler:
    def __init__(self, cache: DualRadixCache, buckets: Buckets, *, max_batch_size: int,
                 max_prefill_tokens: int, max_model_len: int):
        self.cache = cache
        self.buckets = buckets
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._last_kind = "decode"
        self.num_preemptions = 0

    def add(self, seq: Sequence):
        """Queue a request, or raise ValueError at once if it can never be served."""
        total = len(seq.prompt) + (0 if seq.score else seq.params.max_new_tokens)
        if total > self.max_model_len:
            raise ValueError(f"prompt of {len(seq.prompt)} tokens + max_new_tokens "
                             f"{seq.params.max_new_tokens} exceeds the context of {self.max_model_len}")
        pages = -(-total // self.cache.page_size)
        # +1: a fork that lands inside a shared page copies that page.
        capacity = {"base": self.cache.base_tree.allocator.num_pages - 1}
        if self.cache.res_tree is not None and seq.adapter_key is not None:
            capacity["residual"] = self.cache.res_tree.allocator.num_pages - 1
        for pool, cap in capacity.items():
            if pages + 1 > cap:  # +1: the copy-on-write page of a fork inside a shared page
                raise ValueError(f"request needs {pages} pages of {self.cache.page_size} tokens plus one "
                                 f"spare page, but the whole {pool} pool holds {cap}: raise "
                                 f"kv_cache_bytes")
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, allow_preempt: bool = True) -> ScheduledBatch | None:
        """The next batch. `allow_preempt=False` (a step still in flight: its requests' tokens
        are not known yet) raises PreemptionNeeded instead of preempting; calling again is safe."""
        self._admit()
        prefilling = [s for s in self.running if s.in_prefill]
        decoding = [s for s in self.running if not s.in_prefill and not self._last_in_flight(s)]
        if prefilling and (not decoding or self._last_kind == "decode"):
            batch = self._extend_batch(prefilling)
        elif decoding:
            batch = self._decode_batch(decoding, allow_preempt)
        else:
            return None
        self._last_kind = batch.kind
        batch.seqs, batch.chunks = _by_slot(batch.seqs, batch.chunks)
        return batch

    def _last_in_flight(self, seq: Sequence) -> bool:
        """Its last token is already sampled by a step in flight (max_new_tokens or the context
        reached, counting pending tokens): it finishes when that step is taken in."""
        return seq.pending > 0 and (len(seq.output) + seq.pending >= seq.params.max_new_tokens
                                    or len(seq) >= self.max_model_len)

    def _admit(self):
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            h = self.cache.begin(seq.tokens, seq.adapter_key, count_hits=not seq.admitted)
            try:
                base_cow, res_cow = h.reserve(len(seq))
            except OutOfPages:
                h.release()
                if not self.running:  # nothing will ever free pages for it
                    self.waiting.popleft()
                    seq.finish("error", ValueError("request does not fit in the KV cache"))
                    continue
                return
            self.waiting.popleft()
            seq.cache, seq.status, seq.admitted = h, Status.RUNNING, True
            seq.pending_copies = (base_cow, res_cow)
            seq.num_computed = 0 if seq.score else min(h.cached_len, len(seq) - 1)
            self.running.append(seq)

    def _extend_batch(self, seqs) -> ScheduledBatch:
        chosen, chunks, budget = [], [], self.max_prefill_tokens
        for seq in seqs:
            if budget <= 0:
                break
            end = min(len(seq), seq.num_computed + budget)
            longest = max([end - seq.num_computed] + [e - s for s, e in chunks])
            if self.buckets.extend(len(chosen) + 1, longest) is None:
                break  # padding it in would exceed the compiled shapes: next step
            chosen.append(seq)
            chunks.append((seq.num_computed, end))
            budget -= end - seq.num_computed
        return self._with_copies("extend", chosen, chunks)

    def _decode_batch(self, seqs, allow_preempt: bool) -> ScheduledBatch:
        chosen = []
        for seq in seqs:
            while seq.status is Status.RUNNING:
                try:
                    base_cow, res_cow = seq.cache.reserve(len(seq))
                    seq.pending_copies = _merge(seq.pending_copies, (base_cow, res_cow))
                    chosen.append(seq)
                    break
                except OutOfPages:
                    if not allow_preempt:
                        raise PreemptionNeeded from None
                    self._preempt_one(protect=seq)
        chosen = [s for s in chosen if s.status is Status.RUNNING]
        return self._with_copies("decode", chosen, [(len(s) - 1, len(s)) for s in chosen])

    def _with_copies(self, kind, seqs, chunks) -> ScheduledBatch:
        base, res = [], []
        for seq in seqs:
            b, r = seq.pending_copies
            base += b
            res += r
            seq.pending_copies = ([], [])
        return ScheduledBatch(kind, seqs, chunks, base, res)

    def _preempt_one(self, protect: Sequence):
        """Free the most recently admitted running request (`protect` itself as a last resort)."""
        victim = next((s for s in reversed(self.running) if s is not protect), protect)
        self.running.remove(victim)
        victim.cache.release()
        victim.cache, victim.status, victim.num_computed = None, Status.WAITING, 0
        victim.pending_copies = ([], [])
        victim.prompt_logits.clear()
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, error: Exception | None = None):
        """End a request: insert its cached tokens into the trees and free its private pages."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            if error is None:
                seq.cache.commit(np.asarray(seq.tokens[: seq.num_computed], np.int32))
            seq.cache.release()
            seq.cache = None
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish(reason, error)


def _merge(a, b):
    return (a[0] + b[0], a[1] + b[1])


def _by_slot(seqs, chunks):
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
    return [seqs[i] for i in order], [chunks[i] for i in order]
