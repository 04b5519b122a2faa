"""The backend registry of a kernel op: its implementations by name, the order automatic choice
tries them in, what each supports and the config class each takes. Each op's `api.py` builds one
and is the only caller.

    backend=None       the first backend in `order` whose `automatic(call)` holds; with a
                       config, the backend that takes its class
    backend="<name>"   that backend, or a ValueError when the op has none of that name, the
                       call's config is not of the class it takes, or its `supports(call)` does
                       not hold

`supports` says whether a backend can run a call at all (shapes, dtypes, its config); `automatic`
adds where automatic choice prefers it (e.g. a GPU, compiled), and is `supports` unless given.
Both see only static facts of the call (`Call`), known when it is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from forkjax.pallas_kernels.tuning import on_gpu


@dataclasses.dataclass(frozen=True)
class Call:
    """What the checks see of one call."""
    interpret: bool  # kernels run in Pallas' interpreter
    facts: dict = dataclasses.field(default_factory=dict)  # shapes, dtypes: the op's api.py's
    config: object = None  # the kernel options given (a backend's config class), or None
    gpu: bool = dataclasses.field(default_factory=on_gpu)  # jax's default backend is a GPU

    def __str__(self):
        facts = " ".join(f"{k}={v}" for k, v in self.facts.items())
        config = "" if self.config is None else f"{self.config}, "
        return f"{facts} ({config}interpret={self.interpret}, gpu={self.gpu})".lstrip()


def everything(call: Call) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Backend:
    run: Callable
    supports: Callable[[Call], bool] = everything
    automatic: Callable[[Call], bool] | None = None  # None: `supports`
    config: type | None = None  # the config class `run` takes (config=); None: it takes none


class Registry:
    def __init__(self, op: str, order: tuple[str, ...], **backends: Backend):
        if not set(order) <= set(backends):
            raise ValueError(f"{op}: order {order} names a backend it does not have")
        self.op, self.order, self.backends = op, order, backends

    def choose(self, backend: str | None, call: Call) -> str:
        """The name of the backend that runs `call` (see the module docstring)."""
        if backend is not None and backend not in self.backends:
            raise ValueError(f"{self.op}: backend must be None or one of "
                             f"{', '.join(map(repr, self.backends))}, not {backend!r}")
        if call.config is not None:
            backend = self._configured(backend, call.config)
        if backend is None:
            for name in self.order:
                b = self.backends[name]
                if (b.automatic or b.supports)(call):
                    return name
            raise ValueError(f"{self.op}: no backend of {self.order} takes {call}")
        if not self.backends[backend].supports(call):
            raise ValueError(f"{self.op}: backend {backend!r} does not support {call}")
        return backend

    def _configured(self, backend: str | None, config) -> str:
        """The backend a config is for: the one named, which must take its class, or (None) the
        one that does."""
        takes = [name for name, b in self.backends.items()
                 if b.config is not None and isinstance(config, b.config)]
        kind = type(config).__name__
        if backend is None and takes:
            return takes[0]
        if backend is None:
            raise ValueError(f"{self.op}: no backend takes a {kind}")
        if backend not in takes:
            wanted = self.backends[backend].config
            raise ValueError(f"{self.op}: backend {backend!r} takes "
                             f"{'no config' if wanted is None else 'a ' + wanted.__name__}, "
                             f"not a {kind}")
        return backend

    def __call__(self, backend: str | None, call: Call) -> Callable:
        """The chosen backend's implementation."""
        return self.backends[self.choose(backend, call)].run
