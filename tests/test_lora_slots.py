"""Adapter slots in the stacked projections: each write lands in its own A rows and B slot only,
the base rows never change, and unloading zeroes the slot (against numpy copies of the weights)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forkjax.config import ModelConfig
from forkjax.lora.slot_writer import write_slot
from forkjax.lora.slots import lora_modules, projection, slot_rank
from forkjax.lora.targets import TARGETS
from forkjax.models.builtin import BUILTIN_CONFIGS, load_builtin, random_adapter


def _arrays(model):
    """{(layer, module): (numpy copy of its stacked weight, of its B slots)}."""
    return {(i, m): (np.asarray(projection(model, m).weight[i]),
                     np.asarray(projection(model, m).lora_b[m][i]))
            for i in range(model.num_layers) for m in TARGETS}


def test_write_slot_touches_only_its_rows():
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-qwen2"])
    r = 8
    _, model = load_builtin("tiny-qwen2", num_slots=4, rank=r, dtype=jnp.float32)
    assert lora_modules(model) == TARGETS and slot_rank(model) == r
    before = _arrays(model)
    written = {1: random_adapter("one", cfg, 8, 16, TARGETS, seed=1),
               3: random_adapter("two", cfg, 4, 8, ("q_proj", "v_proj", "up_proj"), seed=2)}
    for slot, adapter in written.items():
        write_slot(model, slot, adapter)
    for (i, module), (w, b) in _arrays(model).items():
        proj = projection(model, module)
        for slot in range(4):
            start = proj.a_rows(module, slot)
            want_a = np.zeros((r, w.shape[1]), np.float32)  # slots 0 and 2 stay zero
            want_b = np.zeros(b.shape[1:], np.float32)
            if slot in written and (i, module) in written[slot].weights:
                wa, wb = written[slot].weights[(i, module)]
                want_a[:wa.shape[1]] = wa.T
                want_b[:wb.shape[0]] = wb
            np.testing.assert_array_equal(w[start:start + r], want_a)
            np.testing.assert_array_equal(b[slot], want_b)
        np.testing.assert_array_equal(w[:proj.out], before[(i, module)][0][:proj.out])  # base
    for slot in written:
        write_slot(model, slot, None)
    for key, (w, b) in _arrays(model).items():  # unloaded: as loaded
        np.testing.assert_array_equal(w, before[key][0])
        np.testing.assert_array_equal(b, before[key][1])


def test_slot_writer_images_are_pinned_and_follow_the_weights():
    """A registered adapter's slot image waits in pinned host memory (on a GPU); a write replaces
    the stacked LoRA arrays only (every projection's weight, or q|k|v's once, and every B); an
    adapter reloaded under its name with other weights is written with the new weights, not the
    old image."""
    from forkjax.lora.slot_writer import SlotWriter
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-qwen2"])
    _, model = load_builtin("tiny-qwen2", num_slots=3, rank=8, dtype=jnp.float32)
    writer = SlotWriter(model)
    old = random_adapter("agent", cfg, 8, 16, ("q_proj", "o_proj"), seed=1)
    writer.prepare(old)
    image = writer._images["agent"][1]
    assert sorted(image) == ["o_proj", "q_proj"]
    on_gpu = jax.default_backend() == "gpu"  # a CPU keeps them as numpy: its device memory is host memory
    assert all(x.sharding.memory_kind == "pinned_host" if on_gpu else isinstance(x, np.ndarray)
               for pair in image.values() for x in pair)
    assert writer.image_bytes("agent") == sum(x.nbytes for pair in image.values() for x in pair)
    leaves, treedef = jax.tree.flatten(nnx.state(model))
    written = writer.write(leaves, 2, old)
    replaced = [i for i, (a, b) in enumerate(zip(leaves, written)) if a is not b]
    assert len(replaced) == 4 + 7 and len(written) == len(leaves)  # qkv, o, gate_up, down; 7 B's
    new = random_adapter("agent", cfg, 8, 16, ("q_proj", "o_proj"), seed=2)
    nnx.update(model, jax.tree.unflatten(treedef, writer.write(written, 2, new)))
    proj = projection(model, "q_proj")
    start = proj.a_rows("q_proj", 2)
    np.testing.assert_array_equal(np.asarray(proj.weight[1])[start:start + 8], new.weights[(1, "q_proj")][0].T)


def _slots(num_slots, names, pinned=()):
    from forkjax.lora.peft import LoraAdapter
    from forkjax.lora.slots import AdapterSlots
    slots = AdapterSlots(num_slots)
    for n in names:
        slots.add(LoraAdapter(n, 4, 1.0, {}), pinned=n in pinned)
    return slots


def _slot_of(writes) -> dict:
    return {adapter.name: slot for slot, adapter in writes}


def test_adapter_slots_evict_the_least_recently_used_idle_adapter():
    """Two adapter slots (slot 0 is the base model's): a and b take them; a used again, so c
    evicts b; an adapter that a running request uses, or that the same request names, or a
    pinned one, never gives way, and where nothing can, acquire changes nothing."""
    slots = _slots(3, "abcde")
    assert _slot_of(slots.acquire(["a"])) == {"a": 1}
    assert _slot_of(slots.acquire(["b", None])) == {"b": 2}
    assert slots.acquire(["a"]) == [] and slots.acquire([None]) == []  # resident; the base needs none
    assert _slot_of(slots.acquire(["c"])) == {"c": 2} and slots.slot_by_name == {"a": 1, "c": 2}
    state = dict(slots.slot_by_name)
    assert slots.acquire(["d"], busy=lambda: {"a", "c"}) is None and slots.slot_by_name == state
    assert slots.acquire(["d", "e", "a"]) is None and slots.slot_by_name == state  # three at once
    assert _slot_of(slots.acquire(["d", "a"], busy=lambda: set())) == {"d": 2}  # a is named: c goes
    slots.remove("a")  # unloaded: its slot is free for the next one, nothing evicted
    assert _slot_of(slots.acquire(["e"])) == {"e": 1} and slots.slot_by_name == {"d": 2, "e": 1}


def test_pinned_adapters_and_adapters_loaded_later_share_the_slots():
    from forkjax.lora.peft import LoraAdapter
    slots = _slots(3, "ab", pinned="a")
    assert _slot_of(slots.acquire(["a"])) == {"a": 1} and _slot_of(slots.acquire(["b"])) == {"b": 2}
    slots.add(LoraAdapter("late", 4, 1.0, {}))  # loaded at run time, beyond the slots
    assert slots.slot_of("late") is None and not slots.in_slots(["late"])
    assert _slot_of(slots.acquire(["late"])) == {"late": 2}  # b gives way, the pinned a stays
    assert slots.acquire(["b"], busy=lambda: {"late"}) is None
    assert _slot_of(slots.acquire(["b"])) == {"b": 2} and slots.slot_of("a") == 1
