"""In-flight prefix sharing: which running request will compute, and insert, which page.

Requests admitted together that share a prefix nobody has cached yet should compute it once: the
first to be admitted leads, and every later one waits for the leader's chunks to enter the trees
(the engine inserts a prefill chunk's whole pages once its step is done) and then takes them over
as hits (`SeqCache.extend_hits`): a base hit under `forkkv` / `full_reuse` / `lrshared`, a full
hit for the same adapter under `prefix`, a full hit under `forkkv` with residual fan-out.

A page is named by a chain hash of the tokens up to its end (vLLM's block hashes) and by the pool
and namespace it goes to, so two requests name one page alike exactly when they would share it in
that tree. The leader registers every page of its prompt it will compute and no request admitted
before it has registered; a request waits before a page that a live request admitted before it
registered and has not inserted yet. Waits thus follow admission order and cannot form a cycle
(a request that waited for one pool's page of a leader that left could otherwise find that page
claimed by a later request waiting for its own pages of another pool): a wait ends when its
leader's chunk is inserted, or when the leader leaves (finishes, aborts, is preempted), and then
the follower computes and registers the page itself, taking it over from any later request.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable

import numpy as np

from forkjax.cache.policy import key_tokens

PageKey = tuple[str, Hashable, int]  # (pool, namespace, chain hash)


def page_hashes(tokens, page_size: int) -> list[int]:
    """Chain hashes of the whole pages of `tokens` (hash j covers tokens[:(j+1)·S])."""
    out = []
    data = np.asarray(tokens, np.int32)[: len(tokens) // page_size * page_size].tobytes()
    step = 4 * page_size
    h = 0
    for j in range(len(data) // step):
        h = hash((h, data[j * step:(j + 1) * step]))
        out.append(h)
    return out


def pool_namespaces(policy, seq) -> list[tuple[str, Hashable]]:
    """(pool, namespace) of each pool request `seq` uses under cache `policy`, in
    `DualRadixCache.match_all`'s order: the base, its own residual (if it keeps one), the
    fan-out residuals."""
    out = [("base", policy.base_ns(seq.adapter_key))]
    if policy.res_ns(seq.adapter_key) is not None:
        out.append(("res", policy.res_ns(seq.adapter_key)))
    out += [("res", policy.res_ns(key)) for key in seq.targets]
    return out


class InflightPages:
    """{page key: id of the running request that will insert it}, and what requests ask of it.
    A request carries `key_ns` (the (pool, namespace) of each pool it uses, base first:
    `pool_namespaces`); the chain hashes of its prompt's whole pages are computed here once."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.owner: dict[PageKey, int] = {}
        self._hashes: dict[int, list[int]] = {}  # request id -> chain hashes of its prompt's pages
        self._owned: dict[int, dict[PageKey, int]] = {}  # request id -> {key: page}
        self._rank: dict[int, int] = {}  # request id -> its place in admission order
        self._admitted = itertools.count()

    def register(self, seq, start: int, end: int) -> None:
        """Claim for `seq` the whole prompt pages in positions [start, end) that no request
        admitted before it claimed (the first call admits it: later ones rank after it)."""
        S = self.page_size
        hashes = self._prompt_hashes(seq)
        rank = self._rank.get(seq.id)
        if rank is None:
            rank = self._rank[seq.id] = next(self._admitted)
        mine = self._owned.setdefault(seq.id, {})
        for j in range(start // S, min(len(hashes), end // S)):
            for pool, ns in seq.key_ns:
                key = (pool, ns, hashes[j])
                owner = self.owner.get(key)
                if owner is not None and (owner == seq.id or self._rank[owner] < rank):
                    continue
                if owner is not None:  # a later request's: it waits for this one now
                    del self._owned[owner][key]
                self.owner[key] = seq.id
                mine[key] = j

    def pages_for(self, seq, pool: int, first: int) -> int:
        """Consecutive prompt pages from page `first` on of `seq`'s pool number `pool` that
        a request admitted before it will insert (for a waiting request, any running one)."""
        if not self.owner:
            return 0
        hashes = self._prompt_hashes(seq)
        kind, ns = seq.key_ns[pool]
        rank = self._rank.get(seq.id)
        count = 0
        for j in range(first, len(hashes)):
            owner = self.owner.get((kind, ns, hashes[j]))
            if owner is None or owner == seq.id or (rank is not None and self._rank[owner] > rank):
                break
            count += 1
        return count

    def wait_point(self, seq, start: int, end: int) -> int:
        """First position in [start, end) of a page that a request admitted before `seq` will
        insert, else end."""
        S = self.page_size
        hashes = self._prompt_hashes(seq)
        rank = self._rank[seq.id]
        for j in range(start // S, min(-(-end // S), len(hashes))):
            for pool, ns in seq.key_ns:
                owner = self.owner.get((pool, ns, hashes[j]))
                if owner is not None and self._rank[owner] < rank:
                    return max(j * S, start)
        return end

    def inserted(self, rid: int, num_pages: int) -> None:
        """Request `rid` inserted its first `num_pages` pages: others take them from the tree."""
        mine = self._owned.get(rid)
        if not mine:
            return
        for key in [key for key, page in mine.items() if page < num_pages]:
            del self.owner[key], mine[key]

    def forget(self, rid: int, pool_ns: tuple) -> None:
        """Request `rid` will not insert its pages of (pool, namespace) after all."""
        mine = self._owned.get(rid, {})
        for key in [key for key in mine if key[:2] == pool_ns]:
            del self.owner[key], mine[key]

    def release(self, rid: int) -> None:
        """Request `rid` left: its pages are nobody's now."""
        for key in self._owned.pop(rid, {}):
            del self.owner[key]
        self._hashes.pop(rid, None)
        self._rank.pop(rid, None)

    def _prompt_hashes(self, seq) -> list[int]:
        hashes = self._hashes.get(seq.id)
        if hashes is None:
            hashes = self._hashes[seq.id] = page_hashes(key_tokens(seq.prompt, seq.adapter_key),
                                                        self.page_size)
        return hashes

    def __len__(self) -> int:
        return len(self.owner)
