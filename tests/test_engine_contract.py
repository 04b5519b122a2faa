"""The Engine contract of docs/design.md, Public contracts, on the built-in models (no files
needed)."""

import time

import numpy as np
import pytest

import forkjax
from conftest import SMALL
from forkjax.engine.sequence import SamplingParams

STATS_KEYS = {"base_pages_total", "base_pages_used", "residual_pages_total", "residual_pages_used",
              "base_bytes_used", "residual_bytes_used", "prompt_tokens", "base_hit_tokens",
              "residual_hit_tokens", "decode_batch_size_mean"}


@pytest.fixture(scope="module")
def tiny():
    return forkjax.Engine.from_pretrained("tiny-llama", dtype="float32", cache_policy="prefix", **SMALL)


def test_tiny_llama_generates_from_text(tiny):
    out = tiny.generate(["Hello"], max_new_tokens=8)
    assert len(out) == 1 and len(out[0]) <= 8 and all(0 <= t < 258 for t in out[0])
    assert tiny.generate(["Hello"], max_new_tokens=8) == out  # greedy is deterministic


def test_demo_adapters_change_the_output(tiny):
    assert set(tiny.slots.by_name) == {"planner", "coder", "critic"}
    base = tiny.score("The plan is", adapter=None)
    for name in ("planner", "coder", "critic"):
        assert not np.allclose(tiny.score("The plan is", adapter=name), base)


def test_batched_generation_equals_one_by_one(tiny):
    prompts = ["Hi", "A longer prompt here", "x"]
    adapters = ["coder", None, "critic"]
    batched = tiny.generate(prompts, adapters=adapters, max_new_tokens=6)
    for p, a, got in zip(prompts, adapters, batched):
        assert tiny.generate([p], adapters=a, max_new_tokens=6) == [got]


def test_unequal_prompts_share_an_extend_step_as_pieces(tiny):
    """Rows of an extend step are padded to its longest, so prompts go as pieces of
    `buckets.piece` tokens: a short prompt beside a long one costs its own length and the budget
    carries part of the next; a request alone keeps one row. Outputs are those of each alone."""
    engine = forkjax.Engine.from_pretrained("tiny-llama", dtype="float32", cache_policy="prefix",
                                            **SMALL)
    assert engine.runner.buckets.piece == 16  # a budget of 128 tokens in up to 8 rows
    prompts = [list(range(3, 53)), list(range(60, 90)), list(range(100, 190))]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    seqs = [engine.add_request(p, None, params) for p in prompts]
    batch = engine.scheduler.schedule()
    assert batch.seqs == [seqs[0]] * 4 + [seqs[1]] * 2 + [seqs[2]] * 2
    assert batch.chunks == [(0, 16), (16, 32), (32, 48), (48, 50), (0, 16), (16, 30), (0, 16), (16, 32)]
    while engine.scheduler.has_work:
        engine.step()
    for p, seq in zip(prompts, seqs):  # `tiny` is the same model, each prompt computed alone
        assert tiny.generate([p], max_new_tokens=4, ignore_eos=True) == [seq.output]
    alone = engine.add_request(list(range(150, 240)), None, params)
    assert engine.scheduler.schedule().chunks == [(0, 90)]
    while engine.scheduler.has_work:
        engine.step()
    assert len(alone.output) == 4


def test_sampling_is_seeded(tiny):
    a = tiny.generate(["abc", "abc"], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3)
    assert a == tiny.generate(["abc", "abc"], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3)
    assert a != tiny.generate(["abc", "abc"], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=4)


def test_score_shape_and_stats(tiny):
    logits = tiny.score([256, 72, 105])
    assert logits.shape == (3, 258) and logits.dtype == np.float32
    stats = tiny.stats()
    assert STATS_KEYS <= set(stats) and stats["prompt_tokens"] > 0


@pytest.mark.parametrize("call,match", [
    (lambda e: e.generate([[1, 2]], adapters="nobody"), "unknown adapter"),
    (lambda e: e.generate([[1, 999]]), "outside the vocabulary"),
    (lambda e: e.generate([[]]), "empty prompt"),
    (lambda e: e.generate([[1]], max_new_tokens=-1), "max_new_tokens"),
    (lambda e: e.generate([[1]], temperature=-1.0), "temperature"),
    (lambda e: e.generate([[1]], top_p=0.0), "top_p"),
    (lambda e: e.generate([[1], [2]], adapters=["coder"]), "1 adapters for 2 prompts"),
    (lambda e: e.score(list(range(1, 200)) * 3), "exceeds the context"),
    (lambda e: e.generate([[1] * 500], max_new_tokens=20), "exceeds the context"),
])
def test_bad_requests_raise_clear_errors_and_engine_keeps_serving(tiny, call, match):
    with pytest.raises((ValueError, KeyError), match=match):
        call(tiny)
    assert len(tiny.generate(["ok"], max_new_tokens=2)[0]) == 2


def test_load_replace_and_unload_adapter(tiny, hf_suite):
    from forkjax.models.builtin import random_adapter
    cfg = tiny.model_cfg
    before = tiny.score("abc", adapter="planner")
    tiny.load_adapter("planner", random_adapter("planner", cfg, 8, 16, ("q_proj",), seed=99))
    assert not np.allclose(tiny.score("abc", adapter="planner"), before)
    tiny.load_adapter("extra", random_adapter("extra", cfg, 4, 4, ("o_proj",), seed=7))
    tiny.unload_adapter("extra")
    with pytest.raises(KeyError):
        tiny.score("abc", adapter="extra")
    with pytest.raises(FileNotFoundError):
        tiny.load_adapter("bad", "/nonexistent/adapter")
    with pytest.raises(ValueError, match="another model"):  # a Llama-suite adapter: other shapes
        tiny.load_adapter("alien", hf_suite["llama"][1]["qkvo8"])


def test_lora_target_modules_are_inferred_and_enforced():
    from forkjax.config import ModelConfig
    from forkjax.lora.slots import lora_modules
    from forkjax.lora.targets import TARGETS
    from forkjax.models.builtin import BUILTIN_CONFIGS, random_adapter
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
    attn_only = {"a": random_adapter("a", cfg, 8, 16, ("q_proj", "o_proj"), seed=5)}
    kw = dict(SMALL, adapters=attn_only, dtype="float32", cache_policy="prefix")
    lean = forkjax.Engine.from_pretrained("tiny-llama", **kw)
    assert lora_modules(lean.model) == ("q_proj", "k_proj", "v_proj", "o_proj")  # + the residual's
    full = forkjax.Engine.from_pretrained("tiny-llama", lora_target_modules=TARGETS, **kw)
    assert lora_modules(full.model) == TARGETS
    np.testing.assert_allclose(lean.score("The plan is", adapter="a"),
                               full.score("The plan is", adapter="a"), rtol=1e-5, atol=1e-5)
    mlp = random_adapter("mlp", cfg, 4, 4, ("down_proj",), seed=6)
    with pytest.raises(ValueError, match="lora_target_modules"):
        lean.load_adapter("mlp", mlp)
    assert "mlp" not in lean.slots.by_name
    assert len(lean.generate(["ok"], adapters="a", max_new_tokens=2)[0]) == 2
    full.load_adapter("mlp", mlp)
    assert not np.allclose(full.score("ok", adapter="mlp"), full.score("ok"))
    with pytest.raises(ValueError, match="not supported"):
        forkjax.Engine.from_pretrained("tiny-llama", adapters={}, lora_target_modules=["lm_head"],
                                       **SMALL)
    with pytest.raises(ValueError, match="targets"):
        forkjax.Engine.from_pretrained("tiny-llama", adapters={"m": mlp},
                                       lora_target_modules=["q_proj"], **SMALL)


def test_tiny_qwen2_and_policies():
    for policy in ("forkkv", "prefix", "full_reuse", "lrshared"):
        e = forkjax.Engine.from_pretrained("tiny-qwen2", cache_policy=policy, adapters={}, **SMALL)
        assert len(e.generate(["Hello"], max_new_tokens=3)[0]) == 3
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        forkjax.Engine.from_pretrained("no-such-model")


def test_background_warmup_serves_while_it_compiles(caplog):
    """warmup="background": the engine answers at once (a request compiles the shapes it needs
    unless the background threads have), gives what a fully warmed engine gives, and is warm
    once every bucket is compiled, after which a bucketed shape compiles nothing."""
    import logging
    kw = dict(SMALL, dtype="float32", cache_policy="prefix")
    engine = forkjax.Engine.from_pretrained("tiny-llama", **{**kw, "warmup": "background"})
    prompts = ["agents share a cache", "a longer prompt of another agent " * 4]
    want = forkjax.Engine.from_pretrained("tiny-llama", **kw).generate(prompts, adapters=["planner", "coder"], max_new_tokens=6)
    assert engine.generate(prompts, adapters=["planner", "coder"], max_new_tokens=6) == want
    runner = engine.runner
    deadline = time.time() + 300
    while not runner.warm:
        assert time.time() < deadline, "background warm-up did not finish"
        time.sleep(0.1)
    from forkjax.runtime.compiler import COMPILER
    assert all(COMPILER.compiled(runner._key(kind, b, c, w, False, False, False))
               for kind, b, c, w in runner.buckets.all())
    with caplog.at_level(logging.WARNING, logger="forkjax"):
        assert engine.generate(prompts[::-1], adapters=["coder", "planner"], max_new_tokens=6) == want[::-1]
    assert "new shape" not in caplog.text
    with pytest.raises(ValueError, match="warmup="):
        forkjax.Engine.from_pretrained("tiny-llama", **{**SMALL, "warmup": "later"})
