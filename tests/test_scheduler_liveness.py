"""Every request finishes (engine/scheduler.py, engine/inflight.py), on the model-free replay
engine: requests of agents that share a prefix never wait for each other in a circle, and an
extend batch whose reservation preempts a request further down its own list skips it."""

import numpy as np

from forkjax.engine.admission import Admission
from forkjax.engine.sequence import SamplingParams, Status
from forkjax.workflows.replay import ReplayEngine


def _finish(engine, seqs, steps=1000):
    for _ in range(steps):
        if all(s.status is Status.FINISHED for s in seqs):
            break
        engine.step()
    assert all(s.status is Status.FINISHED and s.error is None for s in seqs), \
        [(s.status, s.num_computed, len(s)) for s in seqs]


def test_agents_sharing_a_prefix_never_wait_in_a_circle():
    """`forkkv`: agent b leads the shared prefix's base pages, c's first request waits for them
    (its own residual pages registered), and the whole prefill budget goes to b. When b leaves,
    c's second request is admitted before the first takes b's pages over: it must not claim
    them, or each of c's requests would wait for a page the other one holds."""
    engine = ReplayEngine("tiny-llama", ["a", "b", "c"], cache_policy="forkkv", kv_cache_bytes=8 << 20,
                          max_batch_size=2, max_prefill_tokens=128, max_model_len=1024)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 250, 64).tolist()
    jobs = [("b", 320, 1), ("c", 32, 4), ("c", 160, 4)]  # own tokens after the shared 64, outputs
    seqs = [engine.add_request(shared + rng.integers(3, 250, n).tolist(), a,
                               SamplingParams(max_new_tokens=m, ignore_eos=True)) for a, n, m in jobs]
    _finish(engine, seqs, steps=100)
    engine.cache.check()


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
    _finish(engine, seqs)
    assert all(len(s.output) == 4 for s in seqs) and engine.stats()["preemptions"] > 0
    engine.cache.check()


def _forked_path(engine, adapter):
    """Three requests, one after another, in a pool of 8 usable pages of 16 tokens: b forks a's
    prompt inside its second page and inserts its own copy of that page, so c's cached path
    (b's) spells 74 tokens in 6 pages, and c (100 + 12 tokens: 7 pages, plus one to copy its
    hit's last page) fits the pool only without it. Returns c, finished."""
    rng = np.random.default_rng(0)
    x, y, w = (rng.integers(3, 250, n).tolist() for n in (40, 56, 26))
    for prompt, n in ((x, 1), (x[:24] + y, 1), (x[:24] + y[:50] + w, 12)):
        seq = engine.add_request(prompt, adapter, SamplingParams(max_new_tokens=n, ignore_eos=True))
        _finish(engine, [seq], steps=300)
        engine.cache.check()
    return seq


def test_a_request_whose_cached_path_takes_more_pages_than_its_tokens_finishes_alone():
    """Alone, and refused no pages by the capacity check, c finds none with its hit locked: it
    runs again without it (once), instead of preempting itself at every step."""
    engine = ReplayEngine("tiny-llama", ["a"], cache_policy="prefix", kv_cache_bytes=10 * 16384,
                          max_batch_size=4, max_prefill_tokens=256, max_model_len=256)
    assert engine.cache.base_tree.allocator.num_usable == 8
    seq = _forked_path(engine, "a")
    assert len(seq.output) == 12 and not seq.reuse_cache and engine.stats()["preemptions"] == 1


def test_without_its_cached_path_a_request_computes_the_same_tokens():
    """The same on tiny-llama (f32, greedy): c's tokens are those c computes alone in a fresh
    engine whose pool holds everything."""
    import forkjax

    kw = dict(dtype="float32", cache_policy="prefix", max_batch_size=4, max_prefill_tokens=256,
              max_model_len=256, warmup=False, progress=False)
    tight = forkjax.Engine.from_pretrained("tiny-llama", kv_cache_bytes=10 * 32768, **kw)
    assert tight.cache.base_tree.allocator.num_usable == 8
    seq = _forked_path(tight, None)
    assert not seq.reuse_cache
    fresh = forkjax.Engine.from_pretrained("tiny-llama", kv_cache_bytes=1 << 22, **kw)
    assert fresh.generate([list(seq.prompt)], max_new_tokens=12, ignore_eos=True)[0] == seq.output


POLICIES = ("prefix", "forkkv", "forkkv+fanout", "full_reuse", "lrshared")


def test_random_requests_sharing_a_prefix_all_finish():
    """400 random cases: 2-6 requests of three agents on one shared prefix (some of workflows),
    every policy, pools of 20-80 pages, prefill budgets of 64-512 tokens, with and without a host
    tier. Every request finishes within 3,000 steps and the cache stays consistent."""
    rng = np.random.default_rng(3)
    for case in range(400):
        policy = str(rng.choice(POLICIES))
        pages, budget = int(rng.integers(20, 80)), int(rng.choice([64, 128, 256, 512]))
        n, host = int(rng.integers(2, 7)), int(rng.choice([0, 0, 64 << 20]))
        engine = ReplayEngine("tiny-llama", ["a", "b", "c"], cache_policy=policy.removesuffix("+fanout"),
                              residual_fanout=policy.endswith("+fanout"), kv_cache_bytes=pages * 24576,
                              max_batch_size=4, max_prefill_tokens=budget, max_model_len=4096,
                              host_kv_bytes=host)
        r = np.random.default_rng(case)
        shared = r.integers(3, 250, int(r.integers(0, 300))).tolist()
        seqs = []
        for i in range(n):
            own = int(r.integers(10, pages * 8))
            session = f"w{i % 2}" if r.random() < 0.5 else None
            params = SamplingParams(max_new_tokens=int(r.integers(1, 20)), ignore_eos=True)
            try:
                seqs.append(engine.add_request(shared + r.integers(3, 250, own).tolist(), "abc"[i % 3],
                                               params, session_id=session))
            except ValueError:  # a prompt this pool can never hold
                pass
        _finish(engine, seqs, steps=3000)
        engine.cache.check()
