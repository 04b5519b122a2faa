"""Continuous batching over the dual radix cache: cache-aware admission, chunked prefill with
in-flight prefix sharing, decode, preemption by recompute.

Each `schedule()` returns one batch, either an *extend* batch (prefill chunks, at most
`max_prefill_tokens` tokens) or a *decode* batch (one token per running request). When both kinds
of work wait they alternate, so a long prompt being prefilled chunk by chunk never stalls the
running requests for more than one step.

Admission (admission.py) decides who runs; pages are reserved chunk by chunk as a request computes
(`SeqCache.reserve`, evicting unheld LRU leaves first), and a prefill chunk's whole pages enter
the trees when its step is done (output processing, output_processor.py's mixin), so requests
admitted together share what the first of them computes (inflight.py). A running request that
cannot get a page preempts the one of the youngest workflow, which is suspended (its pages go back,
it is recomputed later, its tokens so far kept).
A request that could never fit fails at `add` with a clear error and nothing else changes.

The scheduler alone writes a request's state (`Sequence`); a batch leaves it as plain data
(batch.py) whose rows carry the page tables and write slots the model runner needs; a decode
batch carries only the rows that changed since the model runner last saw them (batch_rows.py).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import numpy as np

from forkjax.cache import DualRadixCache, OutOfPages
from forkjax.engine.admission import Admission
from forkjax.engine.batch_rows import decode_rows, full_row
from forkjax.engine.inflight import InflightPages, pool_namespaces
from forkjax.engine.output_processor import SchedulerOutputProcessorMixin
from forkjax.engine.sequence import Sequence, Status
from forkjax.engine.sessions import SESSION_TTL_S, Sessions
from forkjax.lora.slots import AdapterSlots
from forkjax.runtime.batch import ScheduledBatch
from forkjax.runtime.buckets import Buckets

log = logging.getLogger("forkjax")


class PreemptionNeeded(RuntimeError):
    """schedule(allow_preempt=False) found no page for a running request: the requests of the
    step in flight must be known first."""


class Scheduler(SchedulerOutputProcessorMixin):
    def __init__(self, cache: DualRadixCache, buckets: Buckets, slots: AdapterSlots, *,
                 max_batch_size: int, max_prefill_tokens: int, max_model_len: int,
                 schedule_policy: str = "lpm", max_wait_s: float = 60.0,
                 session_ttl_s: float = SESSION_TTL_S, clock: Callable[[], float] = time.monotonic):
        """`slots`: the adapters and their device slots, which a request takes when it starts
        (the engine writes the weights: `take_slot_writes`); `clock`: seconds for arrivals,
        waits and session idle times (a replay passes a virtual one)."""
        self.cache = cache
        self.slots = slots
        self._slot_writes: list = []
        self.clock = clock
        self.buckets = buckets
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.inflight = InflightPages(cache.page_size)
        self.sessions = Sessions(cache, ttl_s=session_ttl_s, clock=clock,
                                 max_tokens=max_model_len, num_agents=lambda: max(
                                     1, min(len(slots.by_name), slots.num_slots - 1)))
        self.admission = Admission(cache, self.inflight, self.sessions, schedule_policy,
                                   max_wait_s, clock, in_slots=lambda seq: slots.in_slots(
                                       [seq.adapter, *seq.targets.values()]))
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._last_kind = "decode"
        # per running request: the cache versions when it last took over others' pages, and
        # the copy-on-write (src, dst) page pairs (base, residual) to run before it writes
        self._seen: dict[int, tuple] = {}
        self._copies: dict[int, tuple[list, list]] = {}
        # ids of the last decode batch's requests whose rows the model runner holds as they are
        # (batch_rows.py); persistent_rows=False sends every row whole every step
        self._fresh: set[int] = set()
        self.persistent_rows = True
        self.num_preemptions = 0
        self.prefill_tokens_computed = 0
        self.workflows_running_peak = 0  # most sessions with a request running at once

    def add(self, seq: Sequence):
        """Queue a request, or raise ValueError at once if it can never be served."""
        total = len(seq.prompt) + (0 if seq.score else seq.params.max_new_tokens)
        if total > self.max_model_len:
            raise ValueError(f"prompt of {len(seq.prompt)} tokens + max_new_tokens "
                             f"{seq.params.max_new_tokens} exceeds the context of {self.max_model_len}")
        self.admission.check_capacity(seq, total)
        seq.arrival = seq.priority = self.clock()
        seq.key_ns = pool_namespaces(self.cache.policy, seq)
        if seq.session_id is not None:
            seq.priority = self.sessions.added(seq).start
        self._wait(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, allow_preempt: bool = True) -> ScheduledBatch | None:
        """The next batch. `allow_preempt=False` (a step still in flight: its requests' tokens
        are not known yet) raises PreemptionNeeded instead of preempting; calling again is safe."""
        self.sessions.expire()
        self.sessions.prefetch()
        self.admission.admit(self.waiting, self.running, self.max_batch_size, self._start)
        workflows = len({s.session_id for s in self.running if s.session_id is not None})
        self.workflows_running_peak = max(self.workflows_running_peak, workflows)
        prefilling = [s for s in self.running if s.in_prefill]
        decoding = [s for s in self.running if not s.in_prefill and not self._last_in_flight(s)]
        batch = None
        if prefilling and (not decoding or self._last_kind == "decode"):
            batch = self._extend_batch(prefilling, allow_preempt)
        if batch is None and decoding:
            batch = self._decode_batch(decoding, allow_preempt)
        if batch is None:
            return None
        self._last_kind = batch.kind
        batch.seqs, batch.chunks = _by_slot(batch.seqs, batch.chunks)
        if batch.kind == "decode":
            batch.rows, batch.decode = decode_rows(batch.seqs, self._fresh)
            self._fresh = {s.id for s in batch.seqs} if self.persistent_rows else set()
        else:
            batch.rows = [full_row(seq, start, end) for seq, (start, end) in zip(batch.seqs, batch.chunks)]
        return batch

    def _last_in_flight(self, seq: Sequence) -> bool:
        """Its last token is already sampled by a step in flight (max_new_tokens or the context
        reached, counting pending tokens): it finishes when that step is taken in."""
        return seq.pending > 0 and (len(seq.output) + seq.pending >= seq.params.max_new_tokens
                                    or len(seq) >= self.max_model_len)

    # ---- admission ------------------------------------------------------------------------

    def _wait(self, seq: Sequence, front: bool = False):
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self.admission.on_wait(seq)

    def busy_adapters(self) -> set:
        """Names of the adapters running requests use (their own and their fan-out targets')."""
        return {n for s in self.running for n in (s.adapter, *s.targets.values()) if n is not None}

    def take_slot_writes(self) -> list:
        """The (slot, adapter) writes the requests started since the last call need."""
        writes, self._slot_writes = self._slot_writes, []
        return writes

    def _start(self, seq: Sequence) -> bool:
        """Start `seq` if its adapters (its own, its fan-out targets) can take device slots."""
        writes = self.slots.acquire([seq.adapter, *seq.targets.values()], self.busy_adapters)
        if writes is None:
            return False
        self._slot_writes += writes
        seq.slot = self.slots.slot_of(seq.adapter)
        seq.fanout = {self.slots.slot_of(name): key for key, name in seq.targets.items()}
        self.waiting.remove(seq)
        self.admission.on_leave(seq)
        first = seq.first_admitted is None  # a preempted request's hits are not recounted
        h = self.cache.begin(seq.tokens, seq.adapter_key, count_hits=first, fanout=seq.fanout,
                             reuse=seq.reuse_cache)
        if first:
            seq.first_admitted = self.clock()
        seq.cache, seq.status = h, Status.RUNNING
        seq.num_computed = min(h.cached_len, seq.score_from if seq.score else len(seq) - 1)
        if first:
            seq.num_cached = min(seq.num_computed, len(seq.prompt))
        self._copies[seq.id] = ([], [])
        if seq.reuse_cache:
            self.inflight.register(seq, seq.num_computed, len(seq.prompt))
        self.running.append(seq)
        return True

    # ---- in-flight sharing (inflight.py) ---------------------------------------------------

    def _catch_up(self, seq: Sequence):
        """Take over pages others inserted since this request last looked (a score request
        computes, and keeps the logits of, every position)."""
        if seq.score or not seq.reuse_cache or self._seen.get(seq.id) == self.cache.versions:
            return
        self._seen[seq.id] = self.cache.versions
        if seq.cache.extend_hits(seq.tokens):
            before = seq.num_computed
            seq.num_computed = max(before, min(seq.cache.cached_len, len(seq) - 1))
            if seq.cache.counts_hits:  # not a preempted request's second run
                n = len(seq.prompt)
                seq.num_cached += min(seq.num_computed, n) - min(before, n)
        self._forget_dropped_fanout(seq)

    def drop_fanout(self, seq: Sequence, slots):
        """Stop `seq` writing the fan-out residuals of adapter `slots` (they turned non-finite):
        what it wrote for them and has not inserted is freed, never inserted."""
        for slot in slots:
            log.warning("request %d: adapter %r's fan-out residuals computed from its "
                        "hidden states are not finite; not cached", seq.id, seq.fanout.get(slot))
            seq.cache.drop_fanout(slot)
        self._forget_dropped_fanout(seq)

    def _forget_dropped_fanout(self, seq: Sequence):
        """Fan-out pools the cache dropped: their pages will not come from this request."""
        dropped = [slot for slot in seq.fanout if slot not in seq.cache.fanout]
        for slot in dropped:
            key = seq.fanout.pop(slot)
            del seq.targets[key]
            self.inflight.forget(seq.id, ("res", self.cache.policy.res_ns(key)))
        if dropped:
            seq.key_ns = pool_namespaces(self.cache.policy, seq)

    # ---- batches --------------------------------------------------------------------------

    def _extend_batch(self, seqs, allow_preempt: bool) -> ScheduledBatch | None:
        chosen, chunks, budget = [], [], self.max_prefill_tokens
        piece = self.buckets.piece
        for seq in seqs:
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted by an earlier request's reservation in this loop
            self._catch_up(seq)
            if not seq.in_prefill:
                continue  # now a full hit: its last token is computed by a decode step
            start = seq.num_computed
            end = min(len(seq), start + budget)
            # a score request computes every position (it keeps their logits), and one that reuses
            # no cache takes no one's pages (_preempt_one): neither waits for another's chunk
            if not seq.score and seq.reuse_cache:
                end = self.inflight.wait_point(seq, start, end)
            if end <= start:
                continue  # waits for another request's chunk
            # A chunk goes as consecutive pieces (buckets.py), one row each: a piece attends to
            # the earlier ones' K/V, which every layer writes before it attends. Pieces that
            # would exceed the compiled shapes wait a step.
            pieces = [(p, min(p + piece, end)) for p in range(start, end, piece)]
            while pieces and self.buckets.extend(
                    len(chunks) + len(pieces), max(e - s for s, e in chunks + pieces)) is None:
                pieces.pop()
            if not pieces:
                break
            end = pieces[-1][1]
            if not self._reserve(seq, end, allow_preempt):
                continue
            if seq.reuse_cache:  # a leader that left: this one leads now
                self.inflight.register(seq, start, end)
            chosen += [seq] * len(pieces)
            chunks += pieces
            budget -= end - start
        kept = [(s, c) for s, c in zip(chosen, chunks) if s.status is Status.RUNNING]
        if not kept:
            return None
        if len({s for s, _ in kept}) == 1 and self.buckets.extend(1, kept[-1][1][1] - kept[0][1][0]):
            # a request alone in its step goes as one row: the residual extend kernel rebuilds
            # its merged K/V once, not once per piece
            kept = [(kept[0][0], (kept[0][1][0], kept[-1][1][1]))]
        self.prefill_tokens_computed += sum(e - s for _, (s, e) in kept)
        return self._with_copies("extend", *map(list, zip(*kept)))

    def _decode_batch(self, seqs, allow_preempt: bool) -> ScheduledBatch | None:
        # most steps reserve nothing: a page lasts page_size steps (a request preempted by an
        # earlier one's reservation has no cache left)
        chosen = [seq for seq in seqs if seq.cache is not None and len(seq) <= seq.cache.writable
                  or self._reserve(seq, len(seq), allow_preempt)]
        chosen = [s for s in chosen if s.status is Status.RUNNING]
        if not chosen:
            return None
        return self._with_copies("decode", chosen, [(len(s) - 1, len(s)) for s in chosen])

    def _reserve(self, seq: Sequence, num_tokens: int, allow_preempt: bool) -> bool:
        """Pages for the request's positions [0, num_tokens), preempting others (the request
        itself as a last resort) when the pools run out. False if it was preempted."""
        while seq.status is Status.RUNNING:
            try:
                self._fresh.discard(seq.id)  # its page tables may change
                copies = seq.cache.reserve(num_tokens)
                self._copies[seq.id] = _merge(self._copies[seq.id], copies)
                self._forget_dropped_fanout(seq)
                return True
            except OutOfPages:
                if not allow_preempt:
                    raise PreemptionNeeded from None
                self._preempt_one(protect=seq)
        return False

    def _with_copies(self, kind, seqs, chunks) -> ScheduledBatch:
        base, res = [], []
        for seq in seqs:
            b, r = self._copies[seq.id]
            base += b
            res += r
            self._copies[seq.id] = ([], [])
        return ScheduledBatch(kind, seqs, chunks, base, res, host_copies=self.cache.take_host_copies())

    def _preempt_one(self, protect: Sequence):
        """Free the running request of the youngest workflow (admission.py: the older workflow
        wins), `protect` itself as a last resort; that workflow is suspended whole."""
        others = [s for s in self.running if s is not protect]
        victim = max(others, key=lambda s: (s.priority, s.id)) if others else protect
        if not others and protect.reuse_cache:
            # alone, with a prompt that fits the pool (Admission.check_capacity): its cached path
            # took more pages than its tokens (DualRadixCache.begin); it goes again without it
            log.debug("request %d found no pages alone: it runs again without its cached prefix",
                      protect.id)
            protect.reuse_cache = False
        session = self.sessions.of(victim)
        if session is not None and session is not self.sessions.of(protect):
            self.admission.suspend(session, self.waiting)
        self.running.remove(victim)
        self._release(victim)
        victim.status, victim.num_computed, victim.num_verified = Status.WAITING, 0, 0
        victim.prompt_logits.clear()
        victim.prompt_hidden.clear()
        self._wait(victim, front=True)
        self.num_preemptions += 1

    def _release(self, seq: Sequence):
        self._fresh.discard(seq.id)
        seq.cache.release()
        seq.cache = None
        self._copies.pop(seq.id, None)
        self._seen.pop(seq.id, None)
        self.inflight.release(seq.id)

    # ---- chunk insertion and finish -------------------------------------------------------

    def chunk_done(self, seq: Sequence, end: int):
        """A prefill chunk up to position `end` is computed: its whole pages enter the trees
        (those of a request that reuses no cache only when it ends: it keeps its own pages)."""
        if seq.status is not Status.RUNNING or not seq.reuse_cache:
            return
        seq.cache.commit(np.asarray(seq.tokens[:end], np.int32))
        self.inflight.inserted(seq.id, end // self.cache.page_size)

    def finish(self, seq: Sequence, reason: str, error: Exception | None = None):
        """End a request: insert its verified tokens into the trees (none after an error) and
        free its private pages."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            tokens = np.asarray(seq.tokens[: seq.num_verified], np.int32)
            if error is None:
                seq.cache.commit(tokens)
            self._release(seq)
            if seq.session_id is not None:
                self.sessions.ended(seq, tokens if error is None else None)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.admission.on_leave(seq)
            self.inflight.release(seq.id)
            if seq.session_id is not None:
                self.sessions.ended(seq)
        seq.finish(reason, error)


def _merge(a, b):
    return (a[0] + b[0], a[1] + b[1])


def _by_slot(seqs, chunks):
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
    return [seqs[i] for i in order], [chunks[i] for i in order]

