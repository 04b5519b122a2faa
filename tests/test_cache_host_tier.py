"""A radix tree with a host tier (radix_tree.py, host_pool.py): evicted leaves are written back
to the host and stay matchable through `host_continuation`, `load` brings them back into fresh
device pages and keeps the host copy (the next eviction copies nothing), the host drops the
copies of device nodes before its own LRU leaves, and an insert that meets a host node
supersedes it.
The data check runs the host pool's copies (runtime/host_blocks.py) on a small device pool whose pages hold the tokens
they cache: after any mix of operations every device node's pages hold its own tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from forkjax.cache import RadixTree
from forkjax.cache.host_pool import HostBudget, HostPagePool
from forkjax.runtime.host_blocks import HostBlocks

S, NS = 4, "ns"


def _tree(device_pages=32, host_pages=64):
    tree = RadixTree.for_test(page_size=S, num_pages=device_pages)
    # One page: its S tokens in K, their negatives in V ([L=1, Hkv=1, P, S, D=1], float32).
    tree.attach_host(HostPagePool(2 * S * 4, HostBudget(host_pages * 2 * S * 4)))
    tree.blocks = HostBlocks(axis=2)  # the runtime's side of the tier, for the data check
    return tree


def _insert(tree, tokens, pool=None):
    tokens = np.asarray(tokens, np.int32)
    pages = tree.allocator.alloc(len(tokens) // S)
    if pages is None:
        tree.evict(len(tokens) // S - tree.allocator.num_free)
        pages = tree.allocator.alloc(len(tokens) // S)
    prefix_len, node = tree.insert(NS, tokens, pages)
    tree.allocator.dec_ref(pages[: prefix_len // S])
    if pool is not None:  # the request wrote its pages before inserting them
        pool = _run(tree, pool)  # write-backs its evictions queued read the pages first
        k, v = pool
        rows = tokens.reshape(-1, S)[prefix_len // S:].astype(np.float32)
        dst = jnp.asarray(pages[prefix_len // S:])
        pool = (k.at[0, 0, dst, :, 0].set(rows), v.at[0, 0, dst, :, 0].set(-rows))
    return node, pool


def _run(tree, pool):
    return tree.blocks.execute(tree.host.take_copies(), *pool)


def _match(tree, tokens):
    tokens = np.asarray(tokens, np.int32)
    n, pages, node = tree.match_prefix(NS, tokens)
    return n, pages, node, tree.host_continuation(node, tokens)


def test_eviction_writes_back_and_a_load_brings_the_path_back():
    tree = _tree()
    _insert(tree, range(1, 13))  # 3 pages
    assert tree.evict(3) == 3 and tree.allocator.num_free == tree.allocator.num_usable
    assert tree.host_size() == 3 and tree.evictable_size() == 0
    n, _, node, host = _match(tree, range(1, 13))
    assert n == 0 and [h.end for h in host] == [12]
    tree.check()
    assert tree.load(host) == 1
    n, pages, _, host = _match(tree, range(1, 13))
    assert n == 12 and len(pages) == 3 and not host and tree.host_size() == 3
    assert tree.loaded_pages == 3 and tree.host.num_pages == 3  # the host copy stays
    tree.check()
    stored = tree.host.bytes_stored
    assert tree.evict(3) == 3 and tree.host.bytes_stored == stored  # so leaving copies nothing
    assert tree.load(_match(tree, range(1, 13))[3]) == 1 and _match(tree, range(1, 13))[0] == 12
    tree.check()


def test_the_host_drops_device_nodes_copies_before_its_own_leaves():
    tree = _tree(host_pages=8)
    _insert(tree, range(1, 13))
    _insert(tree, range(100, 112))
    tree.evict(6)  # both paths on the host: 3 pages each, blocks of 2 and 1
    tree.load(_match(tree, range(1, 13))[3])  # the first back on the device, its copy kept
    assert tree.host_size() == 6
    _insert(tree, range(200, 212))
    _match(tree, range(1, 13))  # the third path is now the least recent on the device
    tree.evict(3)  # it needs 3 host pages: the first path's copy goes, not the second path
    assert _match(tree, range(1, 13))[0] == 12 and _match(tree, range(100, 112))[3]
    assert tree.host_size() == 6 and _match(tree, range(1, 13))[2].host is None
    tree.check()


def test_the_host_drops_its_least_recent_leaves_for_room():
    tree = _tree(host_pages=8)
    _insert(tree, range(1, 13))
    _insert(tree, range(100, 112))
    tree.evict(3)  # the first path: 3 pages, a block of 4
    tree.evict(3)  # the second: the host has 4 pages left, so nothing is dropped yet
    assert tree.host_size() == 6
    _insert(tree, range(200, 212))
    tree.evict(3)  # needs 4 more host pages: the first path, least recent, is dropped
    assert tree.host_size() == 6
    assert not _match(tree, range(1, 13))[3] and _match(tree, range(100, 112))[3]
    tree.check()


def test_a_retired_path_leaves_the_host_and_goes_first_without_a_copy():
    """`retire`: a path whose workflow ended loses its host copies at once (host nodes, and the
    backup of a node loaded back) and leaves the device before older live paths, with no
    write-back; the prefix another path still holds stays; a match revives a retired node."""
    tree = _tree()
    shared, _ = _insert(tree, range(1, 9))  # 2 pages, a prefix two paths share
    tree.inc_hold_ref(shared)  # another session holds it
    old, _ = _insert(tree, [*range(1, 9), *range(50, 58)])
    done, _ = _insert(tree, [*range(1, 9), *range(100, 112)])  # the workflow that ends
    assert tree.evict(2) == 2 and tree.host_size() == 2 and not old.on_device  # least recent
    tree.load(_match(tree, [*range(1, 9), *range(50, 58)])[3])  # `old` back, its copy kept
    retired, _ = _insert(tree, [*range(1, 9), *range(200, 208)])
    assert tree.evict(3) == 3 and not done.on_device and tree.host_size() == 5
    tree.retire(done)  # a host node: dropped with its copy
    tree.retire(retired)
    assert not done.alive and shared.alive and not shared.retired and retired.retired
    stored = tree.host.bytes_stored
    assert tree.evict(1) == 2 and not retired.alive  # before `old`, which is older
    assert tree.host.bytes_stored == stored and old.on_device and tree.host_size() == 2
    tree.retire(old)  # loaded back: its backup goes
    assert tree.host_size() == 0 and old.on_device and old.retired
    assert _match(tree, [*range(1, 9), *range(50, 58)])[0] == 16 and not old.retired
    tree.dec_hold_ref(shared)
    tree.check()


def test_without_host_room_eviction_drops():
    tree = _tree(host_pages=2)
    _insert(tree, range(1, 13))
    assert tree.evict(3) == 3 and tree.host_size() == 0 and not _match(tree, range(1, 13))[3]
    tree.check()


def test_an_insert_supersedes_a_host_node():
    tree = _tree()
    _insert(tree, range(1, 13))
    tree.evict(3)
    _insert(tree, range(1, 9))  # the same first two pages, computed again
    assert tree.host_size() == 0 and tree.host.num_pages == 0
    assert _match(tree, range(1, 13))[0] == 8
    tree.check()


def test_a_split_node_keeps_its_shared_page_with_the_parent():
    """A branch that starts inside a page shares that page with its parent; written back, it
    stores only its own pages, and reloaded it shares the parent's page again."""
    tree = _tree()
    _insert(tree, range(1, 13))
    n, _, node, _ = _match(tree, [1, 2, 3, 4, 5, 6, 99])  # splits at token 6, inside page 1
    assert n == 6 and node.end == 6
    lower = node.children[7]
    assert lower.shares_first and lower.own_pages == 1
    tree.evict(1)
    assert lower.host is not None and tree.host_size() == 1
    tree.check()
    assert tree.load(tree.host_continuation(node, np.arange(1, 13))) == 1
    assert lower.pages[0] == node.pages[-1] and len(lower.pages) == 2
    tree.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_every_page_holding_its_tokens(seed):
    rng = np.random.default_rng(seed)
    tree = _tree(device_pages=12, host_pages=int(rng.integers(0, 12)))
    pool = (jnp.zeros((1, 1, 12, S, 1)), jnp.zeros((1, 1, 12, S, 1)))
    prefixes = [rng.integers(0, 50, S * 4) for _ in range(3)]
    for _ in range(40):
        base = prefixes[rng.integers(3)]
        tokens = np.concatenate([base[: S * rng.integers(0, 4)], rng.integers(0, 50, S * rng.integers(1, 3))])
        op = rng.integers(3)
        if op == 0:
            _, pool = _insert(tree, tokens, pool)
        elif op == 1:
            tree.evict(int(rng.integers(1, 4)))
        else:
            n, _, node, host = _match(tree, tokens)
            if host:
                tree.load(host)
        pool = _run(tree, pool)
        tree.check()
        k, v = np.asarray(pool[0])[0, 0, :, :, 0], np.asarray(pool[1])[0, 0, :, :, 0]
        for node in tree._nodes():
            if node.on_device:
                first = node.start // S
                path = np.concatenate([_path_tokens(node), np.full(S, -1)])  # [end + S]
                for j, p in enumerate(node.pages):
                    span = path[(first + j) * S:(first + j + 1) * S]
                    written = span >= 0  # a partial last page holds its first tokens only
                    assert np.array_equal(k[p][written], span[written]) and np.array_equal(v[p], -k[p])


def _path_tokens(node):
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return np.concatenate(keys[::-1]).astype(np.float32)
