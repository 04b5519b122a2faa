"""The gateway's choice of replica for a request, as SMG makes it (lightseekorg/smg,
model_gateway/src/policies/), for the model-free replay of several replicas (replicas.py):

* `hash` (SMG's `consistent_hashing` on `X-SMG-Routing-Key`, the workflow's id): a ring of
  VNODES positions a replica, each the first 8 bytes of a hash of "replica#vnode"; a key goes to
  the first position clockwise of its own hash. SMG hashes with blake3, this ring with blake2b
  (the standard library's): the same construction, other positions.
* `cache_aware` (SMG's approximate token tree, its gRPC path): a prefix tree of the token ids
  routed so far, each node marked with the replicas that were sent it. When the load (requests
  routed and not finished) is imbalanced, max − min > BALANCE_ABS and max > BALANCE_REL · min,
  the least loaded replica; otherwise the replica with the longest match if the match covers
  more than CACHE_THRESHOLD of the prompt, else the least loaded. The request's tokens then join
  the tree under the chosen replica. SMG's defaults; its tree matches whole pages, as here
  (PAGE tokens, a page a node keyed by the hash of the prefix up to it), and its eviction by
  tree size is left out (its default bound, 2^26 nodes, is not reached by these runs). Among
  replicas that share the longest match, the one sent it last.
* `round_robin`: the next replica in turn, one counter over every request (SMG's).

A request without a routing key hashes as the empty key (SMG would pick at random).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools

VNODES = 150  # SMG's VIRTUAL_NODES_PER_WORKER
CACHE_THRESHOLD, BALANCE_ABS, BALANCE_REL = 0.3, 64, 1.5  # SMG's cache_aware defaults
PAGE = 16  # tokens a node of the token tree

ROUTES = ("hash", "cache_aware", "round_robin")


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class HashRouter:
    """Consistent hashing of the routing key onto `n` replicas."""

    def __init__(self, n: int):
        ring = sorted((_hash64(f"replica-{r}#{v}"), r) for r in range(n) for v in range(VNODES))
        self.points, self.owners = [p for p, _ in ring], [r for _, r in ring]

    def route(self, key: str, prompt, loads) -> int:
        i = bisect.bisect_left(self.points, _hash64(key))
        return self.owners[i % len(self.points)]


class RoundRobinRouter:
    def __init__(self, n: int):
        self.turn = itertools.cycle(range(n))

    def route(self, key: str, prompt, loads) -> int:
        return next(self.turn)


class CacheAwareRouter:
    """SMG's cache_aware over token ids (the module docstring): `tree` maps the hash of every
    page-aligned prefix routed so far to {replica: when it was last sent it}."""

    def __init__(self, n: int):
        self.tree: dict[int, dict[int, int]] = {}
        self.sent = itertools.count()

    def route(self, key: str, prompt, loads) -> int:
        least = min(range(len(loads)), key=loads.__getitem__)
        nodes = self._prefixes(prompt)
        if max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads):
            chosen = least
        else:
            matched = 0  # pages of the longest prefix the tree holds
            while matched < len(nodes) and nodes[matched] in self.tree:
                matched += 1
            rate = matched * PAGE / len(prompt) if len(prompt) else 0.0
            if rate > CACHE_THRESHOLD:
                owners = self.tree[nodes[matched - 1]]
                chosen = max(owners, key=owners.__getitem__)
            else:
                chosen = least
        t = next(self.sent)
        for node in nodes:
            self.tree.setdefault(node, {})[chosen] = t
        return chosen

    @staticmethod
    def _prefixes(prompt) -> list[int]:
        """The hash of each whole page's prefix of `prompt` (token ids)."""
        out, h = [], 0
        for start in range(0, len(prompt) - PAGE + 1, PAGE):
            h = hash((h, tuple(prompt[start:start + PAGE])))
            out.append(h)
        return out


ROUTERS = {"hash": HashRouter, "cache_aware": CacheAwareRouter, "round_robin": RoundRobinRouter}


def make_router(route: str, n: int):
    """The router `route` (one of ROUTES) over `n` replicas: `route(key, prompt, loads) -> replica`."""
    if route not in ROUTERS:
        raise ValueError(f"route {route!r}: expected one of {', '.join(ROUTES)}")
    return ROUTERS[route](n)
