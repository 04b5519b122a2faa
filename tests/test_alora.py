"""Activated LoRA: an adapter that acts from the last occurrence of its invocation tokens on.
forkjax against PEFT's own aLoRA forward and generate (float32, tiny random Llama and Qwen2,
aLoRA and plain adapters mixed in one batch, invocations at several positions, repeated
invocation tokens, both LoRA paths), and its cache: the part before an invocation is the base
model's own K/V, computed once for the base model and every aLoRA agent."""

import numpy as np
import pytest
import torch

import forkjax
from conftest import SMALL
from forkjax.cache.policy import Activated, key_tokens
from forkjax.engine.requests import InvalidArgument
from forkjax.lora.activated import invocation_start
from hf_utils import hf_greedy, hf_logits, load_hf, make_adapter, rel_err

# token ids below 12 appear in prompts only where a test puts them
INVOCATIONS = {"inv1": [5, 6, 7], "inv2": [9, 9, 11]}
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def alora_suite(hf_suite, tmp_path_factory):
    """{kind: (base dir, {name: adapter dir})}: each tiny base with two aLoRA adapters and one
    plain adapter of the shared suite."""
    root = tmp_path_factory.mktemp("alora")
    out = {}
    for kind in ("llama", "qwen2"):
        base, plain = hf_suite[kind]
        name = next(iter(plain))
        ads = {name: plain[name]}
        for i, (a, inv) in enumerate(INVOCATIONS.items()):
            targets = ATTN if i == 0 else ATTN + ["gate_proj", "up_proj", "down_proj"]
            ads[a] = make_adapter(base, str(root / f"{kind}-{a}"), 8, 16, False, targets,
                                  seed=40 + i, alora_invocation_tokens=inv, task_type="CAUSAL_LM")
        out[kind] = (base, ads)
    return out


def _prompt(seed, n, vocab, invocation=(), at=()):
    """n random ids in [12, vocab) with `invocation` written at each position of `at`."""
    ids = np.random.default_rng(seed).integers(12, vocab, n)
    for p in at:
        ids[p:p + len(invocation)] = invocation
    return [int(t) for t in ids]


def _engine(base, adapters, policy="prefix", **kw):
    return forkjax.Engine.from_pretrained(base, adapters=adapters, dtype="float32",
                                          cache_policy=policy, **dict(SMALL, **kw))


def test_invocation_start_is_the_last_occurrence():
    assert invocation_start([1, 2, 3, 1, 2, 3, 4], (1, 2, 3)) == 3
    assert invocation_start([9, 9, 9, 11], (9, 9, 11)) == 1
    assert invocation_start([9, 9], (9, 9, 11)) == -1
    assert invocation_start([4, 5, 6], (5,)) == 1


def test_activated_keys_branch_off_the_base_path_at_the_invocation():
    tokens = np.arange(20, 30, dtype=np.int32)
    key = key_tokens(tokens, Activated("h", 3, 4))
    np.testing.assert_array_equal(key[:4], tokens[:4])
    assert (key[4:] < 0).all() and len(set(key[4:].tolist())) == 6
    np.testing.assert_array_equal(key_tokens(key, Activated("h", 3, 4)), key)  # idempotent
    assert (key_tokens(tokens, Activated("h", 2, 4))[4:] != key[4:]).all()  # another adapter
    np.testing.assert_array_equal(key_tokens(tokens, "plain"), tokens)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_float32_logits_match_peft_alora_forward(alora_suite, kind):
    base, adapters = alora_suite[kind]
    engine = _engine(base, adapters)
    vocab = engine.model_cfg.vocab_size
    for name in INVOCATIONS:
        inv = INVOCATIONS[name]
        ref_model = load_hf(base, adapter_dir=adapters[name])
        # at the start, in the middle, near the end, and twice (the last one counts)
        for at in [(0,), (17,), (37,), (6, 25)]:
            ids = _prompt(sum(at) + len(name), 41, vocab, inv, at)
            ours = engine.score(ids, adapter=name)
            assert rel_err(ours, hf_logits(ref_model, ids)) < 1e-4, (kind, name, at)


# forkkv: aLoRA rows fold their LoRA K/V into the base pool beside plain rows' residuals
@pytest.mark.parametrize("kind,lora_path,policy", [("llama", "fused", "prefix"), ("qwen2", "fused", "prefix"),
                                                   ("llama", "sgmv", "prefix"), ("qwen2", "fused", "forkkv"),
                                                   ("llama", "sgmv", "forkkv")])
def test_mixed_batch_greedy_equals_peft_generate(alora_suite, kind, lora_path, policy):
    base, adapters = alora_suite[kind]
    engine = _engine(base, adapters, policy, lora_path=lora_path)
    vocab = engine.model_cfg.vocab_size
    plain = next(n for n in adapters if n not in INVOCATIONS)
    names = [None, plain, "inv1", "inv2", "inv1", "inv2", plain]
    prompts = []
    for i, name in enumerate(names):
        inv = INVOCATIONS.get(name, ())
        n = 9 + 6 * i
        prompts.append(_prompt(100 + i, n, vocab, inv, [(i * 5) % (n - 3)] if inv else []))
    ours = engine.generate(prompts, adapters=names, max_new_tokens=8, ignore_eos=True)
    for name, ids, out in zip(names, prompts, ours):
        ref = load_hf(base, torch.float32, adapters.get(name))
        assert out == hf_greedy(ref, ids, 8), (kind, name, ids)


@pytest.mark.parametrize("policy", ["prefix", "full_reuse", "forkkv", "lrshared"])
def test_agents_after_the_base_model_compute_only_what_follows_their_invocation(alora_suite, policy):
    base, adapters = alora_suite["llama"]
    engine = _engine(base, adapters, policy)
    alone = _engine(base, adapters, policy)
    vocab = engine.model_cfg.vocab_size
    prefix = _prompt(7, 64, vocab)  # 4 whole pages
    tails = {n: INVOCATIONS[n] + _prompt(8 + i, 5, vocab) for i, n in enumerate(INVOCATIONS)}
    # the base model and a plain adapter first: under the policies that share base K/V between
    # adapters, those pages are not exact (the base model's own are the bare model's namespace
    # under `prefix`), so the first agent computes the prefix there, once for every agent
    for name in [None] + [n for n in adapters if n not in INVOCATIONS]:
        engine.generate([prefix], adapters=[name], max_new_tokens=4, ignore_eos=True)
    for i, (name, tail) in enumerate(tails.items()):
        before = engine.stats()["prefill_tokens_computed"]
        out = engine.generate([prefix + tail], adapters=[name], max_new_tokens=6, ignore_eos=True)
        computed = engine.stats()["prefill_tokens_computed"] - before
        first = policy != "prefix" and i == 0
        assert computed == len(tail) + (len(prefix) if first else 0), (policy, name, computed)
        assert out == alone.generate([prefix + tail], adapters=[name], max_new_tokens=6,
                                     ignore_eos=True), (policy, name)
    engine.cache.check()


def test_a_prompt_without_its_invocation_is_refused(alora_suite):
    base, adapters = alora_suite["llama"]
    engine = _engine(base, adapters)
    with pytest.raises(InvalidArgument, match=r"'inv1'.*\[5, 6, 7\]") as e:
        engine.add_request(_prompt(3, 20, engine.model_cfg.vocab_size), "inv1")
    assert e.value.param == "prompt" and not engine.scheduler.has_work


def test_host_tier_salts_and_sessions_keep_the_sharing_exact(alora_suite):
    """The base model's pages of a context, pushed to the host, come back for an aLoRA agent of
    the same salt (a session's turn), never for one of another salt; outputs are the agent's
    alone."""
    base, adapters = alora_suite["llama"]
    engine = _engine(base, adapters, "forkkv", host_kv_bytes=16 << 20)
    alone = _engine(base, adapters, "forkkv")
    vocab = engine.model_cfg.vocab_size
    prefix, tail = _prompt(11, 64, vocab), INVOCATIONS["inv1"] + _prompt(12, 6, vocab)
    want = alone.generate([prefix + tail], adapters=["inv1"], max_new_tokens=5, ignore_eos=True)
    engine.generate([prefix + INVOCATIONS["inv2"]], adapters=["inv2"], max_new_tokens=3,
                    cache_salt="team-a", session_id="w")
    assert engine.cache.evict(1 << 20) > 0
    computed = engine.stats()["prefill_tokens_computed"]
    out = engine.generate([prefix + tail], adapters=["inv1"], max_new_tokens=5, ignore_eos=True,
                          cache_salt="team-b")
    assert out == want and engine.stats()["host_hit_tokens"] == 0
    assert engine.stats()["prefill_tokens_computed"] - computed == len(prefix + tail)
    computed = engine.stats()["prefill_tokens_computed"]
    out = engine.generate([prefix + tail], adapters=["inv1"], max_new_tokens=5, ignore_eos=True,
                          cache_salt="team-a", session_id="w2")
    s = engine.stats()
    assert s["prefill_tokens_computed"] - computed == len(tail), s
    assert out == want and s["host_hit_tokens"] >= len(prefix), s
    engine.cache.check()


def test_a_session_keeps_an_agents_base_part_and_frees_what_followed_its_invocation(alora_suite):
    """ReAct-style turns: each invokes its agent again after the last turn's output, so what
    followed the last invocation is never read again: freed when the turn ends, its base part
    held for the next turn, which computes only what is new."""
    base, adapters = alora_suite["llama"]
    engine = _engine(base, adapters, "prefix")
    vocab, S = engine.model_cfg.vocab_size, engine.cache.page_size
    prompt = _prompt(21, 64, vocab) + INVOCATIONS["inv1"] + _prompt(22, 5, vocab)
    out = engine.generate([prompt], adapters=["inv1"], max_new_tokens=24, ignore_eos=True,
                          session_id="w")[0]
    # the 64 context tokens (4 pages) held; the invocation's page on is gone
    assert engine.stats()["base_pages_used"] == 64 // S
    computed = engine.stats()["prefill_tokens_computed"]
    turn = prompt + out + _prompt(23, 7, vocab) + INVOCATIONS["inv1"] + _prompt(24, 3, vocab)
    engine.generate([turn], adapters=["inv1"], max_new_tokens=4, ignore_eos=True, session_id="w")
    assert engine.stats()["prefill_tokens_computed"] - computed == len(turn) - 64
    engine.cache.check()
