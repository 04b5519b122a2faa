"""Adapter slots on the device: N stacked LoRA weights per projection, slot 0 the bare base model.

Loading an adapter writes its (zero-padded) A and B into one slot of every targeted projection
and zeros into the others, so a slot always holds exactly one adapter's function.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from forkjax.lora.peft import LoraAdapter
from forkjax.lora.targets import BLOCK, STACKED, TARGETS

BASE_SLOT = 0


def _projection(model, layer: int, module: str):
    """The `LoRALinear` of decoder layer `layer` that holds HF projection `module`."""
    holder = next((name for name, parts in STACKED.items() if module in parts), module)
    return getattr(getattr(model.layers[layer], BLOCK[module]), holder)


def slot_rank(model) -> int:
    """R: the rank every slot is padded to."""
    return _projection(model, 0, "k_proj").slots[1]


def lora_modules(model) -> tuple[str, ...]:
    """The projections of `model` that carry LoRA slots."""
    return tuple(m for m in TARGETS if m in _projection(model, 0, m).lora)


@functools.partial(jax.jit, donate_argnums=0)
def _set_rows(w, rows, start):
    """w[start : start + len(rows)] = rows, in place (w [X, ...] donated: a stacked projection's
    weight is up to a few hundred MB, and a copy per write would hold two models at once)."""
    return jax.lax.dynamic_update_slice_in_dim(w, rows.astype(w.dtype), start, axis=0)


def check_fits(model, adapter: LoraAdapter):
    """ValueError unless `adapter` fits the slots of `model` (rank and targeted projections)."""
    rank_cap = slot_rank(model)
    if adapter.rank > rank_cap:
        raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank {rank_cap}")
    modules = lora_modules(model)
    missing = sorted({m for (_, m) in adapter.weights} - set(modules))
    if missing:
        raise ValueError(f"adapter {adapter.name!r} targets {missing}, but this engine has LoRA "
                         f"slots only on {list(modules)} (lora_target_modules is set at start)")


def write_slot(model, slot: int, adapter: LoraAdapter | None):
    """Write `adapter` (None: zeros) into `slot` of every LoRA projection of `model`."""
    if slot == BASE_SLOT and adapter is not None:
        raise ValueError("slot 0 is reserved for the bare base model")
    if adapter is not None:
        check_fits(model, adapter)  # before anything is overwritten
    modules = lora_modules(model)
    for layer in range(len(model.layers)):
        for module in modules:
            proj = _projection(model, layer, module)
            w, b_all = proj.weight, proj.lora_b[module]
            rank = proj.slots[1]
            a = np.zeros((rank, w.get_value().shape[1]), np.float32)  # A^T: R rows of the weight
            b = np.zeros((1,) + b_all.shape[1:], np.float32)
            if adapter is not None and (layer, module) in adapter.weights:
                wa, wb = adapter.weights[(layer, module)]  # [in, r], [r, out]
                a[:wa.shape[1]] = wa.T
                b[0, :wb.shape[0]] = wb
            w.set_value(_set_rows(w.get_value(), jnp.asarray(a), proj.a_rows(module, slot)))
            b_all.set_value(_set_rows(b_all.get_value(), jnp.asarray(b), slot))


class AdapterSlots:
    """Host map name -> slot with the adapters' identities (their content hashes)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.by_name: dict[str, tuple[int, LoraAdapter]] = {}

    def slot_of(self, name: str | None) -> int:
        if name is None:
            return BASE_SLOT
        if name not in self.by_name:
            raise KeyError(f"unknown adapter {name!r} (loaded: {sorted(self.by_name)})")
        return self.by_name[name][0]

    def key_of(self, name: str | None):
        """The adapter's cache identity (content hash; None for the bare base model)."""
        return None if name is None else self.by_name[name][1].content_hash

    def assign(self, adapter: LoraAdapter) -> int:
        """Slot for `adapter`: its old slot when replacing a name, else a free one."""
        if adapter.name in self.by_name:
            return self.by_name[adapter.name][0]
        used = {s for s, _ in self.by_name.values()}
        free = [s for s in range(1, self.num_slots) if s not in used]
        if not free:
            raise ValueError(f"all {self.num_slots - 1} adapter slots are in use; unload one "
                             "or raise max_loras")
        return free[0]

    def put(self, slot: int, adapter: LoraAdapter):
        self.by_name[adapter.name] = (slot, adapter)

    def remove(self, name: str) -> int:
        return self.by_name.pop(name)[0]
