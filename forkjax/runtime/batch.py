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
    lora_start: int  # first position its adapter acts on: an aLoRA invocation's start, else -1
    params: SamplingParams
    step: int  # tokens the request has generated, pending ones included (the sampler's counter)
    output: list | None = None  # generated tokens the host knows, for penalties (else None)
    prompt: tuple | None = None  # the prompt, for a repetition penalty (else None)


@dataclasses.dataclass(eq=False)
class DecodeColumns:
    """What changes in every row of a decode batch from one step to the next, one entry a row in
    row order; the rest of a row (page tables, adapter, sampling parameters) persists in the
    model runner's `DecodeRows` and comes as a `BatchRow` only when it changed."""
    ids: np.ndarray  # [n] int64 request ids
    positions: np.ndarray  # [n] int32 the position each row computes
    tokens: np.ndarray  # [n] int32 its token there; PENDING: sampled on the device
    prev_rows: np.ndarray  # [n] int32 row of the previous step's output that holds a PENDING token
    steps: np.ndarray  # [n] int32 tokens generated, pending ones included (the sampler's counter)


@dataclasses.dataclass(eq=False)
class ScheduledBatch:
    kind: str  # "extend" | "decode"
    # ordered by adapter slot (the LoRA matmul groups tokens by slot); a request's consecutive
    # chunks follow one another when its prompt is split into pieces (buckets.py)
    seqs: list  # [engine.sequence.Sequence] whose positions it computes (the scheduler's, for its outputs)
    chunks: list[tuple[int, int]]  # per entry: positions [start, end) computed this step
    base_copies: list[tuple[int, int]]  # copy-on-write page pairs to copy before the step writes
    res_copies: list[tuple[int, int]]
    # per entry, for the runner; in a decode batch None where the row is as the runner keeps it
    # (`decode`: what changed in every row)
    rows: list[BatchRow | None] = dataclasses.field(default_factory=list)
    decode: DecodeColumns | None = None
    # the host tier's write-backs and loads (base pool's, residual pool's; cache/host_pool.py),
    # run before the step
    host_copies: tuple = ((), ())
    samples: list[int] = dataclasses.field(default_factory=list)  # entries that sample a token
    # [entries, ceil(vocab / 32)] int32 allowed-token bitmasks when a request in it is guided
    # (engine/guided.py; every bit set in other rows), applied when its tokens are sampled
    token_masks: np.ndarray | None = None
