"""Activated LoRA (aLoRA, arXiv 2504.12397; PEFT's `alora_invocation_tokens`): an adapter that
acts only from the start of the last occurrence of its invocation tokens in the prompt on, and
on every generated token. Before that a request computes the base model's own K/V, which the
cache shares exactly between the base model and every aLoRA agent (cache/policy.py,
`Activated`); the model applies the adapter per token (lora/batched.py, `token_slots`).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from forkjax.cache.policy import Activated


def invocation_start(prompt, invocation: tuple[int, ...]) -> int:
    """The first position of the last occurrence of `invocation` in `prompt` (PEFT's
    `calculate_alora_offsets` rule), -1 where it does not occur."""
    ids, inv = np.asarray(prompt, np.int64), np.asarray(invocation, np.int64)
    if len(inv) == 0 or len(ids) < len(inv):
        return -1
    windows = np.lib.stride_tricks.sliding_window_view(ids, len(inv))  # [len - n + 1, n]
    hits = np.flatnonzero((windows == inv).all(axis=1))
    return int(hits[-1]) if hits.size else -1


def named_key(name: str | None, prompt, invocations: dict) -> Hashable:
    """A request's cache key where adapters are told apart by name (the workflow replay's, and
    `prefill_tokens_minimal`'s): `name`, or for an Activated LoRA agent of `invocations` {name:
    token ids} its `Activated` key (tags by sorted name). ValueError where the prompt lacks the
    invocation."""
    if name not in invocations:
        return name
    start = invocation_start(prompt, invocations[name])
    if start < 0:
        raise ValueError(f"adapter {name!r}: the prompt lacks its invocation {list(invocations[name])}")
    return Activated(name, sorted(invocations).index(name) + 1, start)
