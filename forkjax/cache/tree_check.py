"""RadixTree's structural invariants (tests call `tree.check()` after each operation)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from forkjax.cache.host_tier import NO_HOST_PAGES
from forkjax.cache.tree_node import EMPTY


def check_tree(tree) -> np.ndarray:
    """Assert the invariants of `tree`; returns holders [num_pages]: nodes listing each page."""
    S = tree.page_size
    evictable = held = protected = count = 0
    ns_pages: dict = defaultdict(int)
    all_pages = [EMPTY]
    host_ids = [NO_HOST_PAGES]
    for node in tree._nodes():
        count += 1
        parent = node.parent
        assert node.alive and len(node.key) > 0
        assert parent.children[int(node.key[0])] is node, "child indexed under the wrong token"
        assert node.start == parent.end and node.ns == parent.ns
        span = -(-node.end // S) - node.start // S
        if node.host is not None:
            assert len(node.host) == span - node.shares_first, "host pages do not cover the span"
            host_ids.append(node.host)
        if not node.on_device:
            assert node.host is not None and node.lock_ref == 0, "a node neither on the device nor the host"
            assert not any(c.on_device for c in node.children.values()), "device below host"
            continue
        assert len(node.pages) == span, "pages do not cover the span"
        assert not np.any(node.pages == 0), "the sink page is in the tree"
        if node.shares_first:
            assert node.start % S and node.pages[0] == parent.pages[-1], "bad shared page"
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "lock not on path"
        assert node.hold_ref >= sum(c.hold_ref for c in node.children.values()), "hold not on path"
        if node.lock_ref:
            protected += node.own_pages
        else:
            evictable += node.own_pages
            held += node.own_pages if node.hold_ref else 0
        ns_pages[node.ns] += node.own_pages
        all_pages.append(node.pages)
    assert count == tree._num_nodes
    ids = np.concatenate(host_ids)
    assert len(ids) == tree.host_pages and np.unique(ids).size == len(ids), "host pages drifted"
    assert tree.host is None or tree.host.num_pages == len(ids), "host pool and tree disagree"
    assert (evictable, held, protected) == (tree._evictable, tree._held, tree._protected), \
        "size counters drifted"
    assert {k: v for k, v in ns_pages.items() if v} == {k: v for k, v in tree.ns_pages.items() if v}
    return np.bincount(np.concatenate(all_pages), minlength=tree.allocator.num_pages)
