"""The scheduler when reservations preempt (engine/scheduler.py), on the model-free replay
engine: an extend batch whose reservation preempts a request further down its own list skips
that request, which waits again, and every request still finishes."""

import numpy as np

from forkjax.engine.admission import Admission
from forkjax.engine.sequence import SamplingParams, Status
from forkjax.workflows.replay import ReplayEngine


def test_an_extend_batch_skips_the_requests_its_reservations_preempted(monkeypatch):
    # An admission whose estimate falls short (as a wrong session projection makes it) starts
    # requests that do not fit together: their chunks' reservations preempt the youngest.
    monkeypatch.setattr(Admission, "need", lambda self, seq: (0, 0))
    engine = ReplayEngine("tiny-llama", ["a", "b"], cache_policy="prefix", kv_cache_bytes=49 * 16384,
                          max_batch_size=4, max_prefill_tokens=256, max_model_len=4096)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    seqs = [engine.add_request(rng.integers(3, 250, n).tolist(), "ab"[i % 2], params)
            for i, n in enumerate((692, 44, 122, 602))]
    for _ in range(1000):
        if all(s.status is Status.FINISHED for s in seqs):
            break
        engine.step()
    assert all(s.status is Status.FINISHED and s.error is None and len(s.output) == 4 for s in seqs)
    assert engine.stats()["preemptions"] > 0
    engine.cache.check()
