"""The benchmark's agents: one seeded random LoRA adapter per agent on q/k/v/o, or an Activated
LoRA adapter (`alora`) with a seeded random invocation of its own (`agent_invocations`).

`lrshared` (LRAgent's BaseLRShared) caches the residual x·A once for every agent, which is exact
only when the agents share their A: for it the agents get one random A per layer and module,
shared, and each its own B. Every other policy gets independent adapters (own A and own B).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from forkjax.config import ModelConfig
from forkjax.lora.peft import LoraAdapter
from forkjax.models.builtin import random_adapter
from forkjax.workflows.base import TokenSampler

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
INVOCATION_TOKENS = 4


def agent_invocations(cfg: ModelConfig, names) -> dict[str, tuple[int, ...]]:
    """{name: INVOCATION_TOKENS ordinary token ids}, seeded by its position in `names`."""
    tokens = TokenSampler.for_model(cfg)
    return {name: tuple(tokens.draw(np.random.default_rng((7, i)), INVOCATION_TOKENS))
            for i, name in enumerate(names)}


def agent_adapters(cfg: ModelConfig, names, rank: int, *, shared_a: bool,
                   alora: bool = False) -> dict[str, LoraAdapter]:
    """{name: rank-`rank` adapter (alpha 2·rank) seeded by its position in `names`}; `alora`:
    each an Activated LoRA adapter of its `agent_invocations`."""
    names = list(names)
    if rank < 1:
        raise ValueError(f"rank={rank!r}: expected >= 1")
    own = {name: random_adapter(name, cfg, rank, alpha=2 * rank, targets=ATTENTION, seed=i)
           for i, name in enumerate(names)}
    if alora:
        invocations = agent_invocations(cfg, names)
        own = {name: dataclasses.replace(a, invocation_tokens=invocations[name]) for name, a in own.items()}
    if not shared_a:
        return own
    first = own[names[0]].weights
    return {name: LoraAdapter(name, rank, a.scaling, {k: (first[k][0], b) for k, (_, b) in a.weights.items()})
            for name, a in own.items()}
