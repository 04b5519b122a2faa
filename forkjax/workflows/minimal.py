"""The prefill a run cannot avoid: its requests replayed through a cache that never evicts.

`prefill_tokens_minimal` is what a cache policy must compute at least for a run's requests if
nothing were ever evicted: each prompt position once per pool that lacks it. It replays the
run's requests through a host-only `DualRadixCache` of the same policy and page size whose pools
hold everything, in the order the run submitted and finished them, exactly as the engine
accounts a request (scheduler.py):

* when a request is submitted it matches its prompt in every pool it uses (the base, its own
  residual, and under `forkkv` with fan-out the residuals of the agents it writes for; a fan-out
  pool whose hit ends before the request's is dropped, as `SeqCache` does). With c = the least
  of those hits (the positions no pool lacks), it computes len(prompt) - c prompt positions, or
  none when c >= len(prompt) - 1 (a decode step computes the last prompt token, not a prefill).
  Its prompt's whole pages then enter every pool it writes: requests running together share
  what the first computes (the engine's in-flight sharing), but not its generated tokens;
* when it finishes, the whole pages of prompt + output[:-1] (the last token's K/V is never
  written) enter those pools.

The run's `prefill_tokens_computed` over this is its `recompute_ratio`: 1 when nothing the run
needed again was evicted. Matching at submit rather than at admission finds the same hits for
workflows whose calls read only outputs of calls that finished before they were submitted, as
ReAct's and MapReduce's do.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from forkjax.cache import DualRadixCache
from forkjax.lora.activated import named_key
from forkjax.workflows.results import RequestRecord


def prefill_tokens_minimal(records: Iterable[RequestRecord], policy: str, page_size: int, *,
                           fanout: bool = False, invocations: dict | None = None) -> int:
    """Prompt positions the run of `records` computes when nothing is evicted. `policy`: the
    cache policy (`forkkv+fanout` is `forkkv` with `fanout=True`: each request also writes the
    residuals of its `fanout_adapters`). Adapters are told apart by name; `invocations` {name:
    token ids}: Activated LoRA agents (their keys `Activated`, as the engine makes them)."""
    records = list(records)
    if any(len(r.prompt_ids) != r.prompt_tokens for r in records):
        raise ValueError("records without their token ids: the drivers keep them")
    pages = sum((r.prompt_tokens + r.output_tokens) // page_size + 2 for r in records)
    pools = 1 + max((len(r.fanout_adapters) for r in records), default=0) if fanout else 1
    cache = DualRadixCache(policy, page_size, pages + 1, pages * pools + 1)
    # A finish and a submit at one time: the driver submitted after it learned of the finish.
    events = sorted([(r.submit_s, 1, r.order, i) for i, r in enumerate(records)]
                    + [(r.finish_s, 0, r.order, i) for i, r in enumerate(records)])
    handles, total = {}, 0
    invocations = invocations or {}
    for _, submit, _, i in events:
        r = records[i]
        n = len(r.prompt_ids)
        if submit:
            targets = {j + 1: a for j, a in enumerate(r.fanout_adapters) if a != r.adapter}
            h = handles[i] = cache.begin(r.prompt_ids, named_key(r.adapter, r.prompt_ids, invocations),
                                         fanout=targets if fanout else None)
            total += n - h.cached_len if h.cached_len < n - 1 else 0
            h.reserve(n)
            h.commit(r.prompt_ids)
        else:
            h = handles.pop(i)
            if r.output_tokens > 1:
                h.reserve(n + r.output_tokens - 1)
                h.commit(np.concatenate([r.prompt_ids, r.output_ids[:-1]]))
            h.release()
    return total
