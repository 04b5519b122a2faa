"""The host-memory tier of one device page pool: pages written back from the device are kept in
pinned host memory (jax memory kind `pinned_host`), and copied into device pages again on a hit.

    base pool      K, V [L, Hkv, P, S, D]   page axis 2
    residual pool  K, V [L, P, S, R]        page axis 1

Pages move in blocks: a store of n pages cuts them into blocks of at most `max_block` pages
(`MAX_BLOCK_BYTES`) and the rest into blocks of its binary digits (13 pages: 8, 4 and 1),
gathers each into one contiguous device buffer (a jitted gather) and copies it to the host in
one transfer; a block stays as it is until every page of it is freed. Block sizes are powers of
two up to `max_block`, so the programs are few (`warmup` compiles them all) and no host byte is
padding. A load copies each block it needs back whole, then scatters its pages into their
device pages, those it does not want into the sink page 0 (a jitted scatter that donates the
pool: one program a block size, and device-local bytes are cheap beside the link's). Large
copies are what run near the link's rate: on the H200 a 1 GB `pinned_host` array moves at ~49
GB/s each way, pageable numpy at 4-7 GB/s to the device and ~1.3 GB/s back.

Every copy is dispatched, not waited for (`execute`, before a step): the gather reads the pool as
the steps dispatched before it left it, and the scatter's pool is the one the next step reads,
so a page is never read before its copy lands nor overwritten before its store has read it (JAX
orders work on a buffer by dispatch), and the copies overlap the steps in flight.

Host page ids are this pool's own (1, 2, ...; 0 is never one). The bytes of live blocks count
against a `HostBudget` that the pools of one cache share.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)


def grow_pinned_host(nbytes: int, device=None) -> int:
    """Have XLA's pinned host allocator take `nbytes` now, which it keeps once the arrays are
    freed; returns the bytes it gave. It grows on demand otherwise, and each growth
    (cudaHostAlloc) waits for the device's work in flight: on the H200 a store that grew it held
    the host ~0.1-0.2 s, one that fit the allocator's region 0.3 ms. Pinning takes ~0.5 s a GiB
    there, so the engine runs this in a thread of its own at start. The bytes come in arrays of
    MAX_BLOCK_BYTES (a store's largest block): one array of `nbytes` would need as many device bytes
    for the program's output before its copy out, and a growth the machine refuses leaves the
    allocator asking for as much at every later growth, so that small stores fail too. Stops at
    the first array the allocator cannot give (another engine's host pages still live, or the
    machine pins no more)."""
    host = jax.sharding.SingleDeviceSharding(device or jax.devices()[0], memory_kind="pinned_host")
    held, given = [], 0
    try:
        while given < nbytes:
            n = min(MAX_BLOCK_BYTES, nbytes - given)
            held.append(_zeros_to(host, n)())
            held[-1].block_until_ready()
            given += n
    except jax.errors.JaxRuntimeError as e:
        log.warning("host tier: pinned %d of %d bytes ahead (%s)", given, nbytes, str(e).splitlines()[0])
    return given


@functools.cache
def _zeros_to(host: jax.sharding.Sharding, nbytes: int):
    return jax.jit(lambda: jnp.zeros((nbytes,), jnp.uint8), out_shardings=host)


def pin_host_tier(budget: HostBudget, pinned_limit: int, device=None) -> None:
    """Pin the tier's bytes and an eighth more for the allocator's fragmentation (at most
    `pinned_limit`, XLA's limit); where the machine pins less, the tier shrinks to what was
    pinned, less that eighth, so that no store waits on an allocator that cannot grow (each
    such allocation retries for 10 s before it fails)."""
    want = min(budget.capacity + budget.capacity // 8, pinned_limit)
    given = grow_pinned_host(want, device)
    if given < want:
        budget.capacity = min(budget.capacity, given * 8 // 9)
        log.warning("host tier: %d bytes (the machine pinned %d)", budget.capacity, given)


class HostBudget:
    """Host bytes that the host pools of one cache may hold together."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"host_kv_bytes={capacity_bytes}: expected >= 0")
        self.capacity, self.used = int(capacity_bytes), 0

    @property
    def free(self) -> int:
        return self.capacity - self.used


# Blocks of 64 MiB copy at ~30 GB/s on the H200, of 1 GiB at ~50 (BENCHMARKS.md, Host tier).
MAX_BLOCK_BYTES = 512 << 20


def block_sizes(n: int, max_block: int) -> list[int]:
    """The blocks a store of n pages is cut into: max_block (a power of two) pages while n
    allows, then the binary digits of the rest, largest first."""
    full, rest = divmod(n, max_block)
    return [max_block] * full + [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]


@functools.cache
def _gather_to(host: jax.sharding.Sharding):
    """The store program for one host memory: k, v (a pool's K and V), pages [n] int32 -> their
    pages, [.., n, ..] on `axis`, written to `host`. The copy to the host is part of the program,
    so it is dispatched like a step; `jax.device_put` to a host memory kind waits on the host
    until its source is computed, which would stall the engine for the step in flight."""
    return jax.jit(lambda k, v, pages, axis: (jnp.take(k, pages, axis=axis), jnp.take(v, pages, axis=axis)),
                   static_argnums=3, out_shardings=host)


@functools.partial(jax.jit, static_argnums=6, donate_argnums=(0, 1))
def _scatter(k, v, block_k, block_v, src, dst, axis):
    """Pages src [m] of a block into pages dst [m] of the pool (dst 0, the sink, for padding)."""
    put = lambda pool, block: pool.at[(slice(None),) * axis + (dst,)].set(  # noqa: E731
        jnp.take(block, src, axis=axis))
    return put(k, block_k), put(v, block_v)


@dataclasses.dataclass
class _Block:
    nbytes: int
    live: int  # its pages not freed yet
    k: jax.Array | None = None  # [.., n, ..] (n a power of two) on the host, once its store has run
    v: jax.Array | None = None


class HostPagePool:
    """The host pages of one device pool (`axis`: its page axis, 2 for base K/V, 1 for the
    residual's); `page_bytes`: K and V of one page.

    Bookkeeping and copies are apart, as the cache's trees and the device pools are: `store`,
    `load` and `free` decide on the spot (host page ids, budget) and queue the copies, which
    `execute` runs in call order on the pools before the next step. A store of pages that a load
    of the same round then overwrites has read them first."""

    def __init__(self, axis: int, page_bytes: int, budget: HostBudget, device=None,
                 device_pages: int | None = None):
        self.axis, self.page_bytes, self.budget = axis, page_bytes, budget
        most = max(1, min(MAX_BLOCK_BYTES // page_bytes, device_pages or MAX_BLOCK_BYTES))
        self.max_block = 1 << (most.bit_length() - 1)  # no store is larger than the device pool
        device = device or jax.devices()[0]
        self._device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        self._host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        self._blocks: dict[int, _Block] = {}
        self._where: dict[int, tuple[int, int]] = {}  # host page id -> (block id, offset)
        self._queue: list[tuple] = []  # ("store", block, idx) | ("load", [(block, src, dst)])
        self._next_page = self._next_block = 1
        self.bytes_stored = self.bytes_loaded = 0
        self.load_stall_s = 0.0  # host seconds steps waited while loads were issued

    @property
    def num_pages(self) -> int:
        return len(self._where)

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def store_bytes(self, n: int) -> int:
        """Host bytes a store of n pages takes."""
        return n * self.page_bytes

    def store(self, pages: np.ndarray) -> np.ndarray:
        """Give device pages [n] host page ids [n] in new blocks (one per binary digit of n),
        and queue their copies. The caller makes room first: a store past the budget raises."""
        pages = np.asarray(pages, np.int32)
        n = len(pages)
        nbytes = self.store_bytes(n)
        if nbytes > self.budget.free:
            raise MemoryError(f"a store of {n} pages needs {nbytes} host bytes, {self.budget.free} free")
        ids = np.arange(self._next_page, self._next_page + n, dtype=np.int64)
        start = 0
        for size in block_sizes(n, self.max_block):
            block = _Block(size * self.page_bytes, size)
            self._blocks[self._next_block] = block
            self._queue.append(("store", block, pages[start:start + size]))
            self._where.update((int(i), (self._next_block, j)) for j, i in enumerate(ids[start:start + size]))
            self._next_block += 1
            start += size
        self.budget.used += nbytes
        self.bytes_stored += nbytes
        self._next_page += n
        return ids

    def load(self, ids: np.ndarray, dst: np.ndarray) -> None:
        """Queue the copy of host pages ids [n] into device pages dst [n]; the host pages stay
        until freed."""
        by_block: dict[int, list[tuple[int, int]]] = {}
        for i, d in zip(np.asarray(ids, np.int64).tolist(), np.asarray(dst, np.int32).tolist()):
            block, offset = self._where[i]
            by_block.setdefault(block, []).append((offset, d))
        for block, pairs in by_block.items():
            size = self._blocks[block].nbytes // self.page_bytes
            idx = np.stack([np.arange(size, dtype=np.int32), np.zeros(size, np.int32)])  # all to the sink
            idx[1, [offset for offset, _ in pairs]] = [d for _, d in pairs]
            self._queue.append(("load", self._blocks[block], idx))
        self.bytes_loaded += len(ids) * self.page_bytes

    def execute(self, k, v):
        """Run the queued copies on the pool (k, v), which is donated; returns the new (k, v)."""
        for op, block, idx in self._queue:
            if op == "store":
                block.k, block.v = _gather_to(self._host)(k, v, jnp.asarray(idx), self.axis)
            else:
                t = time.perf_counter()
                block_k, block_v = jax.device_put((block.k, block.v), self._device)
                k, v = _scatter(k, v, block_k, block_v, jnp.asarray(idx[0]), jnp.asarray(idx[1]), self.axis)
                self.load_stall_s += time.perf_counter() - t
        self._queue.clear()
        return k, v

    def warmup(self, k, v):
        """Compile (by running them on the sink page 0) the store and load programs of every
        block size, so that no copy waits for a compile; returns the pool (k, v), donated."""
        size = 1
        while size <= self.max_block:
            pages = jnp.zeros(size, jnp.int32)
            block = jax.device_put(_gather_to(self._host)(k, v, pages, self.axis), self._device)
            k, v = _scatter(k, v, *block, jnp.arange(size, dtype=jnp.int32), pages, self.axis)
            size *= 2
        return jax.block_until_ready((k, v))

    def drop_queue(self) -> list[tuple[str, int]]:
        """Forget the queued copies; -> [(op, bytes)] of each, "store" or "load" (a load moves
        its block whole). A model-free replay times the copies by these instead of running them."""
        copies = [(op, block.nbytes) for op, block, _ in self._queue]
        self._queue.clear()
        return copies

    def wait(self) -> None:
        """Block until every store that has run has landed on the host (benchmarks)."""
        jax.block_until_ready([(b.k, b.v) for b in self._blocks.values() if b.k is not None])

    def free(self, ids: np.ndarray) -> None:
        """Drop host pages; a block's bytes go back to the budget with its last page (a queued
        copy that still reads the block keeps its arrays until it has run)."""
        for i in np.asarray(ids, np.int64).tolist():
            block = self._where.pop(i)[0]
            b = self._blocks[block]
            b.live -= 1
            if b.live == 0:
                del self._blocks[block]
                self.budget.used -= b.nbytes

    def clear(self) -> None:
        self.free(np.fromiter(self._where, np.int64, len(self._where)))

    def check(self) -> None:
        live: dict[int, int] = {}
        for block, _ in self._where.values():
            live[block] = live.get(block, 0) + 1
        assert live == {k: b.live for k, b in self._blocks.items()}, "block page counts drifted"
        assert all(b.live > 0 for b in self._blocks.values()), "an empty block is kept"
