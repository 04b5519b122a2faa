"""The engine over the paged dual cache: exactness, forks, partial hits, memory pressure."""

import numpy as np
import pytest
import torch

import forkjax
from conftest import SMALL
from forkjax.config import ModelConfig
from forkjax.lora.peft import LoraAdapter
from forkjax.models.builtin import BUILTIN_CONFIGS, random_adapter
from hf_utils import hf_greedy, hf_logits, load_hf, rel_err

TINY = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
POLICIES = ("prefix", "full_reuse", "forkkv", "lrshared")


def _prompt(seed, n, vocab=256):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def _mild_adapters(n=3, alpha=1.0):
    """Adapters that change the logits by ~8%, like a fine-tune rather than a new model."""
    return {f"a{i}": random_adapter(f"a{i}", TINY, 8, alpha, ATTN, seed=i) for i in range(n)}


def _shared_a_adapters(n=3):
    """Adapters sharing every A (lrshared's requirement), with their own B."""
    first = random_adapter("s0", TINY, 8, 1.0, ATTN, seed=0)
    out = {"s0": first}
    for i in range(1, n):
        other = random_adapter(f"s{i}", TINY, 8, 1.0, ATTN, seed=i)
        weights = {k: (first.weights[k][0], other.weights[k][1]) for k in first.weights}
        out[f"s{i}"] = LoraAdapter(f"s{i}", 8, other.scaling, weights)
    return out


@pytest.fixture(scope="module")
def forkkv_llama(hf_suite):
    base, adapters = hf_suite["llama"]
    return forkjax.Engine.from_pretrained(base, adapters={"qkvo8": adapters["qkvo8"]},
                                          dtype="float32", cache_policy="forkkv", **SMALL)


def test_forkkv_one_adapter_is_exact_through_hits_and_chunks(hf_suite, forkkv_llama):
    """300 tokens = 3 prefill chunks of 128; the second time every whole page is a hit."""
    base, adapters = hf_suite["llama"]
    engine = forkkv_llama
    prompt = _prompt(7, 300, 203)
    ref = hf_logits(load_hf(base, adapter_dir=adapters["qkvo8"]), prompt)
    first = engine.score(prompt, adapter="qkvo8")
    hits = engine.stats()["base_hit_tokens"]
    again = engine.score(prompt, adapter="qkvo8")
    s = engine.stats()
    assert s["base_hit_tokens"] - hits == 288 and s["residual_hit_tokens"] >= 288
    assert rel_err(first, ref) < 1e-4 and rel_err(again, ref) < 1e-4
    # Generation after a full-page hit continues exactly like HF.
    gen = engine.generate([prompt[:150]], adapters="qkvo8", max_new_tokens=8)[0]
    hf = load_hf(base, torch.float32, adapters["qkvo8"])
    assert gen == hf_greedy(hf, prompt[:150], 8)


def test_prefix_many_adapters_exact_from_cache_hits(hf_suite, engine_for):
    base, adapters = hf_suite["llama"]
    engine = engine_for("llama", "float32")  # prefix policy
    prompt = _prompt(8, 200, 203)
    for name in ("qkvo8", "v16", None):
        ref = hf_logits(load_hf(base, adapter_dir=adapters.get(name)), prompt)
        engine.score(prompt, adapter=name)
        assert rel_err(engine.score(prompt, adapter=name), ref) < 1e-4, name


def _fork(policy, adapters, prompt):
    """a1 scores a prompt a0 scored; without fan-out, a forkkv reader computes its own residual."""
    e = forkjax.Engine.from_pretrained("tiny-llama", adapters=adapters, dtype="float32",
                                       cache_policy=policy, residual_fanout=False, **SMALL)
    e.score(prompt, adapter="a0")
    before = e.stats()
    out = e.score(prompt, adapter="a1")
    return out, before, e.stats()


def test_fork_reuses_base_pages_writes_only_residual_and_beats_full_reuse():
    adapters = _mild_adapters(2)
    prompt = _prompt(9, 90)
    exact, _, _ = _fork("prefix", adapters, prompt)
    forked, before, after = _fork("forkkv", adapters, prompt)
    full, _, _ = _fork("full_reuse", adapters, prompt)
    assert after["base_hit_tokens"] - before["base_hit_tokens"] == 80  # five whole pages shared
    assert after["base_pages_used"] == before["base_pages_used"]  # no base page written for B
    assert after["residual_pages_used"] == 2 * before["residual_pages_used"]  # B's own residual
    err_fork, err_full = rel_err(forked, exact), rel_err(full, exact)
    assert err_fork < 0.1 and err_fork < 0.8 * err_full, (err_fork, err_full)


def test_partial_hit_writes_only_base_and_output_is_unchanged(forkkv_llama):
    engine = forkkv_llama
    prompt = _prompt(10, 100, 203)
    first = engine.score(prompt, adapter="qkvo8")
    engine.cache.evict(10 ** 6, pool="base")  # every unlocked base page; residuals survive
    s0 = engine.stats()
    assert s0["base_pages_used"] == 0 and s0["residual_pages_used"] > 0
    again = engine.score(prompt, adapter="qkvo8")
    s1 = engine.stats()
    assert s1["residual_hit_tokens"] - s0["residual_hit_tokens"] == 96
    assert s1["base_hit_tokens"] == s0["base_hit_tokens"]
    assert s1["residual_pages_used"] == s0["residual_pages_used"]  # nothing rewritten there
    assert s1["base_pages_used"] == 6  # the base is written again (committed whole pages)
    np.testing.assert_allclose(again, first, rtol=1e-5, atol=1e-5)


def test_fork_inside_a_page_copies_it_and_stays_exact(hf_suite, forkkv_llama):
    """B shares A's first 40 tokens: pages 0-1 and 8 tokens of A's page 2, which B must copy
    (copy-on-write) before writing its own tokens there; A's page must stay intact."""
    base, adapters = hf_suite["llama"]
    engine = forkkv_llama
    hf = load_hf(base, torch.float32, adapters["qkvo8"])
    a, tail = _prompt(11, 100, 203), _prompt(12, 30, 203)
    engine.score(a, adapter="qkvo8")
    copies = []
    forward = engine.runner.forward
    engine.runner.forward = lambda batch, *r: copies.extend(batch.base_copies) or forward(batch, *r)
    try:
        s0 = engine.stats()
        forked = engine.score(a[:40] + tail, adapter="qkvo8")
        assert engine.stats()["base_hit_tokens"] - s0["base_hit_tokens"] == 40
        assert len(copies) == 1
        assert rel_err(forked, hf_logits(hf, a[:40] + tail)) < 1e-4
        # Decode from a prompt that ends inside a cached page: its last token is recomputed.
        assert engine.generate([a[:40]], adapters="qkvo8", max_new_tokens=6)[0] == hf_greedy(hf, a[:40], 6)
        assert len(copies) == 2
        assert rel_err(engine.score(a, adapter="qkvo8"), hf_logits(hf, a)) < 1e-4  # A intact
    finally:
        engine.runner.forward = forward


@pytest.mark.parametrize("policy", ["prefix", "forkkv"])
def test_memory_pressure_gives_the_same_outputs(policy):
    adapters = _mild_adapters(3)
    names = ["a0", "a1", "a2", None] * 3
    prompts = [_prompt(20 + i, 40 + 9 * i) for i in range(12)]
    kw = dict(SMALL, adapters=adapters, dtype="float32", cache_policy=policy)
    # forkkv is exact per adapter only when no other adapter's base is reused: distinct prompts.
    big = forkjax.Engine.from_pretrained("tiny-llama", **kw)
    want = big.generate(prompts, adapters=names, max_new_tokens=16)
    # ~20 base pages (a tiny-llama base page is 32 KiB; forkkv keeps a residual page of 8 KiB
    # per adapter beside it): room for about three of these requests at a time.
    kw["kv_cache_bytes"] = 20 * (32768 + (3 * 8192 if policy == "forkkv" else 0))
    small = forkjax.Engine.from_pretrained("tiny-llama", **kw)
    got = small.generate(prompts, adapters=names, max_new_tokens=16)
    assert got == want
    assert small.stats()["preemptions"] + small.stats()["base_pages_evictable"] > 0
    # Waiting for pages and being preempted do not count a prompt twice.
    assert small.stats()["prompt_tokens"] == big.stats()["prompt_tokens"] == sum(map(len, prompts))


@pytest.mark.parametrize("policy", POLICIES)
def test_eight_agents_share_one_prefix(policy):
    adapters = _shared_a_adapters(3) if policy == "lrshared" else _mild_adapters(3)
    names = list(adapters) + [None]
    engine = forkjax.Engine.from_pretrained("tiny-llama", adapters=adapters, dtype="float32",
                                            cache_policy=policy, **SMALL)
    prefix = _prompt(30, 160)
    prompts = [prefix + _prompt(31 + i, 5 + i) for i in range(8)]
    agents = [names[i % 4] for i in range(8)]
    engine.generate(prompts[:1], adapters=agents[:1], max_new_tokens=1)  # warm the prefix
    outs = engine.generate(prompts, adapters=agents, max_new_tokens=6)
    assert all(len(o) == 6 for o in outs)
    s = engine.stats()
    assert s["decode_batch_size_mean"] > 1
    shared = policy != "prefix"
    # 7 later agents hit the 160-token prefix (10 pages) under sharing policies; under prefix
    # only the agents with the same adapter as the warm-up request hit.
    assert s["base_hit_tokens"] >= (8 * 160 if shared else 2 * 160)
    if policy == "forkkv":
        assert s["residual_hit_tokens"] >= 2 * 160  # each adapter's second agent


def test_lrshared_refuses_adapters_with_different_a():
    with pytest.raises(ValueError, match="share their A"):
        forkjax.Engine.from_pretrained("tiny-llama", adapters=_mild_adapters(2),
                                       cache_policy="lrshared", **SMALL)


def test_request_that_can_never_fit_fails_and_engine_keeps_serving():
    engine = forkjax.Engine.from_pretrained("tiny-llama", dtype="float32", cache_policy="forkkv",
                                            **dict(SMALL, kv_cache_bytes=24 * 16384))
    with pytest.raises(ValueError, match="whole base pool"):
        engine.generate([_prompt(1, 400)], max_new_tokens=4)
    assert len(engine.generate([_prompt(2, 20)], adapters="coder", max_new_tokens=4)[0]) == 4


def _shared_kv_reference(base, writer_dir, reader_dir, context, prompt, policy):
    """float64 HF + PEFT logits of the reader on `prompt` when the K/V rows of `context` are
    what `policy` gives it after the writer computed `context`: forkkv x_w·W + x_r·A_r·B_r,
    forkkv+fanout x_w·W + x_w·A_r·B_r, full_reuse x_w·W + x_w·A_w·B_w (x_w: the writer's
    hidden states, x_r: the reader's own), by hooks on the k/v projections."""
    writer, reader = load_hf(base, adapter_dir=writer_dir), load_hf(base, adapter_dir=reader_dir)
    n = len(context)

    def projections(model):  # [((layer, k|v), module)]
        layers = model.base_model.model.model.layers
        return [((i, j), mod) for i, layer in enumerate(layers)
                for j, mod in enumerate((layer.self_attn.k_proj, layer.self_attn.v_proj))]

    x_w, whole_w, base_w = {}, {}, {}  # (layer, k|v) -> the writer's input, output, base part
    hooks = []
    for key, mod in projections(writer):
        def keep(m, args, out, key=key):
            x_w[key], whole_w[key] = args[0], out
        def keep_base(m, args, out, key=key):
            base_w[key] = out
        hooks += [mod.register_forward_hook(keep),
                  getattr(mod, "base_layer", mod).register_forward_hook(keep_base)]
    with torch.no_grad():
        writer(torch.tensor([context]))
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for key, mod in projections(reader):
            if policy == "forkkv":  # the base part is the writer's
                mod, rows = getattr(mod, "base_layer", mod), base_w[key]
            elif policy == "forkkv+fanout":  # the reader's projection of the writer's x
                rows = mod(x_w[key])
            else:  # full_reuse: the writer's whole K/V
                rows = whole_w[key]
            mod.register_forward_hook(lambda m, a, out, rows=rows: torch.cat([rows, out[:, n:]], 1))
        return reader(torch.tensor([prompt])).logits[0].numpy()


@pytest.mark.parametrize("policy", ["forkkv", "forkkv+fanout", "full_reuse"])
def test_a_fork_of_another_agents_prefix_matches_the_reference(hf_suite, policy):
    """An agent reading a 64-token prefix (four whole pages) another agent computed gets the
    logits of an independent float64 reference that builds its K/V rows as the policy says."""
    base, adapters = hf_suite["llama"]
    context = _prompt(21, 64, 203)
    prompt = context + _prompt(22, 30, 203)
    engine = forkjax.Engine.from_pretrained(
        base, adapters={w: adapters[w] for w in ("all4rs", "qkvo8")}, dtype="float32",
        cache_policy=policy.removesuffix("+fanout"), **SMALL)
    fan = ["qkvo8"] if policy == "forkkv+fanout" else []
    engine.generate([context], adapters=["all4rs"], max_new_tokens=1, fanout_adapters=fan)
    got = engine.score(prompt, adapter="qkvo8")
    assert engine.stats()["base_hit_tokens"] >= 64
    ref = _shared_kv_reference(base, adapters["all4rs"], adapters["qkvo8"], context, prompt, policy)
    assert rel_err(got, ref) < 1e-4
    exact = hf_logits(load_hf(base, adapter_dir=adapters["qkvo8"]), prompt)
    assert rel_err(got, exact) > 1e-3  # the shared rows do change the reader's logits
