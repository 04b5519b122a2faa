"""A scheduled batch's rows (batch.py) -> the host arrays of one step program's inputs, padded
to its bucket.

A step runs B = `b` rows of `c` token positions each (decode: c = 1; extend: a request's chunk,
padded), T = b·c positions in all, rows ordered by adapter slot (the LoRA matmul groups tokens by
slot, forkjax.lora.batched), with page tables `w` pages wide (buckets.py). Padding positions write
to slot 0 and padding page-table entries name page 0: the sink page (cache/allocator.py).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from forkjax.runtime.buckets import Buckets
from forkjax.runtime.paged_attention import PagedMeta
from forkjax.runtime.sampler import ProcessArrays, SamplingArrays
from forkjax.runtime.batch import PENDING, BatchRow, ScheduledBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    tokens: jax.Array  # [T] int32
    prev_rows: jax.Array  # [T] int32 row of the previous step's sampled output to use, -1: tokens
    positions: jax.Array  # [T] int32
    group_sizes: jax.Array  # [N] int32 rows per adapter slot (rows are ordered by slot)
    meta: PagedMeta
    sample_rows: jax.Array  # [B] int32 row of each request's last token


def batch_shape(batch: ScheduledBatch, buckets: Buckets) -> tuple[int, int, int]:
    """(b, c, w): the bucket of `batch`'s rows, positions per row and page-table width."""
    n = len(batch.rows)
    if batch.kind == "decode":
        b, c = buckets.decode(n), 1
    else:
        b, c = buckets.extend(n, max(r.end - r.start for r in batch.rows))
    w = buckets.width(max(max(len(r.base_page_table), len(r.res_page_table)) for r in batch.rows))
    return b, c, w


def build_inputs(batch: ScheduledBatch, b: int, c: int, w: int, num_slots: int,
                 fanout: int) -> tuple[StepInputs, SamplingArrays]:
    """The step inputs of `batch` in bucket (b, c, w), and its requests' sampling parameters.
    `fanout`: the fan-out width F, the adapter slots a position writes residuals for besides
    its own and their residual slots (`PagedMeta.fan_adapters`, `fan_slots`; 0: none)."""
    t = b * c
    tokens, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
    prev_rows = np.full(t, -1, np.int32)
    base_slots, res_slots = np.zeros(t, np.int32), np.zeros(t, np.int32)
    fan_slots = np.zeros((t, fanout), np.int32) if fanout else None
    fan_adapters = np.zeros((t, fanout), np.int32) if fanout else None
    base_pt, res_pt = np.zeros((b, w), np.int32), np.zeros((b, w), np.int32)
    prefix, chunk, adapter = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
    group_sizes = np.zeros(num_slots, np.int32)
    rows = np.zeros(b, np.int32)
    samp = sampling_arrays(batch.rows, b)
    for i, row in enumerate(batch.rows):
        s, e = row.start, row.end
        if e - s == 1:  # decode: scalars, no numpy temporaries (host time is on the step)
            tokens[i * c], positions[i * c] = row.tokens[0], s
            if tokens[i * c] == PENDING:  # sampled by the previous step, still on the device
                prev_rows[i * c] = row.prev_row
            base_slots[i * c], res_slots[i * c] = row.base_slots[0], row.res_slots[0]
            for j, (slot, slots) in enumerate(row.fan_slots.items()):
                fan_adapters[i * c, j], fan_slots[i * c, j] = slot, slots[0]
        else:
            r = slice(i * c, i * c + e - s)
            tokens[r] = row.tokens
            positions[r] = np.arange(s, e)
            base_slots[r], res_slots[r] = row.base_slots, row.res_slots
            for j, (slot, slots) in enumerate(row.fan_slots.items()):
                fan_adapters[r, j], fan_slots[r, j] = slot, slots
        bpt, rpt = row.base_page_table, row.res_page_table
        base_pt[i, :len(bpt)], res_pt[i, :len(rpt)] = bpt, rpt
        prefix[i], chunk[i], adapter[i] = s, e - s, row.adapter_slot
        group_sizes[row.adapter_slot] += c  # a request's padding rows ride in its own group
        rows[i] = i * c + e - s - 1
    meta = PagedMeta(base_slots, res_slots, base_pt, res_pt, prefix, chunk, adapter, fan_slots, fan_adapters)
    return StepInputs(tokens, prev_rows, positions, group_sizes, meta, rows), samp


def dummy_inputs(b: int, c: int, w: int, num_slots: int,
                 fanout: int) -> tuple[StepInputs, SamplingArrays]:
    """Inputs of bucket (b, c, w) with no request in them: every row padding (warm-up)."""
    t = b * c
    z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    meta = PagedMeta(z(t), z(t), z(b, w), z(b, w), z(b), np.full(b, c, np.int32), z(b),
                     *((z(t, fanout), z(t, fanout)) if fanout else ()))
    return (StepInputs(z(t), np.full(t, -1, np.int32), z(t), z(num_slots), meta, z(b)),
            sampling_arrays([], b))


def sampling_arrays(rows: list[BatchRow], b: int) -> SamplingArrays:
    """Sampling parameters of `rows` in rows 0.., greedy in the padding rows up to `b`."""
    temp, top_p = np.zeros(b, np.float32), np.ones(b, np.float32)
    top_k, seed, step = np.zeros(b, np.int32), np.zeros(b, np.uint32), np.zeros(b, np.int32)
    for i, row in enumerate(rows):
        p = row.params
        temp[i], top_p[i], top_k[i] = p.temperature, p.top_p, p.top_k
        seed[i], step[i] = p.seed & 0xFFFFFFFF, row.step
    return SamplingArrays(temp, top_p, top_k, seed, step)


def processing_arrays(rows: list[BatchRow], b: int) -> ProcessArrays:
    """What sampler.process_logits changes in `rows` (rows 0.., nothing in the padding up to
    `b`); id lists padded with -1 to a power of two, so few shapes compile."""
    presence, frequency = np.zeros(b, np.float32), np.zeros(b, np.float32)
    repetition, pending = np.ones(b, np.float32), np.full(b, -1, np.int32)
    outputs, prompts, bias_ids, biases, banned = [], [], [], [], []
    for i, row in enumerate(rows):
        p = row.params
        presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        if row.tokens[-1] == PENDING:  # its newest token is still on the device
            pending[i] = row.prev_row
        outputs.append(row.output or ())
        prompts.append(row.prompt or ())
        bias_ids.append([t for t, _ in p.logit_bias])
        biases.append([x for _, x in p.logit_bias])
        banned.append(p.stop_token_ids if row.step < p.min_tokens else ())
    return ProcessArrays(presence, frequency, repetition, _padded(outputs, b), pending,
                         _padded(prompts, b), _padded(bias_ids, b),
                         _padded(biases, b, np.float32, 0), _padded(banned, b))


def _padded(lists, b: int, dtype=np.int32, fill=-1) -> np.ndarray:
    """[b, L] of `lists` in rows 0.., `fill` elsewhere; L the next power of two of the longest."""
    width = 1 << max(0, max(map(len, lists), default=0) - 1).bit_length()
    out = np.full((b, width), fill, dtype)
    for i, xs in enumerate(lists):
        out[i, :len(xs)] = xs
    return out
