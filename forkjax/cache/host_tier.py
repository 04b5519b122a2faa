"""The host-tier half of RadixTree (radix_tree.py's docstring says what the tier does): write-back
of evicted leaves to a HostPagePool (host_pool.py), the host's own LRU, and loading host nodes
back into device pages (their host copies stay, backups). Kept apart so that the device tree
reads as it did without a tier; the counters it moves are the tree's."""

from __future__ import annotations

import heapq

import numpy as np

from forkjax.cache.tree_node import EMPTY, TreeNode, common_prefix_len

NO_HOST_PAGES = np.zeros(0, np.int64)


class HostTier:
    """Mixed into RadixTree; needs its allocator, counters, heaps and `_push`, `_delete_leaf`,
    `_detach`, `_free_device`, `evict`, `inc_lock_ref`, `dec_lock_ref`."""

    def attach_host(self, host) -> None:
        """Write evicted pages back to `host` (a HostPagePool of this tree's pool)."""
        self.host = host

    def _write_back(self, node: TreeNode) -> int:
        """Move a device leaf's own pages to the host (dropping it if the host has no room); one
        with a backup just leaves the device."""
        own = node.own_pages
        if node.host is None:
            if own and not self._make_host_room(self.host.store_bytes(own)):
                return self._delete_leaf(node)
            node.host = self.host.store(node.pages[node.shares_first:]) if own else NO_HOST_PAGES
            self.host_pages += own
        self._free_device(node)
        node.pages = EMPTY
        if not node.children:
            self._push_host(node)
        parent = node.parent
        if parent.parent is not None and parent.lock_ref == 0 and parent.device_leaf():
            self._push(parent)
        return own

    def _make_host_room(self, nbytes: int) -> bool:
        """Drop this tree's host copies until `nbytes` are free: backups of device nodes first,
        least recently loaded first, then host leaves, least recently used first."""
        budget = self.host.budget
        while budget.free < nbytes and self._backup_heap:
            node = heapq.heappop(self._backup_heap)[2]
            if node.alive and node.on_device:
                self._drop_backup(node)
        while budget.free < nbytes and self._host_heap:
            last_access, _, node = heapq.heappop(self._host_heap)
            if node.alive and not node.on_device and not node.children and node.last_access == last_access:
                self._drop_host_subtree(node)
        return budget.free >= nbytes

    def _drop_backup(self, node: TreeNode) -> None:
        """Forget a device node's host copy, if it has one."""
        if node.host is not None:
            self.host.free(node.host)
            self.host_pages -= node.own_pages
            node.host = None

    def _drop_host_subtree(self, top: TreeNode) -> None:
        """Forget a host node and its descendants (all on the host)."""
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self.host.free(node.host)
            self.host_pages -= node.own_pages
            node.alive = False
            self._num_nodes -= 1
        self._detach(top)

    def host_continuation(self, node: TreeNode, key: np.ndarray) -> list[TreeNode]:
        """The host nodes, top down, that would extend a match of `key` ending at `node` (a
        device node): whole nodes, the last one possibly matched in part."""
        out, pos = [], node.end
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None or child.on_device:
                break
            out.append(child)
            n = common_prefix_len(child.key, key[pos:])
            if n < len(child.key):
                break
            node, pos = child, pos + n
        return out

    def load(self, nodes: list[TreeNode]) -> int:
        """Bring host nodes (`host_continuation`'s, top down) back to the device, evicting
        device leaves for their pages (held ones last: they are written back to the host in
        turn); stops at the first that does not fit. Queues the copies
        in the host pool; returns how many nodes it loaded."""
        for node in nodes:  # most recent: the room a write-back makes is taken from others first
            node.last_access = self._clock
        if nodes and not nodes[-1].children:
            self._push_host(nodes[-1])
        locked, loaded = [], 0
        try:
            for node in nodes:
                pages = self.allocator.alloc(node.own_pages)
                if pages is None:  # evict, keeping what is loaded above (a lock on the path)
                    self.inc_lock_ref(node.parent)
                    locked.append(node.parent)
                    self.evict(node.own_pages - self.allocator.num_free)
                    if not node.alive:  # its host copy made room for a write-back
                        break
                    pages = self.allocator.alloc(node.own_pages)
                if pages is None:
                    break
                self._bring_back(node, pages)
                loaded += 1
        finally:
            for node in locked:
                self.dec_lock_ref(node)
        return loaded

    def _bring_back(self, node: TreeNode, pages: np.ndarray) -> None:
        """Copy a host node's pages into device `pages`; its host copy stays, a backup."""
        own = node.own_pages
        self.host.load(node.host, pages)
        if node.shares_first:  # the parent's last page, which is on the device
            first = node.parent.pages[-1:]
            self.allocator.inc_ref(first)
            pages = np.concatenate([first, pages])
        node.pages = pages
        self._push_backup(node)
        self.loaded_pages += own
        self._evictable += own
        self._held += own if node.hold_ref else 0
        self.ns_pages[node.ns] += own
        self.version += 1
        if node.device_leaf():
            self._push(node)

    def drop_host(self) -> None:
        """Forget every host copy: host nodes and backups."""
        device = [n for n in self._nodes() if n.on_device]
        for node in device:
            self._drop_backup(node)
        tops = [c for n in [*self.roots.values(), *device] for c in n.children.values() if not c.on_device]
        for node in tops:
            self._drop_host_subtree(node)

    def host_size(self) -> int:
        return self.host_pages

    def _push_host(self, node: TreeNode) -> None:
        self._host_heap = self._pushed(self._host_heap, node,
                                       lambda n: not n.on_device and not n.children)

    def _push_backup(self, node: TreeNode) -> None:
        self._backup_heap = self._pushed(self._backup_heap, node, lambda n: n.on_device and n.host is not None)

    def _pushed(self, heap: list, node: TreeNode, keep) -> list:
        """`heap` with an entry for `node`; rebuilt from the nodes `keep` selects when stale
        entries (nodes that left it since) pile up."""
        heapq.heappush(heap, (node.last_access, next(self._tiebreak), node))
        if len(heap) > 4 * self._num_nodes + 1024:
            heap = [(n.last_access, next(self._tiebreak), n) for n in self._nodes() if keep(n)]
            heapq.heapify(heap)
        return heap
