"""Sharing between requests in flight, residual fan-out, cache-aware admission and sessions."""

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import forkjax
from conftest import SMALL
from forkjax.config import ModelConfig
from forkjax.engine.sequence import SamplingParams, Status
from forkjax.models.builtin import BUILTIN_CONFIGS, random_adapter
from hf_utils import hf_hidden_states, load_hf

TINY = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTERS = {f"a{i}": random_adapter(f"a{i}", TINY, 8, 1.0, ATTN, seed=i) for i in range(4)}
LONG = dict(SMALL, max_model_len=1024)


def _prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 256, n)]


def _engine(policy="forkkv", adapters=ADAPTERS, **kw):
    return forkjax.Engine.from_pretrained("tiny-llama", adapters=adapters, dtype="float32",
                                          cache_policy=policy, **dict(LONG, **kw))


def _run(engine, prompts, names, max_new_tokens=4, watch=None):
    """Submit everything at once and step to the end -> outputs (and `watch(engine)` each step)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, n, params) for p, n in zip(prompts, names)]
    while engine.scheduler.has_work:
        engine.step()
        if watch is not None:
            watch(engine)
    engine.cache.check()
    return [list(s.output) for s in seqs]


PREFIX = _prompt(1, 512)
TAILS = [_prompt(10 + i, 20) for i in range(4)]
PROMPTS = [PREFIX + t for t in TAILS]


@pytest.mark.parametrize("policy,names", [("forkkv", ["a0", "a1", "a2", "a3"]),
                                          ("prefix", ["a0"] * 4)])
def test_requests_submitted_together_compute_a_shared_prefix_once(policy, names):
    engine = _engine(policy, residual_fanout=False)  # forkkv: each agent computes its residual
    peak = []
    outs = _run(engine, PROMPTS, names, watch=lambda e: peak.append(e.stats()["base_pages_used"]))
    s = engine.stats()
    # One copy of the 32 prefix pages while they run: 32 + 4 tails of 2 pages at most.
    assert max(peak) <= 32 + 4 * 2, max(peak)
    assert s["base_hit_tokens"] == 3 * 512  # the followers hit the leader's pages
    if policy == "prefix":  # the same adapter: followers compute their tails only
        assert s["prefill_tokens_computed"] == 512 + 4 * 20
    else:  # each agent computes its own residual of the prefix, reading the leader's base
        assert s["prefill_tokens_computed"] == 4 * 532
    one_by_one = _engine(policy, residual_fanout=False)
    assert outs == [_run(one_by_one, [p], [n])[0] for p, n in zip(PROMPTS, names)]


def test_fanout_makes_a_later_fork_a_full_hit_and_is_exact_for_one_adapter():
    engine = _engine(residual_fanout=True)
    _run(engine, PROMPTS, ["a0", "a1", "a2", "a3"])
    s = engine.stats()
    assert s["prefill_tokens_computed"] == 512 + 4 * 20  # the leader wrote everyone's residual
    assert s["residual_hit_tokens"] == 3 * 512
    engine.flush_cache()
    engine.reset_stats()
    _run(engine, [PREFIX + _prompt(50, 7)], ["a0"])
    _run(engine, [PREFIX + _prompt(51, 9)], ["a1"])
    assert engine.stats()["prefill_tokens_computed"] == 519 + 9
    # A request naming no group fans out to nobody; fan-out of one adapter is exact caching.
    one = {"a0": ADAPTERS["a0"]}
    fan, exact = _engine(adapters=one, residual_fanout=True), _engine("prefix", adapters=one)
    assert _run(fan, PROMPTS, ["a0"] * 4, 8) == _run(exact, PROMPTS, ["a0"] * 4, 8)


def test_the_fanout_width_bounds_the_targets_not_what_they_cache():
    """A token writes `max_fanout_adapters` residual rows whatever the adapter slots: a0 fanning
    out to its group [a2, a3] at width 2 gives what the default width gives (outputs, and later
    forks of a2 and a3 that hit while a1 computes its residual); a request naming no group fans
    out to the first two other adapters in slots."""
    later = [PREFIX + _prompt(60 + i, 9) for i in range(3)]

    def run(engine, **kw):
        lead = _run_with(engine, PROMPTS[0], "a0", **kw)
        engine.reset_stats()
        forks = [_run(engine, [p], [n])[0] for p, n in zip(later, ["a1", "a2", "a3"])]
        return lead, forks, engine.stats()["prefill_tokens_computed"]
    narrow = run(_engine(max_fanout_adapters=2), fanout_adapters=["a2", "a3"])
    assert narrow == run(_engine(), fanout_adapters=["a2", "a3"])
    assert narrow[2] == 521 + 9 + 9
    assert run(_engine(residual_fanout=True, max_fanout_adapters=2))[2] == 9 + 9 + 521


def _run_with(engine, prompt, name, **kw):
    seq = engine.add_request(prompt, name, SamplingParams(max_new_tokens=4, ignore_eos=True), **kw)
    while engine.scheduler.has_work:
        engine.step()
    return list(seq.output)


def test_fanout_writes_the_other_agents_xA_from_this_agents_hidden_states(hf_suite):
    """The residual a0 writes for a1 is x·A_k, x·A_v of a1 with x a0's layer inputs: compared
    with transformers + PEFT in float64 (a0's hidden states, a1's A from its file)."""
    base, adapters = hf_suite["llama"]
    engine = forkjax.Engine.from_pretrained(
        base, adapters={"a0": adapters["qkvo8"], "a1": adapters["all4rs"]}, dtype="float32",
        cache_policy="forkkv", **SMALL)
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 203, 48)]
    seq = engine.add_request(prompt, "a0", SamplingParams(max_new_tokens=1),
                             fanout_adapters=["a1"])
    while engine.scheduler.has_work:
        engine.step()
    assert seq.status is Status.FINISHED
    key = engine.slots.by_name["a1"].content_hash
    n, pages, _ = engine.cache.res_tree.match_prefix(key, np.asarray(prompt, np.int32))
    assert n == 48
    hf = load_hf(base, torch.float64, adapters["qkvo8"])
    hidden = hf_hidden_states(hf, prompt)
    a = load_file(f"{adapters['all4rs']}/adapter_model.safetensors")
    pools = engine.runner.pools
    for layer in range(2):
        norm = hf.base_model.model.model.layers[layer].input_layernorm
        with torch.no_grad():
            x = norm(torch.tensor(hidden[layer])).numpy()
        for part, pool in (("k_proj", pools.res_k), ("v_proj", pools.res_v)):
            w = a[f"base_model.model.model.layers.{layer}.self_attn.{part}.lora_A.weight"]
            got = np.asarray(pool[layer])[pages].reshape(-1, pool.shape[-1])[:48]
            want = x @ w.T.astype(np.float64)
            np.testing.assert_allclose(got[:, :w.shape[0]], want, rtol=2e-4, atol=2e-5)
            assert not got[:, w.shape[0]:].any()  # ranks zero-padded to the slots' R


def test_a_waiting_request_is_not_starved_forever():
    """A long request behind a stream of short ones that reuse cached prefixes: `lpm` prefers
    the short ones until the long one has waited max_wait_s, then admits it first."""
    def admitted_after(max_wait_s):
        engine = _engine("prefix", kv_cache_bytes=26 * 32768, max_wait_s=max_wait_s,
                         max_batch_size=2)
        short = _prompt(5, 100)
        _run(engine, [short], ["a0"])  # cached: every later short request hits it
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        big = engine.add_request(_prompt(6, 300), "a0", params)
        started = []
        for i in range(12):
            seqs = [engine.add_request(short + [i + 3, 7], "a0", params) for _ in range(2)]
            while any(s.status is not Status.FINISHED for s in seqs):
                engine.step()
                if big.status is not Status.WAITING and not started:
                    started.append(i)
        while engine.scheduler.has_work:
            engine.step()
        return started[0] if started else None

    assert admitted_after(1e9) is None  # starved while short ones keep coming
    assert admitted_after(0.0) == 0  # urgent at once: admitted before the later ones


def test_session_pages_are_evicted_after_others():
    engine = _engine("prefix", kv_cache_bytes=40 * 32768)
    a, b = _prompt(7, 200), _prompt(8, 200)
    engine.generate([a], adapters="a0", max_new_tokens=2, session_id="agent-a")
    engine.generate([b], adapters="a0", max_new_tokens=2)  # newer, but no session
    s0 = engine.stats()
    engine.generate([_prompt(9, 300)], adapters="a0", max_new_tokens=2)  # needs room
    hits = engine.stats()["base_hit_tokens"]
    engine.generate([a], adapters="a0", max_new_tokens=2)
    engine.generate([b], adapters="a0", max_new_tokens=2)
    s1 = engine.stats()
    assert s1["evicted_base_pages"] > s0["evicted_base_pages"]
    assert engine.stats()["base_hit_tokens"] - hits == 192  # a's 12 pages survived, b's did not
    assert s1["prefill_tokens_computed"] - s0["prefill_tokens_computed"] == 300 + 8 + 200


def test_counters_reset_and_flush():
    engine = _engine("forkkv")
    engine.generate([PROMPTS[0]], adapters="a0", max_new_tokens=2)
    s = engine.reset_stats()
    assert s["prefill_tokens_computed"] == 532 and s["decode_batch_size_mean"] == 1.0
    assert s["base_hit_rate"] == 0.0
    z = engine.stats()
    assert z["prefill_tokens_computed"] == z["prompt_tokens"] == z["decode_steps"] == 0
    engine.generate([PROMPTS[0]], adapters="a0", max_new_tokens=2)
    s = engine.stats()
    assert s["base_hit_rate"] == s["residual_hit_rate"] == 528 / 532
    assert engine.flush_cache() > 0
    s = engine.stats()
    assert s["base_pages_used"] == s["residual_pages_used"] == 0


def test_residual_pool_follows_the_adapters_loaded_at_start():
    def split(**kw):
        e = _engine(**kw)
        return e.stats()["residual_pages_total"] / e.stats()["base_pages_total"]
    assert split() == pytest.approx(4, rel=0.02)  # one residual copy per adapter
    assert split(adapters={"a0": ADAPTERS["a0"]}) == pytest.approx(1, rel=0.02)
    e = _engine(residual_fraction=0.5)
    lay = e.runner.layout
    assert lay.res_pages * lay.res_page_bytes == pytest.approx(lay.base_pages * lay.base_page_bytes,
                                                               rel=0.02)
    # Four adapters, but each context is read by two of them (a workflow's agents): room for two
    assert split(residual_copies=2) == pytest.approx(2, rel=0.02)


@pytest.mark.parametrize("kw,call,err", [
    (dict(policy="prefix"), dict(fanout_adapters=["a1"]), "forkkv"),
    ({}, dict(fanout_adapters=["nobody"]), "unknown adapter"),
    ({}, dict(fanout_adapters="a1"), "list of adapter names"),
    ({}, dict(session_id=5), "session_id"),
    (dict(max_fanout_adapters=1), dict(fanout_adapters=["a1", "a2"]), "max_fanout_adapters=1"),
])
def test_bad_sharing_arguments_are_refused(kw, call, err):
    engine = _engine(**kw)
    with pytest.raises((ValueError, KeyError), match=err):
        engine.add_request([1, 2, 3], "a0", **call)
    assert not engine.scheduler.has_work


@pytest.mark.parametrize("kw,err", [(dict(cache_policy="prefix", residual_fanout=True), "forkkv"),
                                    (dict(schedule_policy="random"), "schedule_policy"),
                                    (dict(residual_fraction=1.5), "residual_fraction"),
                                    (dict(residual_copies=0), "residual_copies"),
                                    (dict(max_fanout_adapters=7), r"max_fanout_adapters=7: .* \[0, 6\]"),
                                    (dict(max_loras=4, max_fanout_adapters=-1), r"\[0, 2\]"),
                                    (dict(residual_copies=2, residual_fraction=0.1), "give one"),
                                    (dict(cache_policy="prefix", residual_copies=2), "forkkv")])
def test_bad_engine_options_are_refused(kw, err):
    with pytest.raises(ValueError, match=err):
        forkjax.Engine.from_pretrained("tiny-llama", **dict(SMALL, **kw))
