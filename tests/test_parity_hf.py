"""forkjax against the PyTorch reference (transformers + PEFT) on tiny random checkpoints."""

import numpy as np
import pytest
import torch

from hf_utils import hf_greedy, hf_hidden_states, hf_logits, load_hf, rel_err

KINDS = ("llama", "qwen2")
# bf16 tolerance: relative logits error against the float64 reference. Our bf16 path rounds where
# HF's does (projections, RoPE tables, residual stream), so its error is that of HF's own bf16 run
# (about 1-2% on these models): we require at most 1.5x HF's own bf16 error and at most 4e-2.
BF16_TOL = 4e-2
BF16_VS_HF_FACTOR = 1.5


def _prompt(seed, n, vocab):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def _adapters(hf_suite, kind):
    return [None] + list(hf_suite[kind][1])


@pytest.mark.parametrize("kind", KINDS)
def test_float32_logits_match_every_adapter(hf_suite, engine_for, kind):
    base, adapters = hf_suite[kind]
    engine = engine_for(kind, "float32")
    ids = _prompt(0, 45, engine.model_cfg.vocab_size)
    for name in _adapters(hf_suite, kind):
        ref = hf_logits(load_hf(base, adapter_dir=adapters.get(name)), ids)
        ours = engine.score(ids, adapter=name)
        assert ours.shape == ref.shape and ours.dtype == np.float32
        assert rel_err(ours, ref) < 1e-4, (kind, name)


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_logits_within_documented_tolerance(hf_suite, engine_for, kind):
    base, adapters = hf_suite[kind]
    engine = engine_for(kind, "bfloat16")
    ids = _prompt(1, 40, engine.model_cfg.vocab_size)
    for name in _adapters(hf_suite, kind):
        ref = hf_logits(load_hf(base, adapter_dir=adapters.get(name)), ids)
        hf_bf16 = hf_logits(load_hf(base, torch.bfloat16, adapters.get(name)), ids)
        err = rel_err(engine.score(ids, adapter=name), ref)
        assert err < BF16_TOL, (kind, name, err)
        assert err < BF16_VS_HF_FACTOR * rel_err(hf_bf16, ref) + 1e-3, (kind, name, err)


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_adapter_batch_greedy_equals_hf_generate(hf_suite, engine_for, kind):
    base, adapters = hf_suite[kind]
    engine = engine_for(kind, "float32")
    names = _adapters(hf_suite, kind)
    # Every adapter and the bare base model in one batch, prompts of different lengths, some
    # adapters twice, order not grouped by adapter.
    batch = names + names[::-1]
    prompts = [_prompt(100 + i, 5 + 7 * i, engine.model_cfg.vocab_size) for i in range(len(batch))]
    ours = engine.generate(prompts, adapters=batch, max_new_tokens=10)
    refs = {name: load_hf(base, torch.float32, adapters.get(name)) for name in names}
    for prompt, name, got in zip(prompts, batch, ours):
        assert got == hf_greedy(refs[name], prompt, 10), (kind, name)


def test_mixed_batch_scores_equal_single_requests(engine_for):
    """Rows of different adapters in one forward do not leak into each other."""
    engine = engine_for("llama", "float32")
    names = [None, "qkvo8", "all4rs", "v16"]
    prompts = [_prompt(200 + i, 9 + 4 * i, engine.model_cfg.vocab_size) for i in range(4)]
    seqs = [engine.add_request(p, n, score=True) for p, n in zip(prompts, names)]
    engine._run_until_done(seqs)
    for p, n, seq in zip(prompts, names, seqs):
        got = np.concatenate(seq.prompt_logits)
        np.testing.assert_allclose(got, engine.score(p, adapter=n), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_hidden_states_match_hf_layer_by_layer(hf_suite, engine_for, kind):
    """score(return_hidden_states=True) against HF's output_hidden_states, chunked prefill and
    a cached prefix included (the second prompt shares the first's leading pages)."""
    base, adapters = hf_suite[kind]
    engine = engine_for(kind, "float32")
    name = list(adapters)[0]
    hf = load_hf(base, adapter_dir=adapters[name])
    ids = _prompt(3, 150, engine.model_cfg.vocab_size)
    for prompt in (ids, ids[:96] + _prompt(4, 20, engine.model_cfg.vocab_size)):
        logits, hidden = engine.score(prompt, adapter=name, return_hidden_states=True)
        ref = hf_hidden_states(hf, prompt)
        assert hidden.shape == (len(ref), len(prompt), engine.model_cfg.hidden_size)
        for layer, (ours, theirs) in enumerate(zip(hidden, ref)):
            assert rel_err(ours, theirs) < 1e-4, (kind, layer)
        assert rel_err(logits, hf_logits(hf, prompt)) < 1e-4


def test_score_from_a_position_reads_the_cached_prefix(hf_suite, engine_for):
    """score(start=k) gives HF's logits and hidden states of positions k.. and computes only
    what the cache lacks (a cached 96-token prefix is read, not run again)."""
    base, adapters = hf_suite["llama"]
    engine = engine_for("llama", "float32")
    name = list(adapters)[0]
    hf = load_hf(base, adapter_dir=adapters[name])
    ctx = _prompt(5, 96, engine.model_cfg.vocab_size)
    engine.generate([ctx], adapters=[name], max_new_tokens=1)
    prompt = ctx + _prompt(6, 24, engine.model_cfg.vocab_size)
    before = engine.stats()["prefill_tokens_computed"]
    logits, hidden = engine.score(prompt, adapter=name, start=100, return_hidden_states=True)
    assert engine.stats()["prefill_tokens_computed"] - before == len(prompt) - 96
    assert logits.shape == (len(prompt) - 100, engine.model_cfg.vocab_size)
    assert rel_err(logits, hf_logits(hf, prompt)[100:]) < 1e-4
    for ours, theirs in zip(hidden, hf_hidden_states(hf, prompt)):
        assert rel_err(ours, theirs[100:]) < 1e-4
    with pytest.raises(ValueError, match="start"):
        engine.score(prompt, adapter=name, start=len(prompt))
