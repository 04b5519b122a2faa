"""The rows of a scheduled batch (runtime/batch.py) read from the scheduler's requests.

A decode batch sends a request's full row only when the model runner's copy of it
(runtime/decode_rows.py) is missing or stale: the request was not in the previous decode batch,
its page tables changed, or its row changes every step (fan-out slots; penalties and logprobs,
which read its outputs). Every other row travels as a few scalars in `DecodeColumns`.
"""

from __future__ import annotations

import numpy as np

from forkjax.engine.sequence import Sequence
from forkjax.runtime.batch import BatchRow, DecodeColumns


def full_row(seq: Sequence, start: int, end: int) -> BatchRow:
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
    return BatchRow(start, end, tokens, seq.sample_row, base_slots, res_slots,
                    h.fanout_slots(start, end), h.base_page_table, h.res_page_table, seq.slot,
                    seq.lora_start, p, len(seq.output) + seq.pending, seq.output if penalised else None,
                    seq.req.prompt if p.repetition_penalty != 1 else None)


def decode_rows(seqs: list[Sequence], fresh: set[int]) -> tuple[list[BatchRow | None], DecodeColumns]:
    """A decode batch's rows (a full row where the runner's copy is missing or stale, else None)
    and columns, `seqs` in row order; `fresh`: ids whose copy in the runner is current."""
    positions = [len(s) - 1 for s in seqs]
    rows = [None if s.id in fresh and not (s.cache.fanout or s.params.processed
                                           or s.params.logprobs is not None)
            else full_row(s, p, p + 1) for s, p in zip(seqs, positions)]
    columns = DecodeColumns(
        np.fromiter((s.id for s in seqs), np.int64, len(seqs)), np.asarray(positions, np.int32),
        np.fromiter((s.token_at(p) for s, p in zip(seqs, positions)), np.int32, len(seqs)),
        np.fromiter((s.sample_row for s in seqs), np.int32, len(seqs)),
        np.fromiter((len(s.output) + s.pending for s in seqs), np.int32, len(seqs)))
    return rows, columns
