"""forkjax: many LoRA agents on one base model, sharing the KV cache of their common prefix."""

__all__ = ["Engine"]


def __getattr__(name):
    # Lazy: `import forkjax.cache` (host bookkeeping) must not pull in the models and kernels.
    if name == "Engine":
        from forkjax.engine.engine import Engine
        return Engine
    raise AttributeError(f"module 'forkjax' has no attribute {name!r}")
