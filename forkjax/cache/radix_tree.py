"""Radix tree over token ids whose values are pages of one pool (SGLang `RadixCache` shape).

Keys are token-granular, storage is page-granular: tree_node.py says what a node holds and
which node owns a page that two of them touch.

Namespaces (adapter keys, or SHARED; see policy.py) get separate roots, so lookups never cross
them. Inserted keys must be whole pages; a match may end anywhere and the caller copies the
partly matched last page before writing into it (see seq_cache.py).

LRU eviction pops unlocked leaves from a heap keyed by (held, last access); stale entries (the
node was touched, locked, held, grew children or was evicted since) are skipped when popped.

Holds are soft locks: held pages are evicted only after every unheld one (`evict(...,
held=True)`), and without a host tier admission counts only unheld evictable pages as room
for other requests (`evictable_size(held=False)`; with one, evicting a held page costs a copy,
dual_cache.py). A waiting request holds the prefix it will hit, the engine the pages of a
session that ran recently (hold.py).

Host tier (`attach_host`): an evicted leaf's pages are written back to the host pool instead of
dropped, and the node stays in the tree on the host (tree_node.py); a node loaded back keeps
its host copy, so its next eviction copies nothing. When a write-back needs room the host drops
the copies of nodes on the device first, then host leaves, least recently used first. A match
stops at host nodes; `host_continuation` names the host nodes that would extend it and `load`
brings them back (the copies are the host pool's to run). An insert that meets a host node
drops it and its subtree: the new pages supersede it. Counters (evictable, held, protected,
ns_pages) count device pages.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Hashable

import numpy as np

from forkjax.cache.allocator import PageAllocator
from forkjax.cache.host_tier import HostTier
from forkjax.cache.tree_check import check_tree
from forkjax.cache.tree_node import EMPTY, TreeNode, append_pages, common_prefix_len

class RadixTree(HostTier):
    def __init__(self, page_size: int, allocator: PageAllocator):
        self.page_size = page_size
        self.allocator = allocator
        self.roots: dict[Hashable, TreeNode] = {}
        self.ns_pages: dict[Hashable, int] = defaultdict(int)  # owned pages per namespace
        self._evictable = 0
        self._held = 0  # of the evictable pages, those of held nodes
        self._protected = 0
        self.version = 0  # changes whenever a match could find something else (insert, evict)
        self.evicted_pages = 0  # pages freed by eviction, ever
        self._num_nodes = 0
        self._clock = 0
        self._heap: list = []  # (held, last_access, tiebreak, node) of candidate device leaves
        self._tiebreak = itertools.count()
        self.host = None  # a HostPagePool once attach_host gives this tree a host tier
        self.host_pages = 0  # own pages with a host copy (host nodes' and backups')
        self.loaded_pages = 0  # pages brought back from the host, ever
        self._host_heap: list = []  # (last_access, tiebreak, node) of candidate host leaves
        self._backup_heap: list = []  # (last_access, tiebreak, node) of device nodes with a host copy

    @classmethod
    def for_test(cls, page_size: int = 4, num_pages: int = 64) -> RadixTree:
        """A tree with its own host allocator; no device memory anywhere."""
        return cls(page_size, PageAllocator(num_pages))

    # ---- lookup and insertion -------------------------------------------------------------

    def root(self, ns: Hashable) -> TreeNode:
        node = self.roots.get(ns)
        if node is None:
            node = self.roots[ns] = TreeNode(EMPTY, EMPTY, 0, None, ns)
        return node

    def match_prefix(self, ns: Hashable, key: np.ndarray) -> tuple[int, np.ndarray, TreeNode]:
        """Longest cached prefix of `key` in namespace `ns`: (length, pages, last_node).

        pages: [ceil(length/S)] int32; the last one is only partly matched when length % S != 0
        and must be copied before anything is written into it. The match is split out so that
        `last_node` ends exactly at `length` (lock it to keep the prefix alive).
        """
        length, node, chunks = self._walk(ns, np.asarray(key, np.int32))
        return length, np.concatenate(chunks), node

    def insert(self, ns: Hashable, key: np.ndarray, pages: np.ndarray,
               node: TreeNode | None = None) -> tuple[int, TreeNode]:
        """Cache `key` (whole pages) backed by `pages` [len(key)/S]; returns (prefix_len, last_node).

        prefix_len tokens were cached already. If a leaf is added it takes over the caller's
        reference to pages[prefix_len//S:]; the caller must drop its other private pages.
        node: a node (locked by the caller) whose path spells key[:node.end]; the walk starts
        there instead of re-comparing a long shared prefix.
        """
        key = np.asarray(key, np.int32)
        S = self.page_size
        if len(key) % S or len(pages) != len(key) // S:
            raise ValueError(f"insert needs whole pages: {len(key)} tokens, {len(pages)} pages, S={S}")
        prefix_len, node, _ = self._walk(ns, key, node)
        if prefix_len < len(key):
            if (stale := node.children.get(int(key[prefix_len]))) is not None:
                self._drop_host_subtree(stale)  # a host node the walk stopped at
            first = prefix_len // S
            if prefix_len % S and len(node.pages) and pages[first] == node.pages[-1]:
                raise ValueError("the page at the fork point belongs to the tree; copy it first")
            leaf = TreeNode(key[prefix_len:].copy(), np.array(pages[first:], np.int32), prefix_len, node, ns)
            node.children[int(key[prefix_len])] = leaf
            leaf.last_access = self._clock
            self._num_nodes += 1
            self._evictable += leaf.own_pages
            self.ns_pages[ns] += leaf.own_pages
            self.version += 1
            self._push(leaf)
            node = leaf
        return prefix_len, node

    def path_pages(self, node: TreeNode, top: TreeNode | None = None) -> np.ndarray:
        """Pages of positions [0, node.end), or from page index top.end // S when `top` (an
        ancestor) is given. The deepest node wins where two touch a page."""
        path = []
        while node.parent is not None and node is not top:
            path.append(node)
            node = node.parent
        chunks: list[np.ndarray] = [EMPTY]  # stands for the pages above, so a mid-page start drops nothing
        for n in reversed(path):
            append_pages(chunks, n, self.page_size)
        return np.concatenate(chunks)

    def _walk(self, ns, key, node=None):
        """Follow `key` from the root of `ns` (or from `node`, at position node.end), splitting the
        node where the match ends."""
        node = self.root(ns) if node is None else node
        self._clock += 1
        now = self._clock
        chunks: list[np.ndarray] = [EMPTY]
        pos = node.end
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None or not child.on_device:
                break
            n = common_prefix_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child, now)
            append_pages(chunks, child, self.page_size)
            node = child
            pos += n
        return pos, node, chunks

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n tokens; returns the new upper node, `child` keeps the rest."""
        S = self.page_size
        cut = child.start + n
        upper = TreeNode(child.key[:n], child.pages[: -(-cut // S) - child.start // S], child.start,
                         child.parent, child.ns, child.shares_first)
        upper.lock_ref = child.lock_ref
        upper.hold_ref = child.hold_ref
        upper.last_access = child.last_access
        upper.children = {int(child.key[n]): child}
        child.parent.children[int(child.key[0])] = upper
        child.pages = child.pages[cut // S - child.start // S :]
        child.key = child.key[n:]
        child.start = cut
        child.parent = upper
        child.shares_first = cut % S != 0
        if child.shares_first:
            self.allocator.inc_ref(child.pages[:1])
        if child.host is not None:  # a backup: each part keeps its own pages' host copies
            upper.host, child.host = np.split(child.host, [upper.own_pages])
            self._push_backup(upper)
        self._num_nodes += 1
        return upper

    # ---- locking and eviction -------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction (a running request holds them)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= node.own_pages
                self._held -= node.own_pages if node.hold_ref else 0
                self._protected += node.own_pages
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise ValueError("dec_lock_ref on an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += node.own_pages
                self._held += node.own_pages if node.hold_ref else 0
                self._protected -= node.own_pages
                if node.device_leaf():
                    self._push(node)
            node = node.parent

    def inc_hold_ref(self, node: TreeNode) -> None:
        """Hold node and its ancestors: evicted only after every unheld leaf."""
        while node.parent is not None:
            node.hold_ref += 1
            if node.hold_ref == 1 and node.alive and node.on_device and node.lock_ref == 0:
                self._held += node.own_pages
                if node.device_leaf():
                    self._push(node)  # its heap entry moves to the held tier
            node = node.parent

    def dec_hold_ref(self, node: TreeNode) -> None:
        """Undo one `inc_hold_ref(node)`; the node may have been evicted meanwhile (held pages
        go when nothing else is left), its ancestors are still counted."""
        while node.parent is not None:
            if node.hold_ref <= 0:
                raise ValueError("dec_hold_ref on a node without holds")
            node.hold_ref -= 1
            if node.hold_ref == 0 and node.alive and node.on_device and node.lock_ref == 0:
                self._held -= node.own_pages
                if node.device_leaf():
                    self._push(node)
            node = node.parent

    def evictable_size(self, held: bool = True) -> int:
        """Pages of unlocked nodes; `held=False`: of those, the unheld ones only."""
        return self._evictable if held else self._evictable - self._held

    def protected_size(self) -> int:
        return self._protected

    def evict(self, num_pages: int, held: bool = True, drop: bool = False) -> int:
        """Free at least num_pages device pages from least recently used unlocked leaves, unheld
        ones first; `held=False` stops before the held ones. With a host tier their pages are
        written back to it unless `drop`. Returns pages freed."""
        freed = 0
        while freed < num_pages and self._heap:
            is_held, last_access, _, node = self._heap[0]
            if not (node.alive and node.lock_ref == 0 and node.device_leaf()
                    and node.last_access == last_access and is_held == (node.hold_ref > 0)):
                heapq.heappop(self._heap)  # stale
                continue
            if is_held and not held:
                break
            heapq.heappop(self._heap)
            write_back = self.host is not None and not (drop or node.retired)
            freed += self._write_back(node) if write_back else self._delete_leaf(node)
        self.evicted_pages += freed
        return freed

    def _free_device(self, node: TreeNode) -> int:
        """Drop a device node's pages and take them out of the counters; returns its own."""
        self.allocator.dec_ref(node.pages)  # a shared first page survives in the parent
        own = node.own_pages
        self._evictable -= own
        self._held -= own if node.hold_ref else 0
        self.ns_pages[node.ns] -= own
        self.version += 1
        return own

    def _detach(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[int(node.key[0])]
        self.version += 1
        if parent.parent is None or parent.lock_ref:
            return
        if not parent.on_device and not parent.children:
            self._push_host(parent)
        elif parent.device_leaf():
            self._push(parent)

    def _delete_leaf(self, node: TreeNode) -> int:
        """Forget a device leaf (its host copy and host descendants too); returns its own pages."""
        for child in list(node.children.values()):
            self._drop_host_subtree(child)
        self._drop_backup(node)
        own = self._free_device(node)
        node.alive = False
        self._num_nodes -= 1
        self._detach(node)
        return own

    def retire(self, node: TreeNode, beyond: int = 0, drop: bool = False) -> None:
        """The path to `node` will not be asked for again (its workflow ended), or its nodes
        that start at or after token `beyond` (its holder's next request left the path there):
        those of them no one else locks or holds leave the host now (host nodes with what is
        below them, the host copies of device nodes) and are evicted first from the device,
        without a write-back; with `drop` those that are device leaves are freed now. A match
        that reaches one revives it."""
        while (node.parent is not None and node.alive and node.start >= beyond
               and node.lock_ref == 0 and node.hold_ref == 0):
            parent = node.parent
            if not node.on_device:
                self._drop_host_subtree(node)  # everything below a host node is on the host
            else:
                for child in [c for c in node.children.values() if not c.on_device]:
                    self._drop_host_subtree(child)
                self._drop_backup(node)
                node.retired, node.last_access = True, 0
                if node.device_leaf():
                    if drop:
                        self.evicted_pages += self._delete_leaf(node)
                    else:
                        self._push(node)
            node = parent

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access = now
        node.retired = False
        if node.lock_ref == 0 and node.device_leaf():
            self._push(node)

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, self._entry(node))
        if len(self._heap) > 4 * self._num_nodes + 1024:
            # Stale entries pile up (every touch pushes one); rebuild from the live leaves.
            self._heap = [self._entry(n) for n in self._nodes() if n.device_leaf() and n.lock_ref == 0]
            heapq.heapify(self._heap)

    def _entry(self, node: TreeNode) -> tuple:
        return (node.hold_ref > 0, node.last_access, next(self._tiebreak), node)

    def is_attached(self, node: TreeNode) -> bool:
        while node.parent is not None:
            if not node.alive or node.parent.children.get(int(node.key[0])) is not node:
                return False
            node = node.parent
        return self.roots.get(node.ns) is node

    # ---- invariants -----------------------------------------------------------------------

    def _nodes(self):
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self) -> np.ndarray:
        """Assert the structural invariants; returns holders [num_pages]: nodes listing each page."""
        return check_tree(self)
