"""What one step runs, as plain data: the scheduler fills it, the model runner reads its rows.

A row is one request's positions [start, end) with everything the step needs of it, page tables
and write slots included, so the model runner never sees a request's cache handle.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from forkjax.sampling_params import SamplingParams

# A token sampled by a launched step that has not reached the host yet (overlap scheduling): the
# next step reads it from the device, the host learns it one step later.
PENDING = -1


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


@dataclasses.dataclass(eq=False)
class ScheduledBatch:
    kind: str  # "extend" | "decode"
    # ordered by adapter slot (the LoRA matmul groups tokens by slot); a request's consecutive
    # chunks follow one another when its prompt is split into pieces (buckets.py)
    seqs: list  # [engine.sequence.Sequence] whose positions it computes (the scheduler's, for its outputs)
    chunks: list[tuple[int, int]]  # per entry: positions [start, end) computed this step
    base_copies: list[tuple[int, int]]  # copy-on-write page pairs to copy before the step writes
    res_copies: list[tuple[int, int]]
    rows: list[BatchRow] = dataclasses.field(default_factory=list)  # per entry, for the runner
    # the host tier's write-backs and loads (base pool's, residual pool's; cache/host_pool.py),
    # run before the step
    host_copies: tuple = ((), ())
    samples: list[int] = dataclasses.field(default_factory=list)  # entries that sample a token
