"""Random match / begin / reserve / write / commit / release / evict sequences over every policy.

A fake device (`FakePools`) records which token, written by which adapter, sits in every slot.
After each step: DualRadixCache.check() (no page leaked or freed twice, refcounts == holders,
locked nodes attached, free + evictable + protected + private == total per pool), and every live
request reads back exactly its own tokens through its page tables, with residual slots written
by its own adapter wherever the policy keys the residual (or merged base) by adapter. Under
`forkkv` requests may fan out (write other agents' residuals: tagged with the agent whose
namespace they go to), followers take over pages a request in flight inserts, and waiting
requests and sessions hold prefixes.

FORKJAX_HYPOTHESIS_SCALE=10 runs ten times more examples (the CI default keeps this under ~1 min).
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from forkjax.cache import DualRadixCache, OutOfPages

S = 4
ADAPTERS = ["a", "b", "c", None]
BANK = [np.random.default_rng(i).integers(100, 1000, 28, dtype=np.int32) for i in range(3)]
SCALE = int(os.environ.get("FORKJAX_HYPOTHESIS_SCALE", "1"))


class FakePools:
    """Host stand-in for the device pools: token id and adapter code per slot."""

    def __init__(self, base_pages: int, res_pages: int):
        self.base_tok = np.full((base_pages, S), -1)
        self.base_tag = np.full((base_pages, S), -1)
        self.res_tok = np.full((res_pages, S), -1)
        self.res_tag = np.full((res_pages, S), -1)

    def copy(self, base_pairs, res_pairs):
        for src, dst in base_pairs:
            self.base_tok[dst], self.base_tag[dst] = self.base_tok[src], self.base_tag[src]
        for src, dst in res_pairs:
            self.res_tok[dst], self.res_tag[dst] = self.res_tok[src], self.res_tag[src]

    def write(self, base_slots, res_slots, tokens, tag):
        for slots, tok, tags in ((base_slots, self.base_tok, self.base_tag), (res_slots, self.res_tok, self.res_tag)):
            w = slots != 0  # slot 0 is the sink: "do not write"
            tok.reshape(-1)[slots[w]] = tokens[w]
            tags.reshape(-1)[slots[w]] = tag


class Request:
    def __init__(self, handle, tokens, adapter):
        self.h, self.tokens, self.adapter, self.written = handle, tokens, adapter, 0


class CacheMachine(RuleBasedStateMachine):
    policy = "forkkv"

    def __init__(self):
        super().__init__()
        self.cache = DualRadixCache(self.policy, S, base_pages=40, res_pages=56)
        res_pages = self.cache.res_tree.allocator.num_pages if self.cache.res_tree else 1
        self.dev = FakePools(40, res_pages)
        self.live: list[Request] = []
        self.holds = []
        self.rng = np.random.default_rng(0)

    def tag(self, adapter) -> int:
        return ADAPTERS.index(adapter)

    def _tokens(self, data) -> np.ndarray:
        prefix = BANK[data.draw(st.integers(0, len(BANK) - 1))][: data.draw(st.integers(0, 28))]
        tail = data.draw(st.lists(st.integers(1, 4), min_size=0 if len(prefix) else 1, max_size=10))
        return np.concatenate([prefix, np.asarray(tail, np.int32)]).astype(np.int32)

    def _begin(self, tokens, adapter, fanout=()) -> Request:
        fanout = {ADAPTERS.index(a): a for a in fanout if a not in (adapter, None)}
        if self.policy != "forkkv":
            fanout = {}
        req = Request(self.cache.begin(tokens, adapter, fanout=fanout), tokens, adapter)
        if req.h.fanout:
            event("fan-out")
        if req.h.res and req.h.res_len > req.h.base_len:
            event("partial hit: residual cached, base evicted")
        if req.h.res and req.h.base_len > req.h.res_len:
            event("base hit, residual miss")
        self.live.append(req)
        return req

    def _step(self, req: Request, new_tokens: np.ndarray) -> bool:
        """Reserve and write `new_tokens` after the request's written ones; False if preempted."""
        tokens = np.concatenate([req.tokens[: req.written], new_tokens]) if req.written else req.tokens
        try:
            copies = req.h.reserve(len(tokens))
        except OutOfPages:
            event("preempted: out of pages")
            req.h.release()
            self.live.remove(req)
            return False
        self.dev.copy(*copies)
        if copies[0] or copies[1]:
            event("copy-on-write")
        start = min(req.written, req.h.cached_len)
        base_slots, res_slots = req.h.slot_mapping(start, len(tokens))
        self.dev.write(base_slots, res_slots, tokens[start:], self.tag(req.adapter))
        for slot, fan in req.h.fanout_slots(start, len(tokens)).items():
            # written from this request's x, into agent `slot`'s residual
            fan = np.asarray(fan, np.int32)
            self.dev.write(np.zeros_like(fan), fan, tokens[start:], slot)
        req.tokens, req.written = tokens, len(tokens)
        return True

    @rule(data=st.data(), adapter=st.sampled_from(ADAPTERS), commit=st.booleans(),
          fanout=st.lists(st.sampled_from(ADAPTERS), max_size=2))
    def begin_and_prefill(self, data, adapter, commit, fanout):
        tokens = self._tokens(data)
        req = self._begin(tokens, adapter, fanout)
        if self._step(req, tokens) and commit:
            req.h.commit(req.tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), adapter=st.sampled_from(ADAPTERS),
          fanout=st.lists(st.sampled_from(ADAPTERS), max_size=2))
    def follow(self, data, adapter, fanout):
        """A request begins on a running request's uncommitted tokens, which that request then
        inserts; the follower takes them over before it writes anything (in-flight sharing)."""
        leader = data.draw(st.sampled_from(self.live))
        tail = np.asarray(data.draw(st.lists(st.integers(1, 4), max_size=5)), np.int32)
        tokens = np.concatenate([leader.tokens[: leader.written], tail])
        if not len(tokens):
            return
        req = self._begin(tokens, adapter, fanout)
        leader.h.commit(leader.tokens[: leader.written])
        if req.h.extend_hits(tokens):
            event("a follower took over pages inserted in flight")
        h = req.h
        self._check_reads(tokens, adapter, h.base_page_table, h.base.cached_len, h.res_page_table,
                          h.res.cached_len if h.res else 0)
        self._step(req, tokens)

    @rule(data=st.data(), adapter=st.sampled_from(ADAPTERS))
    def hold(self, data, adapter):
        tokens = self._tokens(data)
        hold = self.cache.hold(tokens, adapter)
        assert hold.lengths == self.cache.match_lengths(tokens, adapter)
        self.holds.append(hold)

    @precondition(lambda self: self.holds)
    @rule(data=st.data(), release=st.booleans())
    def refresh_or_release_hold(self, data, release):
        hold = data.draw(st.sampled_from(self.holds))
        if release:
            hold.release()
            self.holds.remove(hold)
        elif hold.refresh():
            assert hold.lengths == self.cache.match_lengths(hold.tokens, hold.adapter_key)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), adapter=st.sampled_from(ADAPTERS))
    def fork(self, data, adapter):
        """Another adapter continues a running request's tokens from an arbitrary point."""
        parent = data.draw(st.sampled_from(self.live))
        cut = data.draw(st.integers(1, parent.written)) if parent.written else 0
        tokens = np.concatenate([parent.tokens[:cut], np.asarray([data.draw(st.integers(1, 4))], np.int32)])
        req = self._begin(tokens, adapter)
        self._step(req, tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 6))
    def decode(self, data, n):
        req = data.draw(st.sampled_from(self.live))
        self._step(req, self.rng.integers(1, 5, n, dtype=np.int32))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data):
        req = data.draw(st.sampled_from(self.live))
        req.h.commit(req.tokens[: req.written])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data, commit):
        req = data.draw(st.sampled_from(self.live))
        if commit:
            req.h.commit(req.tokens[: req.written])
        req.h.release()
        self.live.remove(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), same_adapter=st.booleans(), evict_base=st.booleans())
    def next_turn(self, data, same_adapter, evict_base):
        """A request finishes and its agent (or another) continues; its base may be evicted between."""
        prev = data.draw(st.sampled_from(self.live))
        prev.h.commit(prev.tokens[: prev.written])
        prev.h.release()
        self.live.remove(prev)
        if evict_base:
            self.cache.evict(self.cache.base_tree.evictable_size(), "base")
        adapter = prev.adapter if same_adapter else data.draw(st.sampled_from(ADAPTERS))
        tail = np.asarray(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5)), np.int32)
        tokens = np.concatenate([prev.tokens[: prev.written], tail])
        self._step(self._begin(tokens, adapter), tokens)

    @rule(pool=st.sampled_from(["base", "residual"]), n=st.integers(1, 12))
    def evict(self, pool, n):
        self.cache.evict(n, pool)

    @rule()
    def flush(self):
        self.cache.flush()
        assert self.cache.base_tree.evictable_size() == 0

    @rule(data=st.data(), adapter=st.sampled_from(ADAPTERS))
    def probe(self, data, adapter):
        tokens = self._tokens(data)
        m = self.cache.match(tokens, adapter)
        self._check_reads(tokens, adapter, m.base_pages, m.base_len, m.res_pages, m.res_len)

    def _check_reads(self, tokens, adapter, base_pages, base_len, res_pages, res_len):
        pol = self.cache.policy
        for pages, n, tok, tags, per_adapter in (
            (base_pages, base_len, self.dev.base_tok, self.dev.base_tag, pol.base_per_adapter),
            (res_pages, res_len, self.dev.res_tok, self.dev.res_tag, pol.residual == "per_adapter"),
        ):
            t = np.arange(n)
            slots = (pages[t // S], t % S)
            assert np.all(pages[: -(-n // S)] != 0), "a cached position maps to the sink"
            np.testing.assert_array_equal(tok[slots], tokens[:n], err_msg="read back another token")
            if per_adapter:
                assert np.all(tags[slots] == self.tag(adapter)), "read another adapter's entries"

    @invariant()
    def consistent(self):
        self.cache.check()
        base_room, res_room = self.cache.room()
        assert base_room <= self.cache.base_tree.allocator.num_free + self.cache.base_tree.evictable_size()
        for req in self.live:
            h = req.h
            res_len = req.written if h.res else 0
            self._check_reads(req.tokens, req.adapter, h.base_page_table, req.written, h.res_page_table, res_len)
            if h.res is None:
                assert not np.any(h.res_page_table), "a request without residual holds residual pages"


def _settings(examples: int) -> settings:
    return settings(max_examples=examples * SCALE, stateful_step_count=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class ForkKVMachine(CacheMachine):
    policy = "forkkv"


class PrefixMachine(CacheMachine):
    policy = "prefix"


class FullReuseMachine(CacheMachine):
    policy = "full_reuse"


class LRSharedMachine(CacheMachine):
    policy = "lrshared"


TestForkKV = ForkKVMachine.TestCase
TestForkKV.settings = _settings(150)
TestPrefix = PrefixMachine.TestCase
TestPrefix.settings = _settings(50)
TestFullReuse = FullReuseMachine.TestCase
TestFullReuse.settings = _settings(40)
TestLRShared = LRSharedMachine.TestCase
TestLRShared.settings = _settings(50)
