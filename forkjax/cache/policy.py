"""The four cache policies of DESIGN.md §2 as configurations of one pair of radix trees.

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
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


class _Shared:
    """Namespace of entries every adapter may read; a singleton so it never equals an adapter key."""

    def __repr__(self) -> str:
        return "SHARED"


SHARED = _Shared()


@dataclass(frozen=True)
class CachePolicy:
    name: str
    base_per_adapter: bool  # base tree keyed by (adapter, tokens) instead of tokens
    residual: str | None  # None: no residual pool; "per_adapter" or "shared"

    @property
    def uses_residual(self) -> bool:
        return self.residual is not None

    def base_ns(self, adapter_key: Hashable) -> Hashable:
        return adapter_key if self.base_per_adapter else SHARED

    def res_ns(self, adapter_key: Hashable) -> Hashable | None:
        """Residual namespace of a request, or None when the request keeps no residual."""
        if self.residual is None or adapter_key is None:
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
