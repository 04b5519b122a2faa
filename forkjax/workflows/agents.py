"""The benchmark's agents: one seeded random LoRA adapter per agent on q/k/v/o.

`lrshared` (LRAgent's BaseLRShared) caches the residual x·A once for every agent, which is exact
only when the agents share their A: for it the agents get one random A per layer and module,
shared, and each its own B. Every other policy gets independent adapters (own A and own B).
"""

from __future__ import annotations

from forkjax.config import ModelConfig
from forkjax.lora.peft import LoraAdapter
from forkjax.models.builtin import random_adapter

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def agent_adapters(cfg: ModelConfig, names, rank: int, *, shared_a: bool) -> dict[str, LoraAdapter]:
    """{name: rank-`rank` adapter (alpha 2·rank) seeded by its position in `names`}."""
    names = list(names)
    if rank < 1:
        raise ValueError(f"rank={rank!r}: expected >= 1")
    own = {name: random_adapter(name, cfg, rank, alpha=2 * rank, targets=ATTENTION, seed=i)
           for i, name in enumerate(names)}
    if not shared_a:
        return own
    first = own[names[0]].weights
    return {name: LoraAdapter(name, rank, a.scaling, {k: (first[k][0], b) for k, (_, b) in a.weights.items()})
            for name, a in own.items()}
