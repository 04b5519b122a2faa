"""More adapters than device slots (lora/slots.py): adapters wait on the host and take a slot
when a request needs one, least recently used first; outputs equal those of an engine with a
slot for every adapter (and PEFT's), pinned adapters keep theirs, and the bounds are clear
errors."""

import numpy as np
import pytest

import forkjax
from conftest import SMALL
from forkjax.config import ModelConfig
from forkjax.engine.sequence import SamplingParams, Status
from forkjax.lora.targets import TARGETS
from forkjax.models.builtin import BUILTIN_CONFIGS, random_adapter
from hf_utils import hf_logits, load_hf, rel_err

TINY = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
NAMES = [f"a{i}" for i in range(5)]


def _adapters(names=NAMES):
    return {n: random_adapter(n, TINY, 8, 16.0, ATTN, seed=i) for i, n in enumerate(names)}


def _engine(policy="prefix", **kw):
    return forkjax.Engine.from_pretrained("tiny-llama", adapters=_adapters(), dtype="float32",
                                          cache_policy=policy, **{**SMALL, **kw})


def _prompt(seed, n=40, vocab=256):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def _run_all(engine, jobs):
    """Submit every (prompt, adapter) at once and step until all finish -> outputs."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    seqs = [engine.add_request(p, a, params) for p, a in jobs]
    while any(s.status is not Status.FINISHED for s in seqs):
        engine.step()
    assert all(s.error is None for s in seqs)
    return [s.output for s in seqs]


def _mixed_adapters(base: str, peft_dirs: dict) -> dict:
    """Twelve adapters of mixed ranks (2-16) and target sets: the checkpoint's three PEFT ones
    (q/k/v/o rank 8; every projection rank 4 with rsLoRA; v rank 16) and nine random ones."""
    cfg = ModelConfig.from_hf(base)
    targets = [("q_proj",), ("v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"),
               ("k_proj", "down_proj"), TARGETS]
    own = {f"r{i}": random_adapter(f"r{i}", cfg, (2, 4, 8, 16)[i % 4], 16.0, targets[i % 5], seed=i)
           for i in range(9)}
    return {**peft_dirs, **own}


def _staggered(engine, jobs, per_step=3):
    """Submit `per_step` of the (prompt, adapter) jobs a step, stepping until all finish -> outputs."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    seqs = []
    while len(seqs) < len(jobs) or any(s.status is not Status.FINISHED for s in seqs):
        seqs += [engine.add_request(p, a, params) for p, a in jobs[len(seqs):len(seqs) + per_step]]
        engine.step()
    assert all(s.error is None for s in seqs)
    return [s.output for s in seqs]


@pytest.mark.parametrize("policy", ["prefix", "forkkv"])
def test_twelve_adapters_in_three_slots_give_the_outputs_of_thirteen(policy, hf_suite):
    """Fourteen requests over twelve adapters of mixed ranks and targets and the base model, on
    an engine with three adapter slots: each batch holds at most three adapters, the others
    wait on the host and swap in as slots free up, least recently used first, never out of the
    running batch. Every output (float32, greedy) equals the thirteen-slot engine's, whether the
    requests come at once or in another order, a few a step; under `prefix` a swapped-in PEFT
    adapter's logits equal transformers + PEFT's."""
    base, peft_dirs = hf_suite["llama"]
    adapters = _mixed_adapters(base, peft_dirs)
    names = list(adapters)
    jobs = [(_prompt(i, 20 + 3 * i, 203), names[i % 12] if i < 12 else None) for i in range(14)]
    # no fan-out: it keeps the adapters it writes for in their slots, and this is about swaps
    kw = dict(SMALL, adapters=adapters, dtype="float32", cache_policy=policy, residual_fanout=False)
    wide = forkjax.Engine.from_pretrained(base, max_loras=13, **kw)
    narrow = forkjax.Engine.from_pretrained(base, max_loras=4, **kw)
    want = _run_all(wide, jobs)
    assert _run_all(narrow, jobs) == want
    s = narrow.stats()
    assert s["loras_loaded"] == 12 and s["loras_in_slots"] == 3 and wide.stats()["lora_swaps"] == 0
    assert s["lora_swaps"] >= 9 and s["lora_swap_bytes"] >= 9 * min(a.nbytes for a in adapters.values()
                                                                     if not isinstance(a, str))
    # Swapped out and back, an adapter finds its own cached prefix (keys are content hashes).
    assert jobs[0][1] not in narrow.slots.slot_by_name
    before = narrow.stats()["base_hit_tokens"]
    assert _run_all(narrow, [jobs[0]]) == [want[0]]
    assert narrow.stats()["base_hit_tokens"] - before >= 16
    narrow.flush_cache()
    order = np.random.default_rng(0).permutation(len(jobs))
    got = _staggered(narrow, [jobs[i] for i in order])
    assert [got[list(order).index(i)] for i in range(len(jobs))] == want
    if policy == "prefix":
        prompt = _prompt(99, 30, 203)
        for name, path in peft_dirs.items():
            ref = hf_logits(load_hf(base, adapter_dir=path), prompt)
            assert rel_err(narrow.score(prompt, adapter=name), ref) < 1e-4, name


def test_pinned_adapters_keep_their_slots_and_bounds_are_clear_errors():
    engine = _engine("forkkv", max_loras=3, pinned_adapters=["a4"])  # a4, and one slot for the others
    slot = engine.slots.slot_by_name["a4"]
    _run_all(engine, [(_prompt(i), n) for i, n in enumerate(NAMES[:4] * 2)])
    assert engine.slots.slot_by_name["a4"] == slot and engine.stats()["lora_swaps"] > 0
    with pytest.raises(ValueError, match="pinned"):  # one slot stays for the unpinned ones
        engine.load_adapter("a3", _adapters()["a3"], pinned=True)
    with pytest.raises(ValueError, match="device slots at once"):  # a0 and a1 in one slot
        engine.add_request(_prompt(0), "a0", fanout_adapters=["a1"])
    engine.unload_adapter("a2")  # an adapter on the host only
    assert "a2" not in engine.slots.by_name
    with pytest.raises(KeyError):
        engine.add_request(_prompt(0), "a2")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        _engine(max_cpu_loras=4)
    bounded = _engine(max_cpu_loras=5)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        bounded.load_adapter("a5", random_adapter("a5", TINY, 8, 16.0, ATTN, seed=5))
    assert set(bounded.slots.by_name) == set(NAMES)
    with pytest.raises(ValueError, match="pinned_adapters"):
        _engine(pinned_adapters=["nope"])


def test_unloading_an_adapter_waits_for_requests_that_fan_out_to_it():
    engine = _engine("forkkv")
    seq = engine.add_request(_prompt(1), "a0", SamplingParams(max_new_tokens=4, ignore_eos=True),
                             fanout_adapters=["a1"])
    assert seq.targets == {engine.slots.key_of("a1"): "a1"}
    engine.unload_adapter("a1")  # steps until the request that writes a1's residual is done
    assert seq.status is Status.FINISHED and seq.error is None and len(seq.output) == 4
    assert "a1" not in engine.slots.by_name and "a1" not in engine.slots.slot_by_name


def test_requests_on_adapters_in_slots_go_first():
    """One adapter slot, a0 in it; queued a1, a0, a1, a0: the a0 requests run first and a1 swaps
    in once, after them (in arrival order a1 would evict a0 and a0 swap back: two swaps)."""
    engine = _engine(max_loras=2)
    assert engine.slots.slot_by_name == {"a0": 1}
    jobs = [(_prompt(i), n) for i, n in enumerate(["a1", "a0", "a1", "a0"])]
    outs = _run_all(engine, jobs)
    assert engine.stats()["lora_swaps"] == 1 and engine.slots.slot_by_name == {"a1": 1}
    assert outs == _run_all(_engine(), jobs)
