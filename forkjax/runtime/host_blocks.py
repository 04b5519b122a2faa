"""The host tier's memory and copies (its bookkeeping: cache/host_pool.py): blocks of pages in
pinned host memory (jax memory kind `pinned_host`), written from and read back into a device
pool by the copies the cache queued.

A store gathers a block's pages into one contiguous device buffer and copies it to the host in
the same program (a jitted gather whose output lives in host memory); a load copies a block back
whole and scatters its pages into their device pages (a jitted scatter that donates the pool:
one program a block size, and device-local bytes are cheap beside the link's).

Every copy is dispatched, not waited for (`execute`, before a step): the gather reads the pool as
the steps dispatched before it left it, and the scatter's pool is the one the next step reads,
so a page is never read before its copy lands nor overwritten before its store has read it (JAX
orders work on a buffer by dispatch), and the copies overlap the steps in flight.
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp

from forkjax.cache.host_pool import MAX_BLOCK_BYTES, HostBudget, HostCopy

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


class HostBlocks:
    """The host blocks of one device pool (`axis`: its page axis, 2 for base K/V [L, Hkv, P, S,
    D], 1 for the residual's [L, P, S, R]), by the cache's block ids; `max_block`: the largest
    block in pages (the cache's `HostPagePool.max_block`)."""

    def __init__(self, axis: int, max_block: int = 1, device=None):
        self.axis, self.max_block = axis, max_block
        device = device or jax.devices()[0]
        self._device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        self._host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        self._blocks: dict[int, tuple[jax.Array, jax.Array]] = {}  # block id -> its (K, V) pages
        self.load_stall_s = 0.0  # host seconds steps waited while loads were issued

    def execute(self, copies: list[HostCopy], k, v):
        """Run `copies` (cache/host_pool.py), in order, on the pool (k, v), which is donated;
        returns the new (k, v)."""
        for op, block, idx in copies:
            if op == "store":
                self._blocks[block] = _gather_to(self._host)(k, v, jnp.asarray(idx), self.axis)
            elif op == "load":
                t = time.perf_counter()
                block_k, block_v = jax.device_put(self._blocks[block], self._device)
                k, v = _scatter(k, v, block_k, block_v, jnp.asarray(idx[0]), jnp.asarray(idx[1]), self.axis)
                self.load_stall_s += time.perf_counter() - t
            else:
                del self._blocks[block]
        return k, v

    def warmup(self, k, v):
        """Compile (by running them on the sink page 0) the store and load programs of every
        block size up to `max_block`, so that no copy waits for a compile; returns the pool
        (k, v), donated."""
        size = 1
        while size <= self.max_block:
            pages = jnp.zeros(size, jnp.int32)
            block = jax.device_put(_gather_to(self._host)(k, v, pages, self.axis), self._device)
            k, v = _scatter(k, v, *block, jnp.arange(size, dtype=jnp.int32), pages, self.axis)
            size *= 2
        return jax.block_until_ready((k, v))

    def wait(self) -> None:
        """Block until every store that has run has landed on the host (benchmarks)."""
        jax.block_until_ready(list(self._blocks.values()))

    def __len__(self) -> int:
        return len(self._blocks)
