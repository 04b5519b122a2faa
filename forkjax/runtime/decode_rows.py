"""A decode batch's host inputs, persistent across steps (vLLM V1's `InputBatch`).

A request keeps one row here while it decodes: its page tables, adapter slot and sampling
parameters, written when it joins the decode batch or its page tables change (the scheduler then
sends its full `BatchRow`; otherwise None). Every step the rows of the batch's requests are
gathered in the batch's order into the packed inputs (input_batch.InputLayout), and what moves
every step comes as columns (batch.DecodeColumns): positions, tokens, the previous step's output
rows. A position's write slots follow from its row's page tables (page·S + offset; a residual page
0, the sink, means none), so the per-step work is a few numpy gathers whatever the batch size; a
full row's own slots (a position still cached, fan-out targets) are written over them. A request
absent from a decode batch leaves; the scheduler sends the full row of one absent from the
previous decode batch.
"""

from __future__ import annotations

import numpy as np

from forkjax.runtime.batch import PENDING, BatchRow, ScheduledBatch
from forkjax.runtime.input_batch import InputLayout
from forkjax.runtime.sampler import SamplingArrays


class DecodeRows:
    def __init__(self, capacity: int, max_pages: int, page_size: int):
        """`capacity`: rows of the largest decode batch; `max_pages`: pages of the longest
        request (the widest page-table bucket)."""
        self.page_size = page_size
        self.index: dict[int, int] = {}  # request id -> its row here
        self._free = list(range(capacity))[::-1]
        self.base_pages = np.zeros((capacity, max_pages), np.int32)
        self.res_pages = np.zeros((capacity, max_pages), np.int32)
        self.num_pages = np.zeros(capacity, np.int32)
        self.adapter = np.zeros(capacity, np.int32)
        self.lora_start = np.full(capacity, -1, np.int32)
        self.temperature = np.zeros(capacity, np.float32)
        self.top_p = np.ones(capacity, np.float32)
        self.top_k = np.zeros(capacity, np.int32)
        self.seed = np.zeros(capacity, np.uint32)
        self._idx = np.zeros(0, np.intp)  # the last update's rows, in batch order

    def update(self, batch: ScheduledBatch) -> int:
        """Take in a decode batch's membership and changed rows; returns the pages of its
        longest request (its page-table bucket follows)."""
        ids = batch.decode.ids.tolist()
        for gone in self.index.keys() - set(ids):
            self._free.append(self.index.pop(gone))
        for rid, row in zip(ids, batch.rows):
            if row is not None:
                self._write(rid, row)
        self._idx = np.fromiter(map(self.index.__getitem__, ids), np.intp, len(ids))
        return int(self.num_pages[self._idx].max())

    def _write(self, rid: int, row: BatchRow):
        i = self.index.get(rid)
        if i is None:
            i = self.index[rid] = self._free.pop()
        n = len(row.base_page_table)
        self.base_pages[i, n:] = self.res_pages[i, n:] = 0
        self.base_pages[i, :n], self.res_pages[i, :n] = row.base_page_table, row.res_page_table
        self.num_pages[i], self.adapter[i], self.lora_start[i] = n, row.adapter_slot, row.lora_start
        p = row.params
        self.temperature[i], self.top_p[i], self.top_k[i] = p.temperature, p.top_p, p.top_k
        self.seed[i] = p.seed & 0xFFFFFFFF

    def build(self, batch: ScheduledBatch, layout: InputLayout) -> tuple[np.ndarray, SamplingArrays]:
        """The packed inputs ([layout.size] int32) and sampling parameters of the batch last
        passed to `update`, in its bucket."""
        cols, idx, n, b, S = batch.decode, self._idx, len(self._idx), layout.b, self.page_size
        buf = np.zeros(layout.size, np.int32)
        x = layout.views(buf)
        pos = cols.positions
        x["tokens"][:n], x["positions"][:n], x["prefix_lengths"][:n] = cols.tokens, pos, pos
        x["prev_rows"][:] = -1
        x["prev_rows"][:n] = np.where(cols.tokens == PENDING, cols.prev_rows, -1)
        page, offset = pos // S, pos % S
        for name, table in (("base", self.base_pages), ("res", self.res_pages)):
            written = table[idx, page]  # [n] the page each position writes
            x[f"{name}_slots"][:n] = np.where(written > 0, written * S + offset, 0)
            x[f"{name}_pages"][:n] = table[idx, :layout.w]
        x["chunk_lengths"][:n] = 1
        x["adapter_ids"][:n] = adapters = self.adapter[idx]
        x["group_sizes"][:] = np.bincount(adapters, minlength=layout.n)
        x["lora_starts"][:] = -1
        x["lora_starts"][:n] = self.lora_start[idx]
        x["sample_rows"][:n] = np.arange(n)
        for i, row in enumerate(batch.rows):
            if row is not None:  # its own slots: a position still cached writes none
                x["base_slots"][i], x["res_slots"][i] = row.base_slots[0], row.res_slots[0]
                for j, (slot, slots) in enumerate(row.fan_slots.items()):
                    x["fan_adapters"][i, j], x["fan_slots"][i, j] = slot, slots[0]

        def padded(values, fill=0):  # [n] -> [b]: the padding rows' values (greedy) after them
            return np.concatenate([values, np.full(b - n, fill, values.dtype)])
        sampling = SamplingArrays(padded(self.temperature[idx]), padded(self.top_p[idx], 1),
                                  padded(self.top_k[idx]), padded(self.seed[idx]),
                                  padded(cols.steps.astype(np.int32)))
        return buf, sampling
