"""Adapter isolation: a slot's weights reach only its own tokens, non-finite weights are refused,
and a request that computes NaN or inf ends with an error and caches nothing of it."""

import dataclasses

import numpy as np
import pytest

import forkjax
from conftest import SMALL
from forkjax.config import ModelConfig
from forkjax.engine.sequence import NonFiniteError, SamplingParams
from forkjax.models.builtin import BUILTIN_CONFIGS, random_adapter

TINY = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
GOOD = {f"a{i}": random_adapter(f"a{i}", TINY, 8, 1.0, ATTN, seed=i) for i in range(2)}


def _poisoned(name, value, where=(1, "v_proj", 1)):
    """GOOD["a0"]'s weights under `name` with one entry of `where` (layer, module, A=0/B=1)."""
    weights = {k: (a.copy(), b.copy()) for k, (a, b) in GOOD["a0"].weights.items()}
    layer, module, ab = where
    weights[(layer, module)][ab][3, 2] = value
    return dataclasses.replace(GOOD["a0"], name=name, weights=weights)


def _overflowing(name):
    """Finite weights whose products overflow float32: every xA is +-inf."""
    weights = {k: (np.full_like(a, 3e38), b) for k, (a, b) in GOOD["a1"].weights.items()}
    return dataclasses.replace(GOOD["a1"], name=name, weights=weights)


def _prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 256, n)]


def _engine(policy, adapters):
    return forkjax.Engine.from_pretrained("tiny-llama", adapters=adapters, dtype="float32",
                                          cache_policy=policy, **SMALL)


def _run(engine, prompts, names, max_new_tokens=6):
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, n, params) for p, n in zip(prompts, names)]
    while engine.scheduler.has_work:
        engine.step()
    engine.cache.check()
    return seqs


PROMPTS = [_prompt(i, n) for i, n in enumerate((40, 150, 90))]
NAMES = ["a0", "a1", None]


def test_non_finite_adapters_are_refused_and_change_nothing():
    engine = _engine("forkkv", GOOD)
    before = [s.output for s in _run(engine, PROMPTS, NAMES)]
    for value in (np.nan, -np.inf):
        with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.v_proj\.lora_B\.weight has 1 non"):
            engine.load_adapter("bad", _poisoned("bad", value))
        assert "bad" not in engine.slots.by_name
    engine.flush_cache()
    assert [s.output for s in _run(engine, PROMPTS, NAMES)] == before
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.lora_A\.weight"):
        _engine("prefix", {"bad": _poisoned("bad", np.inf, (0, "q_proj", 0))})


@pytest.mark.parametrize("policy", ["prefix", "forkkv"])
def test_an_overflowing_adapter_changes_no_other_request_and_caches_nothing(policy):
    """Batched with other agents, the overflowing adapter's request fails alone; the others'
    greedy outputs are those of a run without it, and later requests on its prompt hit nothing
    it computed (a base hit would read NaN under forkkv)."""
    huge_prompt = _prompt(9, 300)  # three prefill chunks
    with_huge = _engine(policy, {**GOOD, "huge": _overflowing("huge")})
    seqs = _run(with_huge, PROMPTS + [huge_prompt], NAMES + ["huge"])
    assert isinstance(seqs[-1].error, NonFiniteError) and seqs[-1].finish_reason == "error"
    alone = _engine(policy, GOOD)
    assert [s.output for s in seqs[:-1]] == [s.output for s in _run(alone, PROMPTS, NAMES)]
    with_huge.reset_stats()
    later = _run(with_huge, [huge_prompt], ["a0"])[0]
    assert with_huge.stats()["base_hit_tokens"] == 0
    assert later.output == _run(alone, [huge_prompt], ["a0"])[0].output
    with pytest.raises(NonFiniteError, match="NaN or inf"):
        with_huge.generate([huge_prompt], "huge", max_new_tokens=2)


def test_fanout_residuals_that_overflow_are_not_cached_and_change_nothing():
    """An agent fanning out to an adapter whose A overflows on its hidden states: its own
    request and the fan-out to a sound adapter go on; nothing is cached for the overflowing one
    (its forks compute their own residual, and fail on their own)."""
    engine = _engine("forkkv", {**GOOD, "huge": _overflowing("huge")})
    prompt = _prompt(11, 150)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    seq = engine.add_request(prompt, "a0", params, fanout_adapters=["a1", "huge"])
    while engine.scheduler.has_work:
        engine.step()
    engine.cache.check()
    assert seq.error is None
    assert seq.output == _run(_engine("forkkv", GOOD), [prompt], ["a0"])[0].output
    residual_hits = {name: engine.cache.match_lengths(prompt, engine.slots.key_of(name), [])[1]
                     for name in ("a1", "huge")}
    assert residual_hits == {"a1": 144, "huge": 0}  # a1: the prompt's whole pages


@pytest.mark.parametrize("policy,names", [("forkkv", ["a0", "a1"]), ("prefix", ["a0", "a0"])])
def test_cache_salt_blocks_sharing_across_salts_and_allows_it_within_one(policy, names):
    engine = _engine(policy, GOOD)
    prompt = _prompt(5, 96)  # 6 whole pages

    def hits(adapter, salt, fanout=(), tokens=prompt):  # (): no fan-out; None: the default's
        engine.reset_stats()
        engine.generate([tokens + [7]], adapter, max_new_tokens=2, cache_salt=salt,
                        fanout_adapters=None if fanout is None else list(fanout))
        s = engine.stats()
        return s["base_hit_tokens"], s["residual_hit_tokens"]

    assert hits(names[0], "tenant-a") == (0, 0)
    assert hits(names[1], "tenant-b") == (0, 0)  # another salt: nothing shared
    assert hits(names[1], None) == (0, 0)  # nor without one
    assert hits(names[1], "tenant-a")[0] == 96  # the same salt: the base is shared
    if policy == "forkkv":  # a residual only with its own agent within that salt
        assert hits("a0", "tenant-a") == (96, 96) and hits("a0", "tenant-b") == (96, 0)
        # the default fan-out writes the other agents' residuals within its request's salt only
        other = _prompt(6, 96)
        assert hits("a1", "tenant-c", None, other) == (0, 0)
        assert hits("a0", "tenant-c", (), other) == (96, 96) and hits("a0", "tenant-d", (), other) == (0, 0)
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(prompt, "a0", cache_salt="")
