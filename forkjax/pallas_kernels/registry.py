"""The backend registry of a kernel op: its implementations by name, the order automatic choice
tries them in, and what each supports. Each op's `api.py` builds one and is the only caller.

    backend=None       the first backend in `order` whose `automatic(call)` holds
    backend="<name>"   that backend, or a ValueError when the op has none of that name or its
                       `supports(call)` does not hold

`supports` says whether a backend can run a call at all (shapes, dtypes); `automatic` adds where
automatic choice prefers it (e.g. a GPU, compiled, untuned), and is `supports` unless given.
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
    tuned: bool = False  # Triton tuning arguments were given
    gpu: bool = dataclasses.field(default_factory=on_gpu)  # jax's default backend is a GPU

    def __str__(self):
        facts = " ".join(f"{k}={v}" for k, v in self.facts.items())
        return (f"{facts} (interpret={self.interpret}, tuned={self.tuned}, "
                f"gpu={self.gpu})").lstrip()


def everything(call: Call) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Backend:
    run: Callable
    supports: Callable[[Call], bool] = everything
    automatic: Callable[[Call], bool] | None = None  # None: `supports`


class Registry:
    def __init__(self, op: str, order: tuple[str, ...], **backends: Backend):
        if not set(order) <= set(backends):
            raise ValueError(f"{op}: order {order} names a backend it does not have")
        self.op, self.order, self.backends = op, order, backends

    def choose(self, backend: str | None, call: Call) -> str:
        """The name of the backend that runs `call` (see the module docstring)."""
        if backend is None:
            for name in self.order:
                b = self.backends[name]
                if (b.automatic or b.supports)(call):
                    return name
            raise ValueError(f"{self.op}: no backend of {self.order} takes {call}")
        if backend not in self.backends:
            raise ValueError(f"{self.op}: backend must be None or one of "
                             f"{', '.join(map(repr, self.backends))}, not {backend!r}")
        if not self.backends[backend].supports(call):
            raise ValueError(f"{self.op}: backend {backend!r} does not support {call}")
        return backend

    def __call__(self, backend: str | None, call: Call) -> Callable:
        """The chosen backend's implementation."""
        return self.backends[self.choose(backend, call)].run
