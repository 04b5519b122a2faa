import numpy as np
import pytest

from forkjax.cache import RadixTree

NS = "ns"


def _tree(num_pages=32):
    return RadixTree.for_test(page_size=4, num_pages=num_pages)


def _insert(tree, tokens, ns=NS):
    tokens = np.asarray(tokens, np.int32)
    pages = tree.allocator.alloc(len(tokens) // 4)
    prefix_len, node = tree.insert(ns, tokens, pages)
    # Pages the tree did not take (already cached) go back, as the request handle does.
    tree.allocator.dec_ref(pages[: prefix_len // 4])
    return pages, node


def test_empty_tree_matches_nothing():
    tree = _tree()
    n, pages, node = tree.match_prefix(NS, np.arange(8))
    assert n == 0 and pages.size == 0 and node is tree.root(NS)


def test_insert_then_match_whole_and_partial():
    tree = _tree()
    pages, _ = _insert(tree, range(1, 13))
    n, got, node = tree.match_prefix(NS, np.r_[1:13, 99])
    assert n == 12 and got.tolist() == pages.tolist() and node.end == 12
    n, got, _ = tree.match_prefix(NS, np.r_[1:9, 50])
    assert n == 8 and got.tolist() == pages[:2].tolist()
    tree.check()


def test_match_inside_a_page_splits_and_shares_that_page():
    tree = _tree()
    pages, _ = _insert(tree, range(1, 13))
    n, got, node = tree.match_prefix(NS, [1, 2, 3, 4, 5, 6, 77])
    assert n == 6 and got.tolist() == pages[:2].tolist()  # the last page is only partly matched
    assert node.end == 6 and len(node.children) == 1
    lower = next(iter(node.children.values()))
    assert lower.shares_first and lower.pages[0] == pages[1]
    assert tree.allocator.refcount[pages[1]] == 2  # both halves hold it
    assert tree.evictable_size() == 3  # still three physical pages
    holders = tree.check()
    assert holders[pages[1]] == 2


def test_insert_needs_whole_pages():
    tree = _tree()
    with pytest.raises(ValueError, match="whole pages"):
        tree.insert(NS, np.arange(1, 6), np.array([1, 2], np.int32))


def test_insert_of_cached_prefix_returns_its_length():
    tree = _tree()
    _insert(tree, range(1, 9))
    pages = tree.allocator.alloc(3)
    prefix_len, node = tree.insert(NS, np.r_[1:9, 20:24], pages)
    assert prefix_len == 8 and node.end == 12 and node.pages.tolist() == pages[2:].tolist()
    tree.allocator.dec_ref(pages[:2])
    tree.check()


def test_cow_branch_takes_its_own_copy_of_the_fork_page():
    tree = _tree()
    a, _ = _insert(tree, range(1, 9))
    b = np.r_[a[:1], tree.allocator.alloc(1)]  # the fully shared first page is the tree's
    prefix_len, node = tree.insert(NS, [1, 2, 3, 4, 5, 6, 70, 80], b)
    assert prefix_len == 6 and not node.shares_first and node.pages.tolist() == [b[1]]
    assert tree.path_pages(node).tolist() == [a[0], b[1]]  # the deeper node wins page index 1
    tree.check()


def test_insert_refuses_a_tree_page_at_the_fork_point():
    tree = _tree()
    a, _ = _insert(tree, range(1, 9))
    with pytest.raises(ValueError, match="copy it first"):
        tree.insert(NS, np.array([1, 2, 3, 4, 5, 6, 70, 80]), a.copy())


def test_namespaces_never_match_each_other():
    tree = _tree()
    _insert(tree, range(1, 9), ns="a")
    assert tree.match_prefix("b", np.arange(1, 9))[0] == 0
    assert tree.match_prefix("a", np.arange(1, 9))[0] == 8
    assert tree.ns_pages["a"] == 2 and tree.ns_pages["b"] == 0


def test_lru_eviction_order_and_parent_after_children():
    tree = _tree()
    _insert(tree, range(1, 9))  # [1..8]
    _insert(tree, np.r_[1:5, 30:34])  # shares the first page, own second page
    _insert(tree, range(50, 54))
    tree.match_prefix(NS, np.r_[1:9])  # refresh [1..8]; [30..33] branch is now the oldest leaf
    assert tree.evict(1) == 1
    assert tree.match_prefix(NS, np.r_[1:5, 30:34])[0] == 4
    assert tree.evict(1) == 1  # then [50..53]
    assert tree.match_prefix(NS, np.arange(50, 54))[0] == 0
    assert tree.evict(10) == 2  # leaf [5..8], then its parent [1..4]
    assert tree.allocator.num_free == tree.allocator.num_usable
    tree.check()


def test_locked_nodes_are_protected_until_unlocked():
    tree = _tree()
    _insert(tree, range(1, 9))
    _, _, node = tree.match_prefix(NS, np.arange(1, 5))  # split: lock only the first page
    tree.inc_lock_ref(node)
    assert (tree.evictable_size(), tree.protected_size()) == (1, 1)
    assert tree.evict(100) == 1  # the unlocked second page only
    assert tree.match_prefix(NS, np.arange(1, 9))[0] == 4
    tree.dec_lock_ref(node)
    assert (tree.evictable_size(), tree.protected_size()) == (1, 0)
    assert tree.evict(100) == 1
    with pytest.raises(ValueError):
        tree.dec_lock_ref(node)
    tree.check()


def test_evicting_the_lower_half_of_a_split_page_keeps_the_page():
    tree = _tree()
    pages, _ = _insert(tree, range(1, 9))
    _, _, node = tree.match_prefix(NS, [1, 2, 3, 4, 5, 6])
    tree.inc_lock_ref(node)
    assert tree.evict(100) == 0  # the lower half owns no page: page 2 lives on in the upper half
    assert tree.allocator.refcount[pages[1]] == 1
    assert tree.match_prefix(NS, np.arange(1, 9))[0] == 6
    tree.dec_lock_ref(node)
    tree.check()


def test_check_counts_holders_per_page():
    tree = _tree()
    pages, _ = _insert(tree, range(1, 9))
    holders = tree.check()
    assert holders[pages].tolist() == [1, 1] and holders.sum() == 2


def test_heap_is_rebuilt_when_stale_entries_pile_up():
    tree = _tree()
    _insert(tree, range(1, 5))
    for _ in range(3000):
        tree.match_prefix(NS, np.arange(1, 5))  # every touch pushes an entry
    assert len(tree._heap) < 2000
    assert tree.evict(1) == 1


def test_held_leaves_are_evicted_after_unheld_ones_and_are_not_room():
    tree = _tree()
    _insert(tree, range(1, 9))  # oldest
    _insert(tree, range(20, 28))
    _insert(tree, range(40, 48))  # newest
    _, _, old = tree.match_prefix(NS, np.arange(1, 9))
    _, _, mid = tree.match_prefix(NS, np.arange(20, 28))
    tree.match_prefix(NS, np.arange(40, 48))  # recency: [1..8] < [20..27] < [40..47]
    tree.inc_hold_ref(old)
    tree.inc_hold_ref(mid)
    assert tree.evictable_size() == 6 and tree.evictable_size(held=False) == 2
    tree.check()
    assert tree.evict(2, held=False) == 2  # the unheld [40..47], although the newest
    assert tree.evict(2, held=False) == 0  # only held leaves are left
    assert tree.evict(2) == 2  # then the least recently used held one: [1..8]
    assert tree.match_prefix(NS, np.arange(20, 28))[0] == 8
    tree.dec_hold_ref(mid)
    assert tree.evictable_size(held=False) == 2
    tree.dec_hold_ref(old)  # its node was evicted meanwhile: only the counts go
    with pytest.raises(ValueError):
        tree.dec_hold_ref(mid)
    tree.check()
    assert tree.evicted_pages == 4 and tree.evict(10) == 2


def test_holds_follow_splits_and_locks():
    tree = _tree()
    _insert(tree, range(1, 13))
    _, _, node = tree.match_prefix(NS, np.arange(1, 13))
    tree.inc_hold_ref(node)
    _, _, mid = tree.match_prefix(NS, np.arange(1, 7))  # splits the held node inside a page
    tree.check()
    tree.inc_lock_ref(mid)  # locked pages are protected, not held room
    assert tree.evictable_size() == tree.evictable_size(held=False) + 1
    tree.check()
    tree.dec_lock_ref(mid)
    tree.dec_hold_ref(node)
    assert tree.evictable_size(held=False) == tree.evictable_size() == 3
    tree.check()
