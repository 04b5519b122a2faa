"""A layer's K/V cache writes (reference.py's `write_kv` is the contract), and the only module that
picks the backend that runs them (registry.py).

Backends, by name:
    "mosaic"     mosaic.py: one Mosaic GPU kernel for all four pools, in place
    "reference"  reference.py's `write_kv`: one XLA scatter per pool

backend=None (automatic): "mosaic" where jax runs on a GPU, compiled (interpret=False), and
`mosaic.supports(pools)` (rows of 16-byte multiples); else "reference" (also on the CPU with
interpret=True: the engine's kernel path off a GPU writes with XLA's scatters).
interpret=None: interpreted where jax has no GPU.
"""

from __future__ import annotations

import functools

import jax

from forkjax.pallas_kernels.kv_write import mosaic
from forkjax.pallas_kernels.kv_write import KVPools
from forkjax.pallas_kernels.kv_write.reference import write_kv
from forkjax.pallas_kernels.registry import Backend, Call, Registry
from forkjax.pallas_kernels.tuning import on_gpu

__all__ = ["kv_write", "kv_writer", "backend_for", "BACKENDS"]


def _supports(call: Call) -> bool:
    return mosaic.supports(call.facts["pools"])


BACKENDS = Registry(
    "kv_write", ("mosaic", "reference"),
    mosaic=Backend(mosaic.kv_write, _supports,
                   lambda call: call.gpu and not call.interpret and _supports(call)),
    reference=Backend(write_kv))


def _call(pools: KVPools, interpret: bool | None) -> Call:
    shapes = KVPools(*(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pools))
    return Call(interpret=not on_gpu() if interpret is None else interpret,
                facts={"pools": shapes})


def backend_for(pools: KVPools, *, backend: str | None = None,
                interpret: bool | None = False) -> str:
    """The name of the backend that writes into these pools."""
    return BACKENDS.choose(backend, _call(pools, interpret))


def kv_writer(pools: KVPools, *, backend: str | None = None, interpret: bool | None = False):
    """The function that writes into these pools: `write_kv`'s signature,
    (pools, layer, base_slots, res_slots, k, v, xa_k=None, xa_v=None) -> pools."""
    call = _call(pools, interpret)
    name = BACKENDS.choose(backend, call)
    if name == "mosaic" and call.interpret:
        return functools.partial(mosaic.kv_write, interpret=True)
    return BACKENDS.backends[name].run


def kv_write(pools: KVPools, layer, base_slots, res_slots, k, v, xa_k=None, xa_v=None, *,
             backend: str | None = None, interpret: bool | None = False) -> KVPools:
    """Write one layer's new tokens into the pools (the sink page 0 takes what must not be
    written) -> the pools.

    pools     base [L, Hkv, P, S, D], residual [L, Pr, S, R]; donated to the Mosaic kernel,
              which writes them in place
    layer     int or int32 scalar
    base_slots [T] int32 page * S + offset, 0: do not write
    res_slots [T] or [T, J] int32 (J residual rows a token: its own, then residual fan-out's)
    k, v      [T, Hkv, D];  xa_k, xa_v [T, R] or [T, J, R], or None: residual pools untouched
    """
    write = kv_writer(pools, backend=backend, interpret=interpret)
    return write(pools, layer, base_slots, res_slots, k, v, xa_k, xa_v)
