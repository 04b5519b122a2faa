"""Tensor parallelism on 4 CPU devices (conftest.py), or on GPUs: an engine split over 2 of them computes
what the single-device engine computes (float32: the same greedy tokens, logits within
summation-order rounding), under every policy, with residual fan-out, chunked prefill, cached
prefixes, the sgmv LoRA path and adapter swaps; its parameters and pools are really split; bad
sizes are clear errors at start."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import forkjax
from conftest import SMALL
from forkjax.config import ModelConfig
from forkjax.models.builtin import BUILTIN_CONFIGS
from forkjax.models.loader import build_model
from forkjax.tensor_parallel import local_config
from hf_utils import hf_logits, load_hf, rel_err
from test_engine_cache import _shared_a_adapters

TINY = dict(SMALL, dtype="float32", max_prefill_tokens=32)  # 32: prompts of 50+ run in chunks


def _prompt(seed, n, vocab=250):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def _run(engine, names):
    """Greedy tokens and scored logits of a shared-context workload: one agent prefills a
    context in chunks, the others read it (cached prefix) with their own suffixes, together."""
    context = _prompt(1, 70)
    first = engine.generate([context], adapters=[names[0]], max_new_tokens=3)
    rest = engine.generate([context + _prompt(2 + i, 9) for i in range(len(names) - 1)],
                           adapters=names[1:], max_new_tokens=6)
    scored = engine.score(context + _prompt(9, 12), adapter=names[-1], start=60)
    return first + rest, scored


# forkkv with fan-out: other agents read the writer's base and residuals written for them
@pytest.mark.parametrize("policy,fanout", [("prefix", False), ("forkkv", True), ("full_reuse", False),
                                           ("lrshared", False)])
def test_tp2_equals_one_device(policy, fanout):
    runs = []
    adapters = _shared_a_adapters(3) if policy == "lrshared" else None  # None: the demo agents
    for tp in (1, 2):
        engine = forkjax.Engine.from_pretrained("tiny-llama", adapters=adapters, cache_policy=policy,
                                                residual_fanout=fanout, tensor_parallel_size=tp, **TINY)
        runs.append(_run(engine, sorted(engine.slots.by_name)))
        if policy != "prefix":
            hits = "residual_hit_tokens" if fanout or policy == "lrshared" else "base_hit_tokens"
            assert engine.stats()[hits] > 0
    (tokens1, logits1), (tokens2, logits2) = runs
    assert tokens1 == tokens2
    assert rel_err(logits2, logits1) < 1e-5


def test_tp2_equals_one_device_for_activated_lora():
    """aLoRA agents on a context the base model wrote, beside a plain agent, under forkkv (their
    LoRA K/V folded into the base pool)."""
    from forkjax.models.builtin import random_adapter
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
    adapters = {"plain": random_adapter("plain", cfg, 8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=1)}
    for i, inv in enumerate([(5, 6, 7), (9, 9, 11)]):
        name = f"alora{i}"
        adapters[name] = dataclasses.replace(random_adapter(name, cfg, 8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=2 + i),
                                             invocation_tokens=inv)
    context = _prompt(1, 70, vocab=250)
    prompts = [context + [5, 6, 7] + _prompt(2, 9), context + [9, 9, 11] + _prompt(3, 5),
               context + _prompt(4, 9)]
    runs = []
    for tp in (1, 2):
        engine = forkjax.Engine.from_pretrained("tiny-llama", adapters=adapters, cache_policy="forkkv",
                                                tensor_parallel_size=tp, **TINY)
        engine.generate([context], max_new_tokens=2)
        runs.append(engine.generate(prompts, adapters=["alora0", "alora1", "plain"], max_new_tokens=6))
    assert runs[0] == runs[1]


def test_tp2_params_and_pools_are_split():
    engine = forkjax.Engine.from_pretrained("tiny-llama", cache_policy="forkkv", tensor_parallel_size=2, **TINY)
    model, pools = engine.model, engine.runner.pools
    attn = model.layers.self_attn  # the stacked layers: a leading layer axis, not split
    expect = [(model.embed_tokens, P("tp", None)), (attn.qkv_proj.weight, P(None, "tp")),
              (attn.o_proj.weight, P(None, None, "tp")),
              (attn.qkv_proj.lora_b["q_proj"], P(None, None, None, "tp")),
              (attn.o_proj.lora_b["o_proj"], P(None)), (model.layers.mlp.down_proj.weight, P(None, None, "tp")),
              (model.layers.input_layernorm.weight, P(None))]
    for var, spec in expect:
        x = var.get_value()
        want = jax.sharding.NamedSharding(x.sharding.mesh, spec)
        assert x.sharding.is_equivalent_to(want, x.ndim) and len(x.sharding.device_set) == 2, (x.sharding, spec)
    # each device holds its heads' base pages (2 KV heads: one each) and the whole residual pool
    assert pools.base_k.sharding.spec == P(None, "tp")
    assert {s.data.shape[1] for s in pools.base_k.addressable_shards} == {1}
    assert pools.res_k.sharding.spec == P()
    assert {s.data.shape for s in pools.res_k.addressable_shards} == {pools.res_k.shape}
    # a step keeps them so (the pools are donated and come back); sessions are the host's
    engine.generate([_prompt(3, 20)], adapters=["coder"], max_new_tokens=2, session_id="s", session_end=True)
    assert engine.runner.pools.base_k.sharding.spec == P(None, "tp")


@pytest.mark.parametrize("kind,vocab", [("llama", 203), ("qwen2", 157)])
def test_tp2_hf_checkpoint_with_peft_adapters_matches_peft_and_one_device(hf_suite, engine_for, kind, vocab):
    # odd vocabularies: padded to 2 × 102 and 2 × 79 rows; Qwen2: q/k/v biases, tied embeddings
    base, adapters = hf_suite[kind]
    engine = forkjax.Engine.from_pretrained(base, adapters=adapters, cache_policy="prefix",
                                            tensor_parallel_size=2, **dict(SMALL, dtype="float32"))
    one = engine_for(kind, "float32")
    prompt = _prompt(4, 40, vocab)
    for name in sorted(adapters)[:2]:
        got = engine.score(prompt, adapter=name)
        assert got.shape == (40, vocab)
        assert rel_err(got, hf_logits(load_hf(base, adapter_dir=adapters[name]), prompt)) < 1e-4
        assert rel_err(got, one.score(prompt, adapter=name)) < 1e-5
    prompts = [_prompt(10 + i, 15 + 6 * i, vocab) for i in range(3)]
    names = [sorted(adapters)[0], None, sorted(adapters)[1]]
    assert engine.generate(prompts, adapters=names, max_new_tokens=5) == \
        one.generate(prompts, adapters=names, max_new_tokens=5)


def test_tp2_sgmv_path_with_adapter_swaps_and_deterministic_mode():
    outs = []
    for tp in (1, 2):
        engine = forkjax.Engine.from_pretrained("tiny-llama", cache_policy="forkkv", lora_path="sgmv",
                                                max_loras=2, deterministic=True, tensor_parallel_size=tp,
                                                **TINY)
        names = sorted(engine.slots.by_name)  # three adapters, one slot: every change swaps
        outs.append([engine.generate([_prompt(5, 40)], adapters=[n], max_new_tokens=4)[0] for n in names * 2])
        assert engine.stats()["lora_swaps"] >= 5
    assert outs[0] == outs[1]


def test_tensor_parallel_sizes_that_cannot_split_are_errors_at_start():
    with pytest.raises(ValueError, match=r"2 KV heads.*4 devices"):
        forkjax.Engine.from_pretrained("tiny-llama", tensor_parallel_size=4, **TINY)
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-qwen2"])
    with pytest.raises(ValueError, match=r"6 attention heads"):
        local_config(dataclasses.replace(cfg, num_kv_heads=4), 4)
    tp = 2 * jax.local_device_count()  # heads that split, devices too few: before any weight
    wide = dataclasses.replace(cfg, num_heads=tp, num_kv_heads=tp, intermediate_size=tp)
    with pytest.raises(ValueError, match=rf"only {tp // 2} local"):
        build_model(wide, lambda *_: pytest.fail("a weight was made"), num_slots=2, rank=4,
                    dtype=jax.numpy.float32, tp=tp)
    with pytest.raises(ValueError, match="host tier"):
        forkjax.Engine.from_pretrained("tiny-llama", tensor_parallel_size=2, host_kv_bytes=1 << 20, **TINY)
    assert local_config(cfg, 2).vocab_size == 129
    big = ModelConfig.from_hf(BUILTIN_CONFIGS["llama3.1-70b-random"])  # 64 heads, 8 KV heads
    assert [local_config(big, tp).num_kv_heads for tp in (2, 4, 8)] == [4, 2, 1]


def test_tp2_pallas_path_per_shard_gives_the_reference_tokens():
    """The Pallas kernels (interpreted here, compiled on GPUs) run unchanged on each shard's heads."""
    prompts, names = [_prompt(6, 35), _prompt(7, 70)], ["planner", "coder"]
    outs = [forkjax.Engine.from_pretrained("tiny-llama", cache_policy="forkkv", tensor_parallel_size=tp,
                                           use_pallas=pallas, **TINY).generate(prompts, adapters=names, max_new_tokens=4)
            for tp, pallas in ((1, False), (2, True))]
    assert outs[0] == outs[1]
