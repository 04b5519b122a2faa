"""Adapter slots on the device: N stacked LoRA weights per projection, slot 0 the bare base model,
and the loaded adapters on the host that take them (vLLM's `max_loras` / `max_cpu_loras`).

Where the slots lie in the model (`slot_rank`, `lora_modules`, `check_fits`); slot_writer.py
writes adapters into them.
"""

from __future__ import annotations

import collections

from forkjax.cache.policy import MAX_ALORA_TAG
from forkjax.lora.peft import LoraAdapter
from forkjax.lora.targets import BLOCK, TARGETS, holder_of

BASE_SLOT = 0


def projection(model, module: str):
    """The stacked `LoRALinear` that holds HF projection `module` (its arrays [L, ...]: every
    decoder layer's)."""
    return getattr(getattr(model.layers, BLOCK[module]), holder_of(module))


def slot_rank(model) -> int:
    """R: the rank every slot is padded to."""
    return projection(model, "k_proj").slots[1]


def lora_modules(model) -> tuple[str, ...]:
    """The projections of `model` that carry LoRA slots."""
    return tuple(m for m in TARGETS if m in projection(model, m).lora)


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


class AdapterSlots:
    """The loaded adapters (kept on the host, by name, with their content hashes) and the
    device slots they occupy. Slot 0 is the bare base model; slots 1 .. num_slots - 1 take
    adapters as requests need them (`acquire`), the least recently used one giving way, never
    one that a running request uses nor a pinned one (SGLang's `pinned`: it keeps its slot)."""

    def __init__(self, num_slots: int, max_cpu_loras: int | None = None):
        self.num_slots, self.max_cpu_loras = num_slots, max_cpu_loras
        self.by_name: dict[str, LoraAdapter] = {}  # every loaded adapter
        self.pinned: set[str] = set()
        self.slot_by_name: dict[str, int] = {}  # the adapters in device slots
        self._lru: collections.OrderedDict[str, None] = collections.OrderedDict()  # those, oldest use first
        # adapters written into a slot for a request (`swapped`), their (host, float32) bytes,
        # and the seconds steps waited for those writes
        self.swaps = self.swap_bytes = 0
        self.swap_s = 0.0
        # content hash -> its tag in the cache's keys (cache/policy.Activated), for every
        # Activated LoRA adapter ever added: a tag never names two adapters
        self.alora_tags: dict[str, int] = {}

    def check(self, name: str | None) -> None:
        if name is not None and name not in self.by_name:
            raise KeyError(f"unknown adapter {name!r} (loaded: {sorted(self.by_name)})")

    def key_of(self, name: str | None):
        """The adapter's cache identity (content hash; None for the bare base model)."""
        self.check(name)
        return None if name is None else self.by_name[name].content_hash

    def invocation_of(self, name: str | None) -> tuple[int, ...] | None:
        """An Activated LoRA adapter's invocation tokens; None for a plain one or the base model."""
        self.check(name)
        return None if name is None else self.by_name[name].invocation_tokens

    def slot_of(self, name: str | None) -> int | None:
        """The device slot `name` is in now (BASE_SLOT for None), None if it is on the host."""
        self.check(name)
        return BASE_SLOT if name is None else self.slot_by_name.get(name)

    def in_slots(self, names) -> bool:
        """Whether every adapter of `names` (None: the base model) is in a device slot."""
        return all(n is None or n in self.slot_by_name for n in names)

    def add(self, adapter: LoraAdapter, pinned: bool = False) -> None:
        """Register `adapter` (replacing one of its name, which leaves its slot: the caller has
        drained its requests); ValueError past `max_cpu_loras`, or if no slot would stay unpinned."""
        name = adapter.name
        if name not in self.by_name and self.max_cpu_loras is not None and len(self.by_name) >= self.max_cpu_loras:
            raise ValueError(f"{len(self.by_name)} adapters are loaded, max_cpu_loras={self.max_cpu_loras}: "
                             "unload one or raise max_cpu_loras")
        if pinned and len(self.pinned - {name}) >= self.num_slots - 2:
            raise ValueError(f"{len(self.pinned - {name})} of the {self.num_slots - 1} adapter slots are pinned: "
                             "one stays for the others; unpin one or raise max_loras")
        if adapter.invocation_tokens is not None and adapter.content_hash not in self.alora_tags:
            if len(self.alora_tags) >= MAX_ALORA_TAG:
                raise ValueError(f"{MAX_ALORA_TAG} Activated LoRA adapters were loaded into this "
                                 "engine, the most its cache keys can tell apart")
            self.alora_tags[adapter.content_hash] = len(self.alora_tags) + 1
        self.remove(name)
        self.by_name[name] = adapter
        if pinned:
            self.pinned.add(name)

    def remove(self, name: str) -> None:
        """Forget adapter `name` (nothing if it is not loaded); its slot is free."""
        self.by_name.pop(name, None)
        self.pinned.discard(name)
        self.slot_by_name.pop(name, None)
        self._lru.pop(name, None)

    def acquire(self, names, busy=frozenset) -> list[tuple[int, LoraAdapter]] | None:
        """Device slots for adapters `names` (None, the base model, needs none), evicting the
        least recently used adapters that are neither in `busy()` (the names running requests
        use: asked only when a swap is needed), in `names` nor pinned. -> the (slot, adapter)
        writes that put them there, or None, changing nothing, where they do not fit."""
        names = [n for n in dict.fromkeys(names) if n is not None]
        need = [n for n in names if n not in self.slot_by_name]
        if need:
            used = set(self.slot_by_name.values())
            free = [s for s in range(1, self.num_slots) if s not in used]
            keep = set(busy()) | set(names) | self.pinned
            evictable = [n for n in self._lru if n not in keep]
            if len(need) > len(free) + len(evictable):
                return None
            for victim in evictable[:max(0, len(need) - len(free))]:
                free.append(self.slot_by_name.pop(victim))
                del self._lru[victim]
        writes = []
        for n in need:
            slot = free.pop(0)
            self.slot_by_name[n] = slot
            writes.append((slot, self.by_name[n]))
        for n in names:
            self._lru[n] = None
            self._lru.move_to_end(n)
        return writes

    def swapped(self, writes, seconds: float) -> None:
        """Count `writes` (from `acquire`) that a request's start needed, done in `seconds`."""
        self.swaps += len(writes)
        self.swap_bytes += sum(adapter.nbytes for _, adapter in writes)
        self.swap_s += seconds
