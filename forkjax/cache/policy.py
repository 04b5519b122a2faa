"""The four cache policies (docs/design.md, Policies) as configurations of one pair of radix
trees.

A policy only decides which *namespace* a request's tokens are looked up in, per tree:

| policy       | base tree namespace | residual tree namespace |
|--------------|---------------------|-------------------------|
| `prefix`     | adapter             | none (no residual pool) |
| `full_reuse` | SHARED              | none (no residual pool) |
| `forkkv`     | SHARED              | adapter                 |
| `lrshared`   | SHARED              | SHARED                  |

The bare base model (adapter key None) never has a residual: its LoRA term is zero, so the kernel
gets `b_k = b_v = 0` for it and whatever its residual page table points at is multiplied by zero.
It therefore takes no residual pages under any policy; under `prefix` it has its own namespace
(None) in the base tree like any adapter.

A request's `cache_salt` wraps its key (`Salted`): each of its namespaces is then the unsalted one
within that salt, so requests of different salts share no page in either tree, under every
policy, and requests of one salt share exactly as the table says.

An Activated LoRA request (`Activated`: its adapter acts from its invocation on) keeps merged
K/V in the base tree and no residual, under every policy. Its tokens before the invocation are
the base model's own K/V, so it reads and writes them in the namespace of exact base-model
pages: the bare base model's under `prefix`, EXACT under the others (whose SHARED namespace
holds pages computed from other adapters' hidden states). Its tokens from the invocation on are
its adapter's: their keys are tagged with the adapter (`key_tokens`), so they branch off the
base path there, and only requests of that adapter with the same invocation position meet them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np


class _Shared:
    """Namespace of entries every adapter may read; a singleton so it never equals an adapter key."""

    def __repr__(self) -> str:
        return "SHARED"


SHARED = _Shared()


class _Exact:
    """Namespace of base-model K/V computed from base-model hidden states alone (aLoRA's)."""

    def __repr__(self) -> str:
        return "EXACT"


EXACT = _Exact()

# An Activated LoRA token's key: -(tag·2^TOKEN_BITS + token) - 1, never a token id.
TOKEN_BITS = 18
MAX_ALORA_TAG = (2**31 - 1) >> TOKEN_BITS  # tags 1 .. this fit an int32 key


@dataclass(frozen=True)
class Activated:
    """An Activated LoRA request's cache key: adapter `key` acting from position `start` on
    (its invocation's first token), `tag` (1 .. MAX_ALORA_TAG) a number no other aLoRA adapter
    of the engine has."""
    key: Hashable
    tag: int
    start: int


@dataclass(frozen=True)
class Salted:
    """A cache key or namespace within one `cache_salt`."""
    salt: str
    key: Hashable


def salted(key: Hashable, salt: str | None) -> Hashable:
    """A request's cache key: its adapter's key, within `salt` when it has one."""
    return key if salt is None else Salted(salt, key)


def unsalted(key: Hashable) -> Hashable:
    return key.key if isinstance(key, Salted) else key


def agent_key(key: Hashable) -> Hashable:
    """A request's cache key less what is the request's own (an Activated LoRA request's
    invocation position: `start` -1): its agent's identity across a workflow's turns."""
    if isinstance(key, Salted):
        return Salted(key.salt, agent_key(key.key))
    return Activated(key.key, key.tag, -1) if isinstance(key, Activated) else key


def shared_part(tokens, key: Hashable):
    """What of a request's tokens another request of its agent may reuse however it goes on:
    an Activated LoRA request's path up to its invocation (a later turn that invokes the adapter
    again leaves it there), every token of another's."""
    act = unsalted(key)
    return tokens[:act.start] if isinstance(act, Activated) else tokens


def key_tokens(tokens, adapter_key: Hashable) -> np.ndarray:
    """The radix-tree key [len(tokens)] int32 of a request's tokens: the tokens, but for an
    Activated LoRA request those from its invocation on tagged with its adapter (a key passes
    through unchanged)."""
    tokens = np.asarray(tokens, np.int32)
    act = unsalted(adapter_key)
    if not isinstance(act, Activated) or act.start >= len(tokens):
        return tokens
    out = tokens.copy()
    tail = tokens[act.start:]
    out[act.start:] = np.where(tail >= 0, -((act.tag << TOKEN_BITS) | tail) - 1, tail)
    return out


@dataclass(frozen=True)
class CachePolicy:
    name: str
    base_per_adapter: bool  # base tree keyed by (adapter, tokens) instead of tokens
    residual: str | None  # None: no residual pool; "per_adapter" or "shared"

    @property
    def uses_residual(self) -> bool:
        return self.residual is not None

    def base_ns(self, adapter_key: Hashable) -> Hashable:
        if isinstance(adapter_key, Salted):
            return Salted(adapter_key.salt, self.base_ns(adapter_key.key))
        if isinstance(adapter_key, Activated):
            return None if self.base_per_adapter else EXACT
        return adapter_key if self.base_per_adapter else SHARED

    def res_ns(self, adapter_key: Hashable) -> Hashable | None:
        """Residual namespace of a request, or None when the request keeps no residual."""
        if isinstance(adapter_key, Salted):
            ns = self.res_ns(adapter_key.key)
            return None if ns is None else Salted(adapter_key.salt, ns)
        if self.residual is None or adapter_key is None or isinstance(adapter_key, Activated):
            return None
        return adapter_key if self.residual == "per_adapter" else SHARED


POLICIES = {
    "prefix": CachePolicy("prefix", base_per_adapter=True, residual=None),
    "full_reuse": CachePolicy("full_reuse", base_per_adapter=False, residual=None),
    "forkkv": CachePolicy("forkkv", base_per_adapter=False, residual="per_adapter"),
    "lrshared": CachePolicy("lrshared", base_per_adapter=False, residual="shared"),
}


def get_policy(policy: str | CachePolicy) -> CachePolicy:
    if isinstance(policy, CachePolicy):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown cache_policy {policy!r}; expected one of {sorted(POLICIES)}") from None
