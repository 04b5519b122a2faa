"""forkjax: many LoRA agents on one base model, sharing the KV cache of their common prefix."""

from forkjax.engine.engine import Engine

__all__ = ["Engine"]
