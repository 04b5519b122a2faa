"""Adapter slots in the stacked projections: each write lands in its own A rows and B slot only,
the base rows never change, and unloading zeroes the slot (against numpy copies of the weights)."""

import jax
import jax.numpy as jnp
import numpy as np

from forkjax.config import ModelConfig
from forkjax.lora.slot_writer import write_slot
from forkjax.lora.slots import _projection, lora_modules, slot_rank
from forkjax.lora.targets import TARGETS
from forkjax.models.builtin import BUILTIN_CONFIGS, load_builtin, random_adapter


def _arrays(model):
    """{(layer, module): (numpy copy of its stacked weight, of its B slots)}."""
    return {(i, m): (np.asarray(_projection(model, i, m).weight[...]),
                     np.asarray(_projection(model, i, m).lora_b[m][...]))
            for i in range(len(model.layers)) for m in TARGETS}


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
        proj = _projection(model, i, module)
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
    """A registered adapter's slot image waits in pinned host memory (on a GPU); a write replaces exactly
    the parameters it returns; an adapter reloaded under its name with other weights is written
    with the new weights, not the old image."""
    from forkjax.lora.slot_writer import SlotWriter
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-qwen2"])
    _, model = load_builtin("tiny-qwen2", num_slots=3, rank=8, dtype=jnp.float32)
    writer = SlotWriter(model)
    old = random_adapter("agent", cfg, 8, 16, ("q_proj", "o_proj"), seed=1)
    writer.prepare(model, old)
    image = writer._images["agent"][1]
    assert sorted(image) == ["o_proj", "q_proj"]
    on_gpu = jax.default_backend() == "gpu"  # a CPU keeps them as numpy: its device memory is host memory
    assert all(x.sharding.memory_kind == "pinned_host" if on_gpu else isinstance(x, np.ndarray)
               for pair in image.values() for x in pair)
    assert writer.image_bytes("agent") == sum(x.nbytes for pair in image.values() for x in pair)
    pairs = writer.write(model, 2, old)
    assert len(pairs) == len(writer._vars) and all(o is not n for o, n in pairs)
    new = random_adapter("agent", cfg, 8, 16, ("q_proj", "o_proj"), seed=2)
    writer.write(model, 2, new)
    proj = _projection(model, 1, "q_proj")
    start = proj.a_rows("q_proj", 2)
    np.testing.assert_array_equal(np.asarray(proj.weight[...])[start:start + 8], new.weights[(1, "q_proj")][0].T)
