"""What one step runs, as plain data: the scheduler fills it, the model runner reads its rows.

A row is one request's positions [start, end) with everything the step needs of it, page tables
and write slots included, so the model runner never sees a request's cache handle.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from forkjax.engine.sequence import SamplingParams, Sequence


@dataclasses.dataclass(eq=False)
class BatchRow:
    start: int
    end: int
    tokens: np.ndarray  # [end - start] int32 (a list for one); PENDING: sampled on the device
    prev_row: int  # row of the previous step's sampled output that holds a PENDING token
    base_slots: np.ndarray  # [end - start] int32 base pool slots to write, 0: cached already
    res_slots: np.ndarray  # [end - start] int32 residual pool slots, 0: none or cached
    fan_slots: dict[int, np.ndarray]  # adapter slot -> [end - start] int32 fan-out residual slots
    base_page_table: np.ndarray  # [pages] int32
    res_page_table: np.ndarray  # [pages] int32, the same token ranges
    adapter_slot: int
    params: SamplingParams
    step: int  # tokens the request has generated, pending ones included (the sampler's counter)
    output: list | None = None  # generated tokens the host knows, for penalties (else None)
    prompt: tuple | None = None  # the prompt, for a repetition penalty (else None)

    @classmethod
    def of(cls, seq: Sequence, start: int, end: int) -> BatchRow:
        """What the model runner needs of running request `seq`'s positions [start, end)."""
        h = seq.cache
        if end - start == 1:  # decode: scalars, no numpy temporaries (host time is on the step)
            base, res = h.slot_pair(start)
            tokens, base_slots, res_slots = [seq.token_at(start)], [base], [res]
        else:
            tokens = seq.tokens[start:end]
            base_slots, res_slots = h.slot_mapping(start, end)
        p = seq.params
        penalised = p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1
        return cls(start, end, tokens, seq.sample_row, base_slots, res_slots,
                   h.fanout_slots(start, end), h.base_page_table, h.res_page_table, seq.slot,
                   p, len(seq.output) + seq.pending, seq.output if penalised else None,
                   seq.req.prompt if p.repetition_penalty != 1 else None)


@dataclasses.dataclass(eq=False)
class ScheduledBatch:
    kind: str  # "extend" | "decode"
    # ordered by adapter slot (the LoRA matmul groups tokens by slot); a request's consecutive
    # chunks follow one another when its prompt is split into pieces (buckets.py)
    seqs: list  # [Sequence] whose positions it computes (the scheduler's, for its outputs)
    chunks: list[tuple[int, int]]  # per entry: positions [start, end) computed this step
    base_copies: list[tuple[int, int]]  # copy-on-write page pairs to copy before the step writes
    res_copies: list[tuple[int, int]]
    rows: list[BatchRow] = dataclasses.field(default_factory=list)  # per entry, for the runner
    # (base, residual) HostPagePool or None: their queued write-backs and loads run first
    host_pools: tuple = (None, None)
    samples: list[int] = dataclasses.field(default_factory=list)  # entries that sample a token
