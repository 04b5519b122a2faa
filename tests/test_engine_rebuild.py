"""Engines of one model built one after another in one process (a batch-size sweep, a server
rebuilding its engine) share compiled step programs (runtime/compiler.py); each must get programs
of its own shapes. Every engine here differs from the one before in one setting, runs a greedy
request, and must answer as a fresh process would: the float32 engines all give the first one's
tokens (one request alone: no batch-dependent rounding, no sharing between agents)."""

from __future__ import annotations

import pytest

import forkjax

# The first engine has the shapes of the suite's usual small engine (conftest.SMALL), whose
# programs other tests compile too.
BASE = dict(dtype="float32", max_prefill_tokens=128, max_model_len=512, max_batch_size=8,
            kv_cache_bytes=32 << 20, progress=False, warmup=False)
# Each differs from BASE in what a step program's arguments are shaped by.
VARIANTS = {
    "max_batch_size 8": {},
    "max_batch_size 4, max_prefill_tokens 32, a smaller pool, fan-out, fewer adapter slots": dict(
        max_batch_size=4, max_prefill_tokens=32, kv_cache_bytes=8 << 20, residual_fanout=True,
        max_loras=4, max_lora_rank=32),
}
PROMPTS = ["The quick brown fox", "Hello"]


@pytest.fixture(scope="module")
def answers():
    """{variant: greedy tokens}, the engines built and run in this one order in one process."""
    out = {}
    for name, kw in VARIANTS.items():
        with forkjax.Engine.from_pretrained("tiny-llama", **dict(BASE, **kw)) as engine:
            out[name] = [engine.generate([p], max_new_tokens=6)[0] for p in PROMPTS]
    with forkjax.Engine.from_pretrained("tiny-llama", **dict(BASE, dtype="bfloat16")) as engine:
        out["bfloat16"] = [engine.generate([p], max_new_tokens=6)[0] for p in PROMPTS]
    return out


def test_every_engine_runs_with_its_own_programs(answers):
    first = answers["max_batch_size 8"]
    for name in VARIANTS:
        assert answers[name] == first, name


def test_bfloat16_engine_after_float32_engines(answers):
    assert all(len(a) > 0 for a in answers["bfloat16"])
