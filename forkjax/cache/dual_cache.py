"""DualRadixCache: the base tree and the residual tree over their two pools, under one policy."""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from forkjax.cache.allocator import PageAllocator
from forkjax.cache.hold import PrefixHold
from forkjax.cache.host_pool import HostBudget, HostPagePool
from forkjax.cache.policy import EXACT, SHARED, Activated, CachePolicy, get_policy, key_tokens, unsalted
from forkjax.cache.pool import PoolLayout
from forkjax.cache.radix_tree import RadixTree
from forkjax.cache.seq_cache import PoolSeq, SeqCache
from forkjax.cache.tree_node import TreeNode


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
                 base_page_bytes: int = 1, res_page_bytes: int = 1, host_kv_bytes: int = 0):
        """Host-side bookkeeping only (device-free); page counts include the sink page.
        `host_kv_bytes` > 0: both trees write evicted pages back to host pools sharing that
        budget (the runtime runs their copies, `take_host_copies`, before the next step)."""
        self.policy = get_policy(policy)
        self.page_size = page_size
        self.base_page_bytes, self.res_page_bytes = base_page_bytes, res_page_bytes
        self.base_tree = RadixTree(page_size, PageAllocator(base_pages))
        self.res_tree = RadixTree(page_size, PageAllocator(res_pages)) if self.policy.uses_residual else None
        self._live: set[SeqCache] = set()
        self.prompt_tokens = self.base_hit_tokens = self.residual_hit_tokens = 0
        self.host_hit_tokens = 0  # of the base hits, tokens loaded from the host tier
        self.host_budget = HostBudget(host_kv_bytes) if host_kv_bytes else None
        self.host_pools: tuple[HostPagePool | None, HostPagePool | None] = (None, None)
        if self.host_budget is not None:
            self.host_pools = tuple(
                None if tree is None else HostPagePool(page_bytes, self.host_budget, device_pages=pages)
                for tree, page_bytes, pages in ((self.base_tree, base_page_bytes, base_pages),
                                                (self.res_tree, res_page_bytes, res_pages)))
            for tree, host in zip((self.base_tree, self.res_tree), self.host_pools):
                if tree is not None:
                    tree.attach_host(host)

    @classmethod
    def from_layout(cls, layout: PoolLayout, host_kv_bytes: int = 0) -> DualRadixCache:
        return cls(layout.policy, layout.page_size, layout.base_pages, layout.res_pages,
                   layout.base_page_bytes, layout.res_page_bytes, host_kv_bytes)

    def match(self, tokens, adapter_key: Hashable = None) -> MatchResult:
        """Probe both trees (no lock, no stats). Refreshes LRU recency like any access."""
        return self._match(key_tokens(tokens, adapter_key), adapter_key)

    def _match(self, tokens: np.ndarray, adapter_key: Hashable) -> MatchResult:
        """`match` of tokens already keyed (`key_tokens`)."""
        base_len, base_pages, base_node = self.base_tree.match_prefix(self.policy.base_ns(adapter_key), tokens)
        res_ns = self.policy.res_ns(adapter_key)
        if res_ns is None:
            return MatchResult(base_len, 0, base_pages, np.zeros(0, np.int32), base_node, None)
        res_len, res_pages, res_node = self.res_tree.match_prefix(res_ns, tokens)
        return MatchResult(base_len, res_len, base_pages, res_pages, base_node, res_node)

    def begin(self, tokens, adapter_key: Hashable = None, *, count_hits: bool = True,
              fanout: dict[int, Hashable] | None = None, reuse: bool = True) -> SeqCache:
        """Match and lock a new request's prompt; `release()` the handle when it ends.

        The hit counters of `stats()` move when the handle's first `reserve` succeeds, and only
        with `count_hits` (the engine passes False when it re-admits a preempted request).
        `fanout` {adapter slot: adapter key}: the agents whose residuals this request also
        writes (`forkkv` only: their residual namespaces must differ from its own).
        `reuse=False`: no hit, every page its own. A cached path can take more pages than its
        tokens (a fork inside a page whose writer inserted its own copy of that page starts a
        node with a page of its own): a request that needs nearly the whole pool may then fit
        only without it."""
        tokens = key_tokens(tokens, adapter_key)
        if fanout and isinstance(unsalted(adapter_key), Activated):
            raise ValueError(f"residual fan-out from {adapter_key!r}, an Activated LoRA request")
        if reuse:
            self._prefetch(tokens, adapter_key, list((fanout or {}).values()))
            m = self._match(tokens, adapter_key)
        else:
            res_ns, none = self.policy.res_ns(adapter_key), np.zeros(0, np.int32)
            m = MatchResult(0, 0, none, none.copy(), self.base_tree.root(self.policy.base_ns(adapter_key)),
                            None if res_ns is None else self.res_tree.root(res_ns))
        base = PoolSeq("base", self.base_tree, self.policy.base_ns(adapter_key), m.base_len, m.base_pages,
                       m.base_node)
        res = None
        if m.res_node is not None:
            res = PoolSeq("residual", self.res_tree, self.policy.res_ns(adapter_key), m.res_len, m.res_pages,
                          m.res_node)
        pools = {}
        for slot, key in (fanout or {}).items():
            ns = self.policy.res_ns(key)
            if ns is None or ns == self.policy.res_ns(adapter_key) or self.policy.residual != "per_adapter":
                raise ValueError(f"residual fan-out to {key!r} needs the forkkv policy and another agent")
            length, pages, node = (self.res_tree.match_prefix(ns, tokens) if reuse
                                   else (0, np.zeros(0, np.int32), self.res_tree.root(ns)))
            pools[slot] = PoolSeq("residual", self.res_tree, ns, length, pages, node)
        handle = SeqCache(self, adapter_key, len(tokens), base, res, count_hits=count_hits, fanout=pools)
        self._live.add(handle)
        return handle

    def prefetch(self, tokens, adapter_key: Hashable = None, fanout_keys=()) -> None:
        """Bring the host nodes that extend the match of `tokens` back to the device, in each
        namespace a request of `adapter_key` (writing `fanout_keys`' residuals) reads, into free
        or evictable pages, held ones last (a request's start, or a session about to run)."""
        if self.host_budget is not None:
            self._prefetch(key_tokens(tokens, adapter_key), adapter_key, fanout_keys)

    def _prefetch(self, tokens: np.ndarray, adapter_key: Hashable, fanout_keys) -> None:
        """`prefetch` of tokens already keyed (`key_tokens`)."""
        if self.host_budget is None:
            return
        spaces = [(self.base_tree, self.policy.base_ns(adapter_key))]
        if self.res_tree is not None:
            spaces += [(self.res_tree, ns) for ns in
                       [self.policy.res_ns(adapter_key), *map(self.policy.res_ns, fanout_keys)]
                       if ns is not None]
        for tree, ns in spaces:
            length, _, node = tree.match_prefix(ns, tokens)
            nodes = tree.host_continuation(node, tokens)
            if nodes and tree.load(nodes) and tree is self.base_tree:
                self.host_hit_tokens += tree.match_prefix(ns, tokens)[0] - length

    def match_all(self, tokens, adapter_key: Hashable = None, fanout_keys=()) -> list:
        """[(tree, cached length, last node)] for the base namespace, the request's own residual
        one (if it keeps a residual) and each fan-out agent's residual one."""
        tokens = key_tokens(tokens, adapter_key)
        m = self._match(tokens, adapter_key)
        out = [(self.base_tree, m.base_len, m.base_node)]
        if m.res_node is not None:
            out.append((self.res_tree, m.res_len, m.res_node))
        for key in fanout_keys:
            length, _, node = self.res_tree.match_prefix(self.policy.res_ns(key), tokens)
            out.append((self.res_tree, length, node))
        return out

    def retire(self, tokens, adapter_key: Hashable = None, fanout_keys=(), beyond: int = 0,
               drop: bool = False) -> None:
        """Nothing will ask for the paths of `tokens` again (from token `beyond` on), in any
        namespace a request of `adapter_key` (writing `fanout_keys`' residuals) reads
        (`RadixTree.retire`; `drop`: freed now where no one else holds them)."""
        for tree, _, node in self.match_all(tokens, adapter_key, fanout_keys):
            tree.retire(node, beyond, drop)

    def match_lengths(self, tokens, adapter_key: Hashable = None, fanout_keys=()) -> list[int]:
        return [length for _, length, _ in self.match_all(tokens, adapter_key, fanout_keys)]

    def hold(self, tokens, adapter_key: Hashable = None, fanout_keys=()) -> PrefixHold:
        """A soft lock on the cached prefix of `tokens` (hold.py); `release()` it."""
        return PrefixHold(self, tokens, adapter_key, fanout_keys)

    @property
    def versions(self) -> tuple[int, int]:
        """Changes whenever a match could find something else."""
        return self.base_tree.version, self.res_tree.version if self.res_tree else 0

    def room(self) -> tuple[int, int]:
        """(base, residual) pages that admission may give out: free ones and unheld evictable
        ones; with a host tier held ones too (evicting them costs a copy to the host, and a
        copy back when their holder runs, not a recompute)."""
        held = self.host_budget is not None

        def pages(tree):
            return tree.allocator.num_free + tree.evictable_size(held=held) if tree else 0
        return pages(self.base_tree), pages(self.res_tree)

    def evict_unheld(self, pages: tuple[int, int]) -> None:
        """Make (base, residual) pages free now, from unheld LRU leaves only."""
        for tree, n in ((self.base_tree, pages[0]), (self.res_tree, pages[1])):
            if tree is not None and n > tree.allocator.num_free:
                tree.evict(n - tree.allocator.num_free, held=False)

    def _count_hits(self, handle: SeqCache):
        self.prompt_tokens += handle.prompt_len
        self.base_hit_tokens += handle.base_len
        self.residual_hit_tokens += handle.res_len

    def _count_extra(self, base: int, res: int):
        """Hits a running request gained from pages others inserted while it waited."""
        self.base_hit_tokens += base
        self.residual_hit_tokens += res

    def reset_stats(self) -> None:
        self.prompt_tokens = self.base_hit_tokens = self.residual_hit_tokens = 0
        self.host_hit_tokens = 0
        for host in self.host_pools:
            if host is not None:
                host.bytes_stored = host.bytes_loaded = 0
        for tree in (self.base_tree, self.res_tree):
            if tree is not None:
                tree.evicted_pages = 0

    def evict(self, num_pages: int, pool: str = "base") -> int:
        """Free >= num_pages pages of one pool from its LRU unlocked leaves, unheld ones first;
        returns pages freed."""
        tree = {"base": self.base_tree, "residual": self.res_tree}[pool]
        return tree.evict(num_pages) if tree is not None else 0

    def flush(self) -> int:
        """Evict every unlocked page of both trees (held ones too) and empty the host tier;
        returns the device pages freed."""
        freed = 0
        for tree in (self.base_tree, self.res_tree):
            if tree is not None:
                freed += tree.evict(tree.evictable_size(), drop=True)
                if tree.host is not None:
                    tree.drop_host()
        return freed

    def stats(self) -> dict:
        """The cache keys of docs/design.md, Public contracts (the engine adds
        decode_batch_size_mean), plus accounting extras.

        agent_bytes[adapter]: bytes only that adapter can read (its namespaces in either tree plus
        its running requests' private pages); shared_bytes: bytes in SHARED and EXACT namespaces. Together
        they add up to base_bytes_used + residual_bytes_used. Salts are summed over.
        """
        base_alloc = self.base_tree.allocator
        res_used = self.res_tree.allocator.num_used if self.res_tree else 0
        agent_bytes: collections.Counter[Hashable] = collections.Counter()
        shared = 0
        for tree, page_bytes in ((self.base_tree, self.base_page_bytes), (self.res_tree, self.res_page_bytes)):
            if tree is None:
                continue
            for ns, pages in tree.ns_pages.items():
                if unsalted(ns) in (SHARED, EXACT):
                    shared += pages * page_bytes
                elif pages:
                    agent_bytes[unsalted(ns)] += pages * page_bytes
        for h in self._live:
            own = len(h.base.private_pages) * self.base_page_bytes
            own += len(h.res.private_pages) * self.res_page_bytes if h.res else 0
            if own:
                agent_bytes[unsalted(h.adapter_key)] += own
            for pool in h.fanout.values():  # another agent's residual, written by this request
                if len(pool.private_pages):
                    agent_bytes[unsalted(pool.ns)] += len(pool.private_pages) * self.res_page_bytes
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
            "evicted_base_pages": self.base_tree.evicted_pages,
            "evicted_residual_pages": self.res_tree.evicted_pages if self.res_tree else 0,
            "base_pages_evictable": self.base_tree.evictable_size(),
            "base_pages_protected": self.base_tree.protected_size(),
            "residual_pages_evictable": self.res_tree.evictable_size() if self.res_tree else 0,
            "residual_pages_protected": self.res_tree.protected_size() if self.res_tree else 0,
            "shared_bytes": shared,
            "agent_bytes": dict(agent_bytes),
            **self._host_stats(),
        }

    def _host_stats(self) -> dict:
        hosts = [h for h in self.host_pools if h is not None]
        return {
            "host_hit_tokens": self.host_hit_tokens,
            "host_bytes_used": self.host_budget.used if self.host_budget else 0,
            "host_bytes_total": self.host_budget.capacity if self.host_budget else 0,
            "host_bytes_stored": sum(h.bytes_stored for h in hosts),
            "host_bytes_loaded": sum(h.bytes_loaded for h in hosts),
        }

    def take_host_copies(self) -> tuple[list, list]:
        """The host tier's queued copies (base pool's, residual pool's; host_pool.py), for the
        runtime to run before the next step."""
        return tuple(h.take_copies() if h is not None else [] for h in self.host_pools)

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
                for seq in ([h.base] if name == "base" else h.pools[1:]):
                    locked = seq.node.parent is None or seq.node.lock_ref > 0  # a root needs no lock
                    assert locked and tree.is_attached(seq.node), f"{name}: a locked node is gone"
                    np.add.at(holders, seq.private_pages, 1)
                    private += len(seq.private_pages)
            bad = np.flatnonzero(holders != alloc.refcount)
            assert bad.size == 0, f"{name}: refcount != holders at pages {bad.tolist()}"
            total = alloc.num_free + tree.evictable_size() + tree.protected_size() + private
            assert total == alloc.num_usable, f"{name}: free+evictable+protected+private={total} != {alloc.num_usable}"
