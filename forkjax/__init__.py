"""forkjax: many LoRA agents on one base model, sharing the KV cache of their common prefix."""

from importlib import metadata

__all__ = ["Engine", "__version__"]
__version__ = metadata.version("forkjax")  # pyproject.toml's


def __getattr__(name):
    # Lazy: `import forkjax.cache` (host bookkeeping) must not pull in the models and kernels.
    if name == "Engine":
        from forkjax.engine.engine import Engine
        return Engine
    raise AttributeError(f"module 'forkjax' has no attribute {name!r}")
