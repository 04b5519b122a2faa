"""The host-memory tier of one device page pool, its bookkeeping: pages written back from the
device are kept in blocks of host memory, and copied into device pages again on a hit. The
copies leave as plain data (`take_copies`); the runtime runs them (runtime/host_blocks.py, in
pinned host memory).

    base pool      K, V [L, Hkv, P, S, D]   page axis 2
    residual pool  K, V [L, P, S, R]        page axis 1

Pages move in blocks: a store of n pages cuts them into blocks of at most `max_block` pages
(`MAX_BLOCK_BYTES`) and the rest into blocks of its binary digits (13 pages: 8, 4 and 1),
and each block moves in one transfer; a block stays as it is until every page of it is freed.
Block sizes are powers of two up to `max_block`, so the runtime's programs are few and no host
byte is padding. A load copies each block it needs back whole and writes the pages it wants
(the others into the sink page 0). Large copies are what run near the link's rate: on the H200
a 1 GB `pinned_host` array moves at ~49 GB/s each way, pageable numpy at 4-7 GB/s to the device
and ~1.3 GB/s back.

The copies run in the order they were queued, before the next step: a store of pages that a
load of the same round then overwrites has read them first, and a block freed after a load was
queued is dropped after that load has run.

Host page ids are this pool's own (1, 2, ...; 0 is never one). The bytes of live blocks count
against a `HostBudget` that the pools of one cache share.
"""

from __future__ import annotations

import dataclasses

import numpy as np


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


@dataclasses.dataclass
class _Block:
    nbytes: int
    live: int  # its pages not freed yet


# A queued copy: ("store", block id, device pages [n] int32): the pages into a new host block of
# n (a power of two) pages; ("load", block id, [2, n] int32): the block's pages idx[0] into device
# pages idx[1] (0, the sink, for the pages not wanted); ("free", block id, None): the block's
# host memory may go.
HostCopy = tuple


class HostPagePool:
    """The host pages of one device pool; `page_bytes`: K and V of one page.

    `store`, `load` and `free` decide on the spot (host page ids, budget) and queue the copies,
    which `take_copies` hands to the runtime."""

    def __init__(self, page_bytes: int, budget: HostBudget, device_pages: int | None = None):
        self.page_bytes, self.budget = page_bytes, budget
        most = max(1, min(MAX_BLOCK_BYTES // page_bytes, device_pages or MAX_BLOCK_BYTES))
        self.max_block = 1 << (most.bit_length() - 1)  # no store is larger than the device pool
        self._blocks: dict[int, _Block] = {}
        self._where: dict[int, tuple[int, int]] = {}  # host page id -> (block id, offset)
        self._queue: list[HostCopy] = []
        self._next_page = self._next_block = 1
        self.bytes_stored = self.bytes_loaded = 0

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
            self._blocks[self._next_block] = _Block(size * self.page_bytes, size)
            self._queue.append(("store", self._next_block, pages[start:start + size]))
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
            self._queue.append(("load", block, idx))
        self.bytes_loaded += len(ids) * self.page_bytes

    def take_copies(self) -> list[HostCopy]:
        """The queued copies, in order, for the runtime to run before the next step."""
        copies, self._queue = self._queue, []
        return copies

    def drop_queue(self) -> list[tuple[str, int]]:
        """Forget the queued copies; -> [(op, bytes)] of each store and load (a load moves its
        block whole). A model-free replay times the copies by these instead of running them."""
        return [(op, idx.shape[-1] * self.page_bytes) for op, _, idx in self.take_copies() if op != "free"]

    def free(self, ids: np.ndarray) -> None:
        """Drop host pages; a block's bytes go back to the budget with its last page (the
        runtime drops its memory once the copies queued before have run)."""
        for i in np.asarray(ids, np.int64).tolist():
            block = self._where.pop(i)[0]
            b = self._blocks[block]
            b.live -= 1
            if b.live == 0:
                del self._blocks[block]
                self.budget.used -= b.nbytes
                self._queue.append(("free", block, None))

    def clear(self) -> None:
        self.free(np.fromiter(self._where, np.int64, len(self._where)))

    def check(self) -> None:
        live: dict[int, int] = {}
        for block, _ in self._where.values():
            live[block] = live.get(block, 0) + 1
        assert live == {k: b.live for k, b in self._blocks.items()}, "block page counts drifted"
        assert all(b.live > 0 for b in self._blocks.values()), "an empty block is kept"
