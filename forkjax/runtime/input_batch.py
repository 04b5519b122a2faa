"""A scheduled batch's rows (batch.py) -> one step program's inputs, padded to its bucket and
packed into one int32 host buffer (`InputLayout`): one transfer a step. `build_inputs` writes
every row of a batch; a decode batch's rows persist across steps instead (decode_rows.py).

A step runs B = `b` rows of `c` token positions each (decode: c = 1; extend: a request's chunk,
padded), T = b·c positions in all, rows ordered by adapter slot (the LoRA matmul groups tokens by
slot, forkjax.lora.batched), with page tables `w` pages wide (buckets.py). Padding positions write
to slot 0 and padding page-table entries name page 0: the sink page (cache/allocator.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from forkjax.runtime.batch import PENDING, BatchRow, ScheduledBatch
from forkjax.runtime.buckets import Buckets
from forkjax.runtime.paged_attention import PagedMeta
from forkjax.runtime.sampler import ProcessArrays, SamplingArrays


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """A step's inputs inside the program (`InputLayout.unpack`)."""
    tokens: jax.Array  # [T] int32
    prev_rows: jax.Array  # [T] int32 row of the previous step's sampled output to use, -1: tokens
    positions: jax.Array  # [T] int32
    group_sizes: jax.Array  # [N] int32 rows per adapter slot (rows are ordered by slot)
    lora_starts: jax.Array  # [B] int32 first position a row's adapter acts on (-1: plain LoRA)
    meta: PagedMeta
    sample_rows: jax.Array  # [B] int32 row of each request's last token


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """Where each of a step's int32 inputs lies in the one host buffer that carries them all (one
    transfer a step, not one per array): a bucket (b rows of c positions, page tables w wide), N
    adapter slots and fan-out width F fix it. A static argument of the step program."""
    b: int
    c: int
    w: int
    n: int
    f: int

    def fields(self) -> list[tuple[str, tuple]]:
        t, b = self.b * self.c, self.b
        out = [("tokens", (t,)), ("prev_rows", (t,)), ("positions", (t,)), ("base_slots", (t,)),
               ("res_slots", (t,)), ("base_pages", (b, self.w)), ("res_pages", (b, self.w)),
               ("prefix_lengths", (b,)), ("chunk_lengths", (b,)), ("adapter_ids", (b,)),
               ("group_sizes", (self.n,)), ("lora_starts", (b,)), ("sample_rows", (b,))]
        if self.f:
            out += [("fan_slots", (t, self.f)), ("fan_adapters", (t, self.f))]
        return out

    @functools.cached_property
    def _spans(self) -> list[tuple[str, tuple, int, int]]:
        spans, start = [], 0
        for name, shape in self.fields():
            size = int(np.prod(shape))
            spans.append((name, shape, start, start + size))
            start += size
        return spans

    @property
    def size(self) -> int:
        return self._spans[-1][3]

    def views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """{field: a view into buf [size] int32, shaped}: written in place on the host."""
        return {name: buf[s:e].reshape(shape) for name, shape, s, e in self._spans}

    def unpack(self, packed) -> StepInputs:
        """packed [size] int32 (in the program) -> the StepInputs it carries."""
        x = {name: packed[s:e].reshape(shape) for name, shape, s, e in self._spans}
        meta = PagedMeta(x["base_slots"], x["res_slots"], x["base_pages"], x["res_pages"],
                         x["prefix_lengths"], x["chunk_lengths"], x["adapter_ids"],
                         x.get("fan_slots"), x.get("fan_adapters"))
        return StepInputs(x["tokens"], x["prev_rows"], x["positions"], x["group_sizes"],
                          x["lora_starts"], meta, x["sample_rows"])


def batch_shape(batch: ScheduledBatch, buckets: Buckets, pages: int | None = None) -> tuple[int, int, int]:
    """(b, c, w): the bucket of `batch`'s rows, positions per row and page-table width (`pages`:
    of its longest request, else read from its rows)."""
    n = len(batch.rows)
    if batch.kind == "decode":
        b, c = buckets.decode(n), 1
    else:
        b, c = buckets.extend(n, max(r.end - r.start for r in batch.rows))
    if pages is None:
        pages = max(max(len(r.base_page_table), len(r.res_page_table)) for r in batch.rows)
    w = buckets.width(pages)
    return b, c, w


def build_inputs(batch: ScheduledBatch, layout: InputLayout) -> tuple[np.ndarray, SamplingArrays]:
    """The step inputs of `batch` in its bucket, packed ([layout.size] int32), and its requests'
    sampling parameters. `layout.f`: the fan-out width F, the adapter slots a position writes
    residuals for besides its own and their residual slots (`PagedMeta.fan_adapters`,
    `fan_slots`; 0: none)."""
    b, c = layout.b, layout.c
    buf = np.zeros(layout.size, np.int32)
    x = layout.views(buf)
    x["prev_rows"][:] = x["lora_starts"][:] = -1
    tokens, positions, prev_rows = x["tokens"], x["positions"], x["prev_rows"]
    base_slots, res_slots = x["base_slots"], x["res_slots"]
    fan_slots, fan_adapters = x.get("fan_slots"), x.get("fan_adapters")
    base_pt, res_pt, group_sizes = x["base_pages"], x["res_pages"], x["group_sizes"]
    rows = batch.rows
    for i, row in enumerate(rows):
        s, e = row.start, row.end
        r = slice(i * c, i * c + e - s)
        tokens[r] = row.tokens
        positions[r] = np.arange(s, e)
        base_slots[r], res_slots[r] = row.base_slots, row.res_slots
        for j, (slot, slots) in enumerate(row.fan_slots.items()):
            fan_adapters[r, j], fan_slots[r, j] = slot, slots
        x["prefix_lengths"][i], x["chunk_lengths"][i] = s, e - s
        x["adapter_ids"][i], x["lora_starts"][i] = row.adapter_slot, row.lora_start
        group_sizes[row.adapter_slot] += c  # a request's padding rows ride in its own group
        x["sample_rows"][i] = i * c + e - s - 1
        if e - s == 1 and row.tokens[0] == PENDING:  # sampled by the previous step
            prev_rows[i * c] = row.prev_row
        bpt, rpt = row.base_page_table, row.res_page_table
        base_pt[i, :len(bpt)], res_pt[i, :len(rpt)] = bpt, rpt
    return buf, sampling_arrays(rows, b)


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
    `b`); id lists padded with -1 to a power of two, at least MIN_ID_LIST, so few shapes
    compile (the warm-up compiles the shortest: runtime/warmup_plan.py)."""
    presence, frequency = np.zeros(b, np.float32), np.zeros(b, np.float32)
    repetition, pending = np.ones(b, np.float32), np.full(b, -1, np.int32)
    outputs, prompts, bias_ids, biases, banned = [], [], [], [], []
    for i, row in enumerate(rows):
        if row is None:  # a decode row without processing (a processed one comes whole)
            for xs in (outputs, prompts, bias_ids, biases, banned):
                xs.append(())
            continue
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


def padded_masks(masks: np.ndarray, b: int) -> np.ndarray:
    """Allowed-token bitmasks [n, W] int32 (ScheduledBatch.token_masks) -> [b, W]: the padding
    rows allow every token."""
    out = np.full((b, masks.shape[1]), -1, np.int32)
    out[:len(masks)] = masks
    return out


def id_list_widths(p: ProcessArrays) -> tuple[int, int, int, int]:
    """The padded widths of `p`'s id lists (outputs, prompts, logit bias, stop tokens): with B,
    what its processing program's shapes depend on."""
    return p.output_ids.shape[1], p.prompt_ids.shape[1], p.bias_ids.shape[1], p.banned_ids.shape[1]


# Id lists (outputs, prompts, logit bias, stop tokens) of up to this many entries share one
# processing program a batch size: a penalised request's outputs would otherwise compile a new
# width at 2, 4, 8, ... tokens; scattering a few padding ids costs next to nothing beside the
# [B, vocab] arrays.
MIN_ID_LIST = 64


def _padded(lists, b: int, dtype=np.int32, fill=-1) -> np.ndarray:
    """[b, L] of `lists` in rows 0.., `fill` elsewhere; L the next power of two of the longest,
    at least MIN_ID_LIST."""
    width = max(MIN_ID_LIST, 1 << max(0, max(map(len, lists), default=0) - 1).bit_length())
    out = np.full((b, width), fill, dtype)
    for i, xs in enumerate(lists):
        out[i, :len(xs)] = xs
    return out
