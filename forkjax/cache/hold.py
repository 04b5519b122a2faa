"""PrefixHold: a soft lock on the cached prefix of some tokens in both trees.

A waiting request holds the cached prefix it will hit, so that admitting others never evicts it
(SGLang evicts by recency alone: a request about to reuse a prefix can lose it to a newcomer),
and its match lengths are what cache-aware admission orders and sizes requests by. A session that
ran recently holds the pages its last request left in the trees, so a workflow's prefix survives
its tool call (KVFlow's idea). Unlike a lock, a hold never stops eviction: held pages go last,
when nothing unheld is left; admission does not count them as room (admission.py says when an
older workflow may take a younger one's).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np


class PrefixHold:
    """`lengths`: cached tokens per namespace, in `DualRadixCache.match_all`'s order."""

    def __init__(self, cache, tokens, adapter_key: Hashable, fanout_keys=()):
        self.cache, self.adapter_key = cache, adapter_key
        self.fanout_keys = list(fanout_keys)
        self.tokens = np.asarray(tokens, np.int32)
        self.lengths: list[int] = []
        self._nodes: list = []  # [(tree, node)] held
        self._versions = None
        self.refresh()

    def refresh(self) -> bool:
        """Match again if either tree changed since the last match; True if it did."""
        versions = self.cache.versions
        if versions == self._versions:
            return False
        self.release()
        matches = self.cache.match_all(self.tokens, self.adapter_key, self.fanout_keys)
        self.lengths = [length for _, length, _ in matches]
        self._nodes = [(tree, node) for tree, _, node in matches]
        for tree, node in self._nodes:
            tree.inc_hold_ref(node)
        self._versions = self.cache.versions  # the match may split nodes, never version them
        return True

    def retire(self, beyond: int = 0) -> None:
        """Release, and tell the trees that nothing will ask for these paths again, or for the
        nodes of them that start at or after token `beyond` (`RadixTree.retire`)."""
        nodes = self._nodes
        self.release()
        for tree, node in nodes:
            tree.retire(node, beyond)

    def release(self) -> None:
        for tree, node in self._nodes:
            tree.dec_hold_ref(node)
        self._nodes = []
        self._versions = None
