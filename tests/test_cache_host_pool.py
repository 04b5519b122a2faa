"""The host tier's page store (cache/host_pool.py, its copies run by runtime/host_blocks.py) on
random pools: pages copied to pinned host memory and back land bit-exact in shuffled device
pages, from several blocks at once, for both pool layouts; blocks return their bytes to the
shared budget with their last page, and their host memory once the copies queued before ran."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkjax.cache.host_pool import MAX_BLOCK_BYTES, HostBudget, HostPagePool, block_sizes
from forkjax.runtime import host_blocks
from forkjax.runtime.host_blocks import HostBlocks

L, HKV, S, D, R = 2, 2, 4, 8, 4
LAYOUTS = {  # pool shape with P pages, page axis
    "base": (lambda p: (L, HKV, p, S, D), 2),
    "residual": (lambda p: (L, p, S, R), 1),
}


def random_pool(shape, seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
            jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))


class Tier:
    """A host pool's bookkeeping and the runtime's blocks of one pool layout, together."""

    def __init__(self, axis, page_bytes, budget, **kw):
        self.pool, self.blocks = HostPagePool(page_bytes, budget, **kw), HostBlocks(axis)

    def execute(self, k, v):
        return self.blocks.execute(self.pool.take_copies(), k, v)


def page(x, axis, p):
    return np.asarray(jnp.take(x, jnp.asarray(p), axis=axis), np.float32)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_round_trip_is_exact_across_blocks(kind):
    shape, axis = LAYOUTS[kind]
    k, v = random_pool(shape(32), 0)
    want_k, want_v = np.asarray(k, np.float32), np.asarray(v, np.float32)
    page_bytes = 2 * k.nbytes // 32
    tier = Tier(axis, page_bytes, HostBudget(1 << 20))
    pool = tier.pool
    first = np.array([5, 17, 3], np.int32)  # blocks of 2 and 1
    second = np.array([30, 1, 12, 9, 22], np.int32)  # and of 4 and 1
    ids = np.concatenate([pool.store(first), pool.store(second)])
    assert pool.budget.used == 8 * page_bytes and pool.num_pages == 8 and pool.pending
    assert sorted(b.nbytes // page_bytes for b in pool._blocks.values()) == [1, 1, 2, 4]
    k, v = tier.execute(k, v)  # the stores: the pool itself is left as it was
    assert np.array_equal(np.asarray(k, np.float32), want_k) and not pool.pending
    assert len(tier.blocks) == 4
    assert all(x.sharding.memory_kind == "pinned_host" for b in tier.blocks._blocks.values() for x in b)
    # Back into other pages of a pool whose content changed meanwhile, in shuffled order and
    # from both blocks in one load.
    k2, v2 = random_pool(shape(32), 1)
    before_k = np.asarray(k2, np.float32)
    src = np.concatenate([first, second])
    order = np.random.default_rng(2).permutation(len(src))
    dst = np.array([2, 4, 6, 8, 10, 11, 13, 31], np.int32)
    pool.load(ids[order], dst)
    k2, v2 = tier.execute(k2, v2)
    for s, d in zip(src[order], dst):
        assert np.array_equal(page(k2, axis, d), np.take(want_k, s, axis=axis))
        assert np.array_equal(page(v2, axis, d), np.take(want_v, s, axis=axis))
    untouched = [p for p in range(1, 32) if p not in dst]
    assert np.array_equal(page(k2, axis, untouched), np.take(before_k, untouched, axis=axis))
    assert pool.bytes_loaded == pool.bytes_stored == 8 * page_bytes
    pool.check()


def test_blocks_return_their_bytes_with_their_last_page():
    shape, axis = LAYOUTS["base"]
    k, v = random_pool(shape(16), 0)
    page_bytes = 2 * k.nbytes // 16
    budget = HostBudget(8 * page_bytes)
    tier = Tier(axis, page_bytes, budget)
    pool = tier.pool
    a = pool.store(np.array([1, 2, 3, 4], np.int32))
    b = pool.store(np.array([5, 6], np.int32))
    k, v = tier.execute(k, v)
    assert budget.free == 2 * page_bytes
    with pytest.raises(MemoryError, match="host bytes"):
        pool.store(np.array([7, 8, 9], np.int32))  # 3 pages: no room
    pool.free(a[:3])
    assert budget.free == 2 * page_bytes  # a block is freed whole, with its last page
    pool.free(a[3:])
    assert budget.free == 6 * page_bytes
    # What is left still loads; the freed block's host memory goes once the copies run.
    pool.load(b, np.array([9, 10], np.int32))
    assert len(tier.blocks) == 2
    k2, v2 = tier.execute(*random_pool(shape(16), 3))
    assert len(tier.blocks) == 1
    assert np.array_equal(page(k2, axis, [9, 10]), page(k, axis, [5, 6]))
    pool.clear()
    assert budget.used == 0 and pool.num_pages == 0
    tier.execute(k2, v2)
    assert len(tier.blocks) == 0
    pool.check()


def test_a_store_reads_pages_before_a_load_of_the_same_round_overwrites_them():
    """Evicting page 3 to the host and loading another host page into page 3, queued in that
    order, keeps page 3's old content on the host."""
    shape, axis = LAYOUTS["residual"]
    k, v = random_pool(shape(8), 0)
    old3, old5 = page(k, axis, [3]), page(k, axis, [5])
    tier = Tier(axis, 2 * k.nbytes // 8, HostBudget(1 << 20))
    pool = tier.pool
    five = pool.store(np.array([5], np.int32))
    k, v = tier.execute(k, v)
    three = pool.store(np.array([3], np.int32))
    pool.load(five, np.array([3], np.int32))
    pool.free(five)  # freed after its load was queued: the load still runs
    k, v = tier.execute(k, v)
    assert np.array_equal(page(k, axis, [3]), old5)
    pool.load(three, np.array([6], np.int32))
    k, v = tier.execute(k, v)
    assert np.array_equal(page(k, axis, [6]), old3)
    pool.check()


def test_block_sizes():
    assert block_sizes(13, 64) == [8, 4, 1] and block_sizes(64, 64) == [64]
    assert block_sizes(150, 64) == [64, 64, 16, 4, 2] and block_sizes(3, 1) == [1, 1, 1]
    assert HostPagePool(2 << 20, HostBudget(0)).max_block == MAX_BLOCK_BYTES // (2 << 20)
    assert HostPagePool(3 << 20, HostBudget(0)).max_block == 128  # a power of two, in the bound
    assert HostPagePool(1, HostBudget(0), device_pages=100).max_block == 64
    assert jax.devices()[0].addressable_memories()  # the platform names its memory kinds


def test_large_stores_in_blocks_of_at_most_max_block_and_warmup_keeps_the_pool():
    """A store past max_block pages is cut into max_block blocks and the rest's binary digits;
    a partial load of a block writes only its pages (the rest into the sink page 0); warmup
    compiles every block size's programs and leaves every page but the sink as it was."""
    shape, axis = LAYOUTS["base"]
    k, v = random_pool(shape(32), 0)
    want_k = np.asarray(k, np.float32)
    tier = Tier(axis, 2 * k.nbytes // 32, HostBudget(1 << 20))
    pool = tier.pool
    pool.max_block = tier.blocks.max_block = 4
    k, v = tier.blocks.warmup(k, v)
    assert np.array_equal(page(k, axis, range(1, 32)), np.take(want_k, range(1, 32), axis=axis))
    ids = pool.store(np.arange(1, 12, dtype=np.int32))  # 11 pages: 4, 4, 2, 1
    assert [b.nbytes // pool.page_bytes for b in pool._blocks.values()] == [4, 4, 2, 1]
    k, v = tier.execute(k, v)
    pool.load(ids[[5, 0, 9]], np.array([20, 21, 22], np.int32))  # pages 6, 1, 10 of three blocks
    k2, _ = tier.execute(*random_pool(shape(32), 1))
    assert np.array_equal(page(k2, axis, [20, 21, 22]), np.take(want_k, [6, 1, 10], axis=axis))
    pool.check()


def test_pinning_ahead_comes_in_chunks_and_a_refusal_shrinks_the_tier(monkeypatch):
    """The tier's memory is pinned a store's largest block at a time (one array of the whole
    tier would need its bytes on the device too); where the allocator refuses a chunk, pinning
    stops and the tier shrinks to what was pinned, less the fragmentation's eighth."""
    monkeypatch.setattr(host_blocks, "MAX_BLOCK_BYTES", 1 << 20)
    real, chunks = host_blocks._zeros_to, []

    def refusing_the_third(host, nbytes):
        def pin():
            if len(chunks) == 2:
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (xla_gpu_host_bfc)")
            out = real(host, nbytes)()
            chunks.append((nbytes, out.sharding.memory_kind))
            return out
        return pin

    assert host_blocks.grow_pinned_host(5 << 19) == 5 << 19  # 1, 1 and 0.5 MiB
    budget = HostBudget(8 << 20)
    host_blocks.pin_host_tier(budget, pinned_limit=1 << 30)  # wants 9 MiB
    assert budget.capacity == 8 << 20  # all of it pinned
    monkeypatch.setattr(host_blocks, "_zeros_to", refusing_the_third)
    host_blocks.pin_host_tier(budget, pinned_limit=1 << 30)
    assert chunks == [(1 << 20, "pinned_host")] * 2
    assert budget.capacity == (2 << 20) * 8 // 9
    host_blocks.pin_host_tier(budget, pinned_limit=0)  # the limit caps it: nothing asked, nothing lost
    assert budget.capacity == (2 << 20) * 8 // 9
