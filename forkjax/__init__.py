"""forkjax: many LoRA agents on one base model, sharing the KV cache of their common prefix."""

from importlib import metadata
from pathlib import Path

__all__ = ["Engine", "__version__"]


def _version() -> str:
    """pyproject.toml's version: from the installed metadata, else (a checkout on PYTHONPATH,
    not installed) from the file itself."""
    try:
        return metadata.version("forkjax")
    except metadata.PackageNotFoundError:
        import tomllib
        with open(Path(__file__).parent.parent / "pyproject.toml", "rb") as f:
            return tomllib.load(f)["project"]["version"]


__version__ = _version()


def __getattr__(name):
    # Lazy: `import forkjax.cache` (host bookkeeping) must not pull in the models and kernels.
    if name == "Engine":
        from forkjax.engine.engine import Engine
        return Engine
    raise AttributeError(f"module 'forkjax' has no attribute {name!r}")
