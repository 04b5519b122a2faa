"""DualRadixCache: the base tree and the residual tree over their two pools, under one policy."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from forkjax.cache.allocator import PageAllocator
from forkjax.cache.policy import SHARED, CachePolicy, get_policy
from forkjax.cache.pool import PoolLayout
from forkjax.cache.radix_tree import RadixTree, TreeNode
from forkjax.cache.seq_cache import PoolSeq, SeqCache


@dataclass
class MatchResult:
    base_len: int
    res_len: int  # 0 when the request keeps no residual
    base_pages: np.ndarray  # [ceil(base_len/S)] int32
    res_pages: np.ndarray  # [ceil(res_len/S)] int32
    base_node: TreeNode
    res_node: TreeNode | None


class DualRadixCache:
    def __init__(self, policy: str | CachePolicy, page_size: int, base_pages: int, res_pages: int,
                 base_page_bytes: int = 1, res_page_bytes: int = 1):
        """Host-side bookkeeping only (device-free); page counts include the sink page."""
        self.policy = get_policy(policy)
        self.page_size = page_size
        self.base_page_bytes, self.res_page_bytes = base_page_bytes, res_page_bytes
        self.base_tree = RadixTree(page_size, PageAllocator(base_pages))
        self.res_tree = RadixTree(page_size, PageAllocator(res_pages)) if self.policy.uses_residual else None
        self._live: set[SeqCache] = set()
        self.prompt_tokens = self.base_hit_tokens = self.residual_hit_tokens = 0

    @classmethod
    def from_layout(cls, layout: PoolLayout) -> DualRadixCache:
        return cls(layout.policy, layout.page_size, layout.base_pages, layout.res_pages,
                   layout.base_page_bytes, layout.res_page_bytes)

    def match(self, tokens, adapter_key: Hashable = None) -> MatchResult:
        """Probe both trees (no lock, no stats). Refreshes LRU recency like any access."""
        tokens = np.asarray(tokens, np.int32)
        base_len, base_pages, base_node = self.base_tree.match_prefix(self.policy.base_ns(adapter_key), tokens)
        res_ns = self.policy.res_ns(adapter_key)
        if res_ns is None:
            return MatchResult(base_len, 0, base_pages, np.zeros(0, np.int32), base_node, None)
        res_len, res_pages, res_node = self.res_tree.match_prefix(res_ns, tokens)
        return MatchResult(base_len, res_len, base_pages, res_pages, base_node, res_node)

    def begin(self, tokens, adapter_key: Hashable = None, *, count_hits: bool = True) -> SeqCache:
        """Match and lock a new request's prompt; `release()` the handle when it ends.

        The hit counters of `stats()` move when the handle's first `reserve` succeeds, and only
        with `count_hits` (the engine passes False when it re-admits a preempted request, and a
        request that waits for pages is not counted on every retry)."""
        tokens = np.asarray(tokens, np.int32)
        m = self.match(tokens, adapter_key)
        base = PoolSeq("base", self.base_tree, self.policy.base_ns(adapter_key), m.base_len, m.base_pages,
                       m.base_node)
        res = None
        if m.res_node is not None:
            res = PoolSeq("residual", self.res_tree, self.policy.res_ns(adapter_key), m.res_len, m.res_pages,
                          m.res_node)
        handle = SeqCache(self, adapter_key, len(tokens), base, res, count_hits=count_hits)
        self._live.add(handle)
        return handle

    def _count_hits(self, handle: SeqCache):
        self.prompt_tokens += handle.prompt_len
        self.base_hit_tokens += handle.base_len
        self.residual_hit_tokens += handle.res_len

    def evict(self, num_pages: int, pool: str = "base") -> int:
        """Free >= num_pages pages of one pool from its LRU unlocked leaves; returns pages freed."""
        tree = {"base": self.base_tree, "residual": self.res_tree}[pool]
        return tree.evict(num_pages) if tree is not None else 0

    def stats(self) -> dict:
        """DESIGN.md §3 cache keys (the engine adds decode_batch_size_mean) plus accounting extras.

        agent_bytes[adapter]: bytes only that adapter can read (its namespaces in either tree plus
        its running requests' private pages); shared_bytes: bytes in SHARED namespaces. Together
        they add up to base_bytes_used + residual_bytes_used.
        """
        base_alloc = self.base_tree.allocator
        res_used = self.res_tree.allocator.num_used if self.res_tree else 0
        agent_bytes: dict[Hashable, int] = {}
        shared = 0
        for tree, page_bytes in ((self.base_tree, self.base_page_bytes), (self.res_tree, self.res_page_bytes)):
            if tree is None:
                continue
            for ns, pages in tree.ns_pages.items():
                if ns is SHARED:
                    shared += pages * page_bytes
                elif pages:
                    agent_bytes[ns] = agent_bytes.get(ns, 0) + pages * page_bytes
        for h in self._live:
            own = len(h.base.private_pages) * self.base_page_bytes
            own += len(h.res.private_pages) * self.res_page_bytes if h.res else 0
            if own:
                agent_bytes[h.adapter_key] = agent_bytes.get(h.adapter_key, 0) + own
        return {
            "base_pages_total": base_alloc.num_usable,
            "base_pages_used": base_alloc.num_used,
            "residual_pages_total": self.res_tree.allocator.num_usable if self.res_tree else 0,
            "residual_pages_used": res_used,
            "base_bytes_used": base_alloc.num_used * self.base_page_bytes,
            "residual_bytes_used": res_used * self.res_page_bytes,
            "prompt_tokens": self.prompt_tokens,
            "base_hit_tokens": self.base_hit_tokens,
            "residual_hit_tokens": self.residual_hit_tokens,
            "base_pages_evictable": self.base_tree.evictable_size(),
            "base_pages_protected": self.base_tree.protected_size(),
            "residual_pages_evictable": self.res_tree.evictable_size() if self.res_tree else 0,
            "residual_pages_protected": self.res_tree.protected_size() if self.res_tree else 0,
            "shared_bytes": shared,
            "agent_bytes": agent_bytes,
        }

    def check(self) -> None:
        """Assert every invariant of both pools (tests call this after each operation)."""
        for name, tree in (("base", self.base_tree), ("residual", self.res_tree)):
            if tree is None:
                continue
            alloc = tree.allocator
            alloc.check()
            holders = tree.check()
            private = 0
            for h in self._live:
                seq = h.base if name == "base" else h.res
                if seq is None:
                    continue
                locked = seq.node.parent is None or seq.node.lock_ref > 0  # a root needs no lock
                assert locked and tree.is_attached(seq.node), f"{name}: a locked node is gone"
                np.add.at(holders, seq.private_pages, 1)
                private += len(seq.private_pages)
            bad = np.flatnonzero(holders != alloc.refcount)
            assert bad.size == 0, f"{name}: refcount != holders at pages {bad.tolist()}"
            total = alloc.num_free + tree.evictable_size() + tree.protected_size() + private
            assert total == alloc.num_usable, f"{name}: free+evictable+protected+private={total} != {alloc.num_usable}"
