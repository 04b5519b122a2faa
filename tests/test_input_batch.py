"""A step's inputs packed into one int32 buffer (runtime/input_batch.py): every field lands where
the program reads it (`InputLayout.unpack`), against a row-by-row fill written here in numpy, for
decode and extend batches. Random rows: page tables of any length, PENDING tokens, fan-out.
(Decode rows kept across steps: test_decode_rows.py.)"""

import numpy as np
import pytest

from forkjax.runtime.batch import PENDING, BatchRow, ScheduledBatch
from forkjax.runtime.input_batch import InputLayout, build_inputs
from forkjax.sampling_params import SamplingParams


def _rows(rng, n, chunk, fan_slots=(), w=6):
    rows = []
    for i in range(n):
        length = 1 if chunk == 1 else int(rng.integers(1, chunk + 1))
        start = int(rng.integers(0, 40))
        tokens = rng.integers(3, 100, length).astype(np.int32)
        if length == 1 and rng.random() < 0.5:
            tokens[0] = PENDING
        pages = int(rng.integers(1, w + 1))
        rows.append(BatchRow(
            start, start + length, tokens, int(rng.integers(0, n)), rng.integers(0, 64, length).astype(np.int32),
            rng.integers(0, 64, length).astype(np.int32),
            {s: rng.integers(0, 64, length).astype(np.int32) for s in fan_slots},
            rng.permutation(40)[:pages].astype(np.int32), rng.permutation(40)[:pages].astype(np.int32),
            int(rng.integers(0, 4)), int(rng.integers(-1, 40)), SamplingParams(), 0))
    return sorted(rows, key=lambda r: r.adapter_slot)


def _expected(rows, layout):
    """Each field as the step program must see it, filled row by row."""
    b, c, t = layout.b, layout.c, layout.b * layout.c
    want = {name: np.zeros(shape, np.int32) for name, shape in layout.fields()}
    want["prev_rows"][:] = want["lora_starts"][:] = -1
    for i, r in enumerate(rows):
        n = r.end - r.start
        at = slice(i * c, i * c + n)
        want["tokens"][at] = r.tokens
        want["positions"][at] = np.arange(r.start, r.end)
        if n == 1 and r.tokens[0] == PENDING:
            want["prev_rows"][i * c] = r.prev_row
        want["base_slots"][at], want["res_slots"][at] = r.base_slots, r.res_slots
        for j, (slot, slots) in enumerate(r.fan_slots.items()):
            want["fan_adapters"][at, j], want["fan_slots"][at, j] = slot, slots
        want["base_pages"][i, :len(r.base_page_table)] = r.base_page_table
        want["res_pages"][i, :len(r.res_page_table)] = r.res_page_table
        want["prefix_lengths"][i], want["chunk_lengths"][i] = r.start, n
        want["adapter_ids"][i], want["lora_starts"][i] = r.adapter_slot, r.lora_start
        want["group_sizes"][r.adapter_slot] += c
        want["sample_rows"][i] = i * c + n - 1
    assert t == len(want["tokens"])
    return want


@pytest.mark.parametrize("kind,chunk,fan", [("decode", 1, ()), ("decode", 1, (1, 3)),
                                            ("extend", 8, ()), ("extend", 8, (2,))])
def test_packed_inputs_hold_every_field(kind, chunk, fan):
    rng = np.random.default_rng(len(fan) + chunk)
    rows = _rows(rng, 5, chunk, fan)
    layout = InputLayout(8, chunk, 6, 4, len(fan))
    packed, sampling = build_inputs(ScheduledBatch(kind, [], [], [], [], rows=rows), layout)
    assert packed.shape == (layout.size,) and packed.dtype == np.int32
    got = layout.views(packed)
    for name, want in _expected(rows, layout).items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    inputs = layout.unpack(packed)  # the program's view of the same buffer
    np.testing.assert_array_equal(inputs.meta.res_pages, got["res_pages"])
    np.testing.assert_array_equal(inputs.sample_rows, got["sample_rows"])
    assert (inputs.meta.fan_slots is None) == (not fan) and sampling.temperature.shape == (8,)

