"""Overlap scheduling: step n+1 is dispatched before step n's sampled tokens reach the host.

The synchronous engine (`overlap=False`) is the reference: the same requests must give the same
tokens, stop at the same place and leave the cache in a state later requests hit the same way.
"""

import numpy as np
import pytest

import forkjax
from conftest import SMALL
from forkjax.engine import admission
from forkjax.engine.scheduler import PreemptionNeeded, Scheduler
from forkjax.engine.sequence import PENDING, SamplingParams, Status


def _engine(overlap, **kw):
    return forkjax.Engine.from_pretrained("tiny-llama", dtype="float32", cache_policy="forkkv",
                                          overlap=overlap, **dict(SMALL, **kw))


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.fixture(scope="module")
def engines():
    return _engine(True), _engine(False)


# Prompts longer than max_prefill_tokens (128) are prefilled in chunks. The last one extends the
# first with the same adapter (exact hits); a prefix shared across adapters would make forkkv's
# output depend on which request wrote the shared base first, which overlap changes.
PROMPTS = [_prompt(1, 5), _prompt(2, 150), _prompt(3, 33), _prompt(1, 5) + _prompt(4, 20)]
ADAPTERS = ["planner", "coder", None, "planner"]


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_p=0.9, top_k=50, seed=7)])
def test_same_tokens_as_synchronous_steps(engines, sampling):
    over, sync = engines
    want = sync.generate(PROMPTS, adapters=ADAPTERS, max_new_tokens=9, ignore_eos=True, **sampling)
    got = over.generate(PROMPTS, adapters=ADAPTERS, max_new_tokens=9, ignore_eos=True, **sampling)
    assert got == want
    assert all(len(g) == 9 for g in got)


def test_stop_token_ends_the_output_where_the_synchronous_engine_does(engines):
    over, sync = engines
    free = sync.generate(PROMPTS, adapters=ADAPTERS, max_new_tokens=12, ignore_eos=True)
    stop = free[1][4]  # request 1 stops at its fifth token (or earlier, if it repeats)
    want = sync.generate(PROMPTS, adapters=ADAPTERS, max_new_tokens=12, stop_token_ids=[stop],
                         ignore_eos=True)
    got = over.generate(PROMPTS, adapters=ADAPTERS, max_new_tokens=12, stop_token_ids=[stop],
                        ignore_eos=True)
    assert got == want
    assert got[1][-1] == stop and len(got[1]) <= 5


def test_next_step_is_dispatched_before_the_token_is_known():
    engine, sync = _engine(True), _engine(False)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    seq = engine.add_request(_prompt(5, 40), "coder", params)
    engine.step()  # prefill launched, not waited for
    assert seq.pending == 1 and seq.output == [] and seq.token_at(40) == PENDING
    engine.step()  # decode launched with the pending token as input; the first token arrives
    assert len(seq.output) == 1 and seq.pending == 1
    while seq.status is not Status.FINISHED:
        engine.step()
    assert seq.output == sync.generate([_prompt(5, 40)], adapters="coder", max_new_tokens=4,
                                       ignore_eos=True)[0]
    # four launches (prefill + 3 decodes): max_new_tokens is known ahead, so no step is wasted
    assert engine.step_times["steps"] == 4 and engine.step_times["dispatch_s"] > 0


def test_abort_in_flight_keeps_the_cache_consistent():
    engine, sync = _engine(True), _engine(False)
    prompt = _prompt(6, 70)
    seq = engine.add_request(prompt, "planner", SamplingParams(max_new_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort(seq)  # a step of it is still in flight
    assert seq.status is Status.FINISHED and PENDING not in seq.output and seq.pending == 0
    # The aborted request's committed pages serve the next one: same tokens as a fresh engine.
    hits = engine.stats()["base_hit_tokens"]
    again = engine.generate([prompt + seq.output], adapters="planner", max_new_tokens=6,
                            ignore_eos=True)
    assert engine.stats()["base_hit_tokens"] - hits >= 64
    assert again == sync.generate([prompt + seq.output], adapters="planner", max_new_tokens=6,
                                  ignore_eos=True)


def test_preemption_waits_for_the_step_in_flight(monkeypatch):
    """Running requests outgrow a 12-page pool: the overlap engine must stop, take in the step in
    flight, then preempt; outputs equal the synchronous engine's and a large pool's. Admission
    counts one generated token here (DECODE_CLIP=1; it counts the generation, and would not
    preempt, by default)."""
    raised = []
    decode_batch = Scheduler._decode_batch

    def spy(self, seqs, allow_preempt):
        try:
            return decode_batch(self, seqs, allow_preempt)
        except PreemptionNeeded:
            raised.append(len(seqs))
            raise

    monkeypatch.setattr(Scheduler, "_decode_batch", spy)
    monkeypatch.setattr(admission, "DECODE_CLIP", 1)
    prompts = [_prompt(30 + i, 40) for i in range(3)]
    names = ["planner", "coder", None]
    kw = dict(max_new_tokens=40, ignore_eos=True)
    small = {ov: _engine(ov, kv_cache_bytes=12 * (32768 + 3 * 8192)) for ov in (True, False)}
    got = {ov: e.generate(prompts, adapters=names, **kw) for ov, e in small.items()}
    assert raised and small[True].stats()["preemptions"] > 0
    assert got[True] == got[False] == _engine(True).generate(prompts, adapters=names, **kw)
