"""One running request's view of the cache: its page tables, private pages and locks.

Per pool (`PoolSeq`) a request's page table has three parts:

    [0, own_from)          borrowed from the tree (read-only; kept alive by the lock on `node`)
    [own_from, len)        private: allocated for this request, refcount 1, written by it only
    positions < cached_len are never written by this request (cache hits, or already inserted)

If the cached prefix ends inside a page, that page is shared and partly filled with tokens this
request agrees with; the first `reserve` that needs to write past it copies it (copy-on-write)
and returns the (src, dst) pair for the engine to copy on device before the step writes.

Pages are reserved chunk by chunk, as the engine computes them; until a pool holds a private page,
`extend_hit` takes over what the tree gained past its hit meanwhile (another request in flight
inserted the pages this one waited for).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from forkjax.cache.policy import key_tokens
from forkjax.cache.radix_tree import RadixTree
from forkjax.cache.tree_node import TreeNode


class OutOfPages(RuntimeError):
    """Not enough free or evictable pages; the engine should preempt a request and retry."""

    def __init__(self, pool: str, needed: int, free: int):
        super().__init__(f"{pool} pool: need {needed} pages, {free} free after evicting every unlocked leaf")
        self.pool, self.needed, self.free = pool, needed, free


class PoolSeq:
    def __init__(self, name: str, tree: RadixTree, ns: Hashable, hit_len: int, hit_pages: np.ndarray,
                 node: TreeNode):
        self.name, self.tree, self.ns = name, tree, ns
        self.page_size = tree.page_size
        self.hit_len = hit_len
        self.cached_len = hit_len
        self.pages = hit_pages  # [num reserved pages] int32, the page table
        self.own_from = len(hit_pages)
        self.node = node
        tree.inc_lock_ref(node)

    @property
    def private_pages(self) -> np.ndarray:
        return self.pages[self.own_from :]

    def to_allocate(self, num_tokens: int) -> tuple[int, int]:
        """(new pages, copy-on-write pages) that `reserve(num_tokens)` allocates."""
        S = self.page_size
        cow = num_tokens > self.cached_len and self.cached_len % S != 0 and self.own_from > self.cached_len // S
        return max(0, -(-num_tokens // S) - len(self.pages)), int(cow)

    @property
    def writable(self) -> int:
        """Positions [0, writable) that `reserve` makes writable without allocating a page."""
        S = self.page_size
        if self.cached_len % S and self.own_from > self.cached_len // S:
            return self.cached_len  # a write past it copies the shared page first
        return len(self.pages) * S

    def reserve(self, num_tokens: int) -> list[tuple[int, int]]:
        """Make positions [0, num_tokens) writable; returns copy-on-write (src, dst) page pairs."""
        grow, cow = self.to_allocate(num_tokens)
        if not (cow or grow):
            return []
        new = self._alloc(grow + cow)
        copies = []
        if cow:
            j = self.cached_len // self.page_size
            copies.append((int(self.pages[j]), int(new[0])))
            self.pages[j] = new[0]  # our own array: match_prefix / path_pages return fresh ones
            self.own_from = j
            new = new[1:]
        self.pages = np.concatenate([self.pages, new])
        return copies

    def _alloc(self, n: int) -> np.ndarray:
        alloc = self.tree.allocator
        pages = alloc.alloc(n)
        if pages is None:
            self.tree.evict(n - alloc.num_free)
            pages = alloc.alloc(n)
            if pages is None:
                raise OutOfPages(self.name, n, alloc.num_free)
        return pages

    def extend_hit(self, tokens: np.ndarray) -> int:
        """Take over the tree's pages past this request's hit, matching `tokens` further, if it
        holds no private page yet (nothing of its own is written there). Returns tokens gained."""
        if self.own_from != len(self.pages):
            return 0
        length, node, _ = self.tree._walk(self.ns, np.asarray(tokens, np.int32), self.node)
        if length <= self.cached_len:
            return 0
        first = self.node.end // self.page_size  # our node spells tokens[:cached_len]
        self.pages = np.concatenate([self.pages[:first], self.tree.path_pages(node, top=self.node)])
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(self.node)
        gained = length - self.cached_len
        self.node, self.own_from = node, len(self.pages)
        self.hit_len = self.cached_len = length
        return gained

    def slots(self, positions: np.ndarray) -> np.ndarray:
        """Flat slot page·S + offset of each position to write; 0 (the sink) where it is cached."""
        S = self.page_size
        write = positions >= self.cached_len
        idx = np.where(write, positions // S, 0)
        if np.any(idx >= len(self.pages)):
            raise ValueError(f"{self.name}: positions up to {int(positions.max())} are not reserved")
        table = self.pages if len(self.pages) else np.zeros(1, np.int32)
        return np.where(write, table[idx] * S + positions % S, 0).astype(np.int32)

    def slot(self, position: int) -> int:
        """`slots` for one position, without numpy temporaries (the decode hot path)."""
        if position < self.cached_len:
            return 0
        page = position // self.page_size
        if page >= len(self.pages):
            raise ValueError(f"{self.name}: position {position} is not reserved")
        return int(self.pages[page]) * self.page_size + position % self.page_size

    def commit(self, tokens: np.ndarray) -> None:
        """Insert the whole pages of `tokens` (all written) and lock the new path instead."""
        S = self.page_size
        n = len(tokens) // S * S
        if n <= self.cached_len:
            return
        k = n // S
        if k > len(self.pages):
            raise ValueError(f"{self.name}: commit of {n} tokens but only {len(self.pages)} pages reserved")
        # Our locked node spells tokens[:cached_len]: insert below it, no need to re-compare.
        _, node = self.tree.insert(self.ns, tokens[:n], self.pages[:k], self.node)
        first = self.cached_len // S  # pages below it are the tree's already
        tree_pages = self.tree.path_pages(node, top=self.node)  # [k - first]
        old = self.pages[first:k]
        # Private pages the tree did not take are duplicates of what another request inserted first.
        dup = old[old != tree_pages]
        if dup.size:
            self.tree.allocator.dec_ref(dup)
        self.pages = np.concatenate([self.pages[:first], tree_pages, self.pages[k:]])
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(self.node)
        self.node = node
        self.own_from = k
        self.cached_len = n

    def release(self) -> None:
        self.tree.dec_lock_ref(self.node)
        self.tree.allocator.dec_ref(self.private_pages)
        self.pages = self.pages[: self.own_from]


class SeqCache:
    """Handle returned by `DualRadixCache.begin`; see the `forkjax.cache` docstring for its use.

    `fanout` {adapter slot: PoolSeq in that adapter's residual namespace}: residual fan-out, the
    residuals x·A_j of other agents j this request writes from its own hidden states wherever
    their tree lacks them, so their later forks are full hits. A fan-out pool is dropped when it
    could not be contiguous with what this request computes (its hit ends before the positions
    this request computes) or when the residual pool runs out.
    """

    def __init__(self, owner, adapter_key: Hashable, prompt_len: int, base: PoolSeq, res: PoolSeq | None,
                 *, count_hits: bool = True, fanout: dict[int, PoolSeq] | None = None):
        self._owner = owner
        self._count_hits = count_hits  # report this request's hits, at its first reserve
        self._counted = False
        self.adapter_key = adapter_key
        self.prompt_len = prompt_len
        self.base = base
        self.res = res  # None: this request keeps no residual (policy or bare base model)
        self.fanout = fanout or {}
        self.released = False
        # positions [0, writable) need no `reserve`, as of the last one (0: the tables changed
        # since): checked for every running request every step, so a plain attribute
        self.writable = 0
        self._prune_fanout()

    @property
    def pools(self) -> list[PoolSeq]:
        return [self.base] + ([self.res] if self.res else []) + list(self.fanout.values())

    def drop_fanout(self, slot: int) -> None:
        """Stop writing adapter `slot`'s fan-out residuals; pages not inserted yet are freed."""
        self.fanout.pop(slot).release()
        self.writable = 0

    def _prune_fanout(self):
        for slot, pool in list(self.fanout.items()):
            if pool.cached_len < self.cached_len:
                pool.release()
                del self.fanout[slot]

    def extend_hits(self, tokens) -> bool:
        """`PoolSeq.extend_hit` in every pool; True if the request now computes less."""
        before = self.cached_len
        self.writable = 0
        tokens = key_tokens(tokens, self.adapter_key)
        gained = [pool.extend_hit(tokens) for pool in (self.base, self.res) if pool is not None]
        for pool in self.fanout.values():
            pool.extend_hit(tokens)
        if self._counted and self._count_hits:
            self._owner._count_extra(gained[0], gained[1] if self.res else 0)
        self._prune_fanout()
        return self.cached_len > before

    @property
    def counts_hits(self) -> bool:
        """Its hits are this request's first (`count_hits`), not a preempted one's rerun."""
        return self._count_hits

    @property
    def base_len(self) -> int:
        """Prompt tokens whose base K/V was found in the cache."""
        return self.base.hit_len

    @property
    def res_len(self) -> int:
        """Prompt tokens whose residual was found in the cache (0 without a residual)."""
        return self.res.hit_len if self.res else 0

    @property
    def cached_len(self) -> int:
        """Leading positions the step need not compute: cached in every pool this request uses."""
        return min(self.base.cached_len, self.res.cached_len) if self.res else self.base.cached_len

    def reserve(self, num_tokens: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Pages for positions [0, num_tokens); returns (base, residual) copy-on-write pairs.

        Evicts unlocked LRU leaves of the pool that is short; raises OutOfPages if that is not
        enough (pages taken before the failure stay reserved and are freed by `release`).
        """
        base_copies = self.base.reserve(num_tokens)
        res_copies = self.res.reserve(num_tokens) if self.res else []
        for slot, pool in list(self.fanout.items()):
            try:
                res_copies += pool.reserve(num_tokens)
            except OutOfPages:  # fan-out is opportunistic: this agent stops writing for `slot`
                pool.release()
                del self.fanout[slot]
        if self._count_hits and not self._counted:
            self._counted = True
            self._owner._count_hits(self)
        self.writable = min(pool.writable for pool in self.pools)
        return base_copies, res_copies

    def pages_needed(self, num_tokens: int) -> tuple[int, int]:
        """(base, residual) pages `reserve(num_tokens)` would still allocate, copy-on-write
        pages included."""
        return (sum(self.base.to_allocate(num_tokens)),
                sum(sum(p.to_allocate(num_tokens)) for p in self.pools[1:]))

    def slot_mapping(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(base_slots [end-start], res_slots [end-start]) int32 for positions [start, end).

        Slot 0 means "do not write": the position is cached in that pool (the step reads the
        cached value instead), or the request has no residual.
        """
        positions = np.arange(start, end, dtype=np.int32)
        base = self.base.slots(positions)
        res = self.res.slots(positions) if self.res else np.zeros_like(positions)
        return base, res

    def slot_pair(self, position: int) -> tuple[int, int]:
        """`slot_mapping` for one position: (base slot, residual slot) as ints."""
        return self.base.slot(position), self.res.slot(position) if self.res else 0

    def fanout_slots(self, start: int, end: int) -> dict[int, np.ndarray]:
        """{adapter slot: [end-start] int32 residual slots of its fan-out pool for positions
        [start, end), 0 where it has them}."""
        if end - start == 1:  # decode: no numpy temporaries (host time is on the step)
            return {slot: [pool.slot(start)] for slot, pool in self.fanout.items()}
        positions = np.arange(start, end, dtype=np.int32)
        return {slot: pool.slots(positions) for slot, pool in self.fanout.items()}

    @property
    def base_page_table(self) -> np.ndarray:
        return self.base.pages  # [ceil(reserved/S)] int32

    @property
    def res_page_table(self) -> np.ndarray:
        """[same length as base_page_table] int32; all sink pages without a residual."""
        return self.res.pages if self.res else np.zeros(len(self.base.pages), np.int32)

    def commit(self, tokens) -> None:
        """Insert the whole pages of `tokens` into both trees; every one of them must be written.

        Call after prefill (so concurrent requests share the prompt) and at finish with
        prompt + generated tokens whose K/V is in the cache (not the last sampled token).
        """
        tokens = key_tokens(tokens, self.adapter_key)
        self.writable = 0
        for pool in self.pools:
            pool.commit(tokens)

    def release(self) -> None:
        """Unlock and free private pages (the partial last page, uncommitted work)."""
        if self.released:
            raise ValueError("SeqCache released twice")
        self.released = True
        self.writable = 0
        for pool in self.pools:
            pool.release()
        self._owner._live.discard(self)
