"""A node of a radix tree over token ids (radix_tree.py) and the pages it holds.

A node spans absolute token positions [start, end) and holds the physical page of every page
index that span touches: `pages[j]` stores positions [(start//S + j)·S, (start//S + j + 1)·S).
When a node boundary falls inside a page, two nodes of one path touch that page index:

* after a split, the lower node keeps using its parent's page (`shares_first`; both hold a
  reference, the parent "owns" it for accounting);
* after a copy-on-write fork, the new branch holds its own copy (same tokens before the fork
  point, its own tokens after).

Either way the deepest node on a path says where a position lives (`append_pages`), and every
page has exactly one owning node, so evictable + protected sizes count each page once.

With a host tier (host_pool.py) a node whose pages were written back lives on the host: `host`
holds the host page ids of its own pages and `pages` is empty. The device nodes of a path are
always a prefix of it (a node goes to the host only when none of its children is on the device,
and comes back only below a device parent), so a device match simply stops at the first host node.
A node loaded back keeps its host copy (`host` and `pages` both set: a backup), so evicting it
again costs no copy, until the host needs the room.
"""

from __future__ import annotations

import numpy as np

EMPTY = np.zeros(0, np.int32)


class TreeNode:
    __slots__ = ("key", "pages", "start", "parent", "children", "ns", "lock_ref", "hold_ref",
                 "last_access", "shares_first", "alive", "host", "retired")

    def __init__(self, key, pages, start, parent, ns, shares_first=False):
        self.key = key  # [n] int32 token ids of this edge
        self.pages = pages  # [ceil(end/S) - start//S] int32 physical pages
        self.start = start
        self.parent = parent
        self.children: dict[int, TreeNode] = {}  # first token id -> child
        self.ns = ns
        self.lock_ref = 0
        self.hold_ref = 0  # soft locks: evicted after unheld leaves
        self.last_access = 0
        self.shares_first = shares_first  # pages[0] is the parent's last page
        self.alive = True
        self.host: np.ndarray | None = None  # [own pages] host page ids of its host copy
        self.retired = False  # its workflow ended: evicted first, never written back (until reused)

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    @property
    def own_pages(self) -> int:
        return len(self.pages) - self.shares_first if len(self.pages) else len(self.host)

    @property
    def on_device(self) -> bool:
        return len(self.pages) > 0  # a device node holds at least the page its first token is in

    def device_leaf(self) -> bool:
        """On the device with no child on the device: what device eviction takes."""
        return self.on_device and not any(c.on_device for c in self.children.values())


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    neq = a[:m] != b[:m]
    i = int(neq.argmax()) if m else 0
    return i if m and neq[i] else m


def append_pages(chunks: list[np.ndarray], node: TreeNode, page_size: int) -> None:
    """Append `node`'s pages to the pages of the path above it (`chunks`, a list of arrays)."""
    if node.start % page_size:
        # The parent's last page index is this node's first: the deeper node's page wins (the
        # same physical page after a split, this branch's own copy after a copy-on-write fork).
        chunks[-1] = chunks[-1][:-1]
    chunks.append(node.pages)
