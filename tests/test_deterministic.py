"""Deterministic mode: a request's bf16 logits and greedy tokens do not depend on the batch it
runs in, on how its prompt was chunked or on whether its prefix came from the cache.

The tiny random model's next-token logits are nearly flat (top-2 gaps of a few hundredths
against bf16 rounding errors of the same size), so greedy tokens change with any rounding
difference: by default the target's continuation after a cached prompt differs from the one
computed from scratch; in deterministic mode all of them agree bit for bit.
"""

import numpy as np
import pytest

import forkjax
from conftest import SMALL
from forkjax.config import ModelConfig
from forkjax.engine.sequence import SamplingParams
from forkjax.models.builtin import BUILTIN_CONFIGS, random_adapter
from forkjax.runtime.buckets import Buckets

TINY = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTERS = {f"a{i}": random_adapter(f"a{i}", TINY, 8, 1.0, ATTN, seed=i) for i in range(3)}


def _prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 256, n)]


TARGET = _prompt(100, 77)  # not page-aligned; spans three 32-token chunks
OTHERS = [(_prompt(i, n), [None, "a0", "a1", "a2"][i % 4])
          for i, n in enumerate((30, 140, 61, 90, 45, 120, 33, 70, 100, 52, 81))]
# Same-adapter requests that share the target's first 50 and 64 tokens: in flight, one of them
# computes those pages and the others take them over, at chunk boundaries of its choosing.
# (Under forkkv a fork of another adapter reads that adapter's base pages: a different cache
# content by design, not covered here.)
OTHERS[2] = (TARGET[:50] + _prompt(7, 20), "a0")
OTHERS[5] = (TARGET[:64] + _prompt(8, 30), "a0")


def _engine(policy, deterministic=True):
    return forkjax.Engine.from_pretrained("tiny-llama", adapters=ADAPTERS, dtype="bfloat16",
                                          cache_policy=policy, deterministic=deterministic, **SMALL)


def _run(engine, requests, max_new_tokens=24):
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, a, params) for p, a in requests]
    while engine.scheduler.has_work:
        engine.step()
    engine.cache.check()
    return seqs


@pytest.mark.parametrize("policy", ["prefix", "forkkv"])
def test_greedy_tokens_do_not_depend_on_batch_chunking_or_cache(policy):
    alone = _run(_engine(policy), [(TARGET, "a0")])[0].output
    engine = _engine(policy)
    seqs = _run(engine, OTHERS[:6] + [(TARGET, "a0")] + OTHERS[6:])  # 12 requests, 8 at a time
    hits = engine.cache.base_hit_tokens
    cached = _run(engine, [(TARGET, "a0")])[0]
    assert engine.cache.base_hit_tokens - hits == len(TARGET)  # all of its prompt was cached
    assert seqs[6].output == alone
    assert cached.output == alone


def test_score_logits_are_bitwise_the_same_beside_other_requests():
    alone = _engine("forkkv").score(TARGET, "a0")
    engine = _engine("forkkv")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for p, a in OTHERS[:6]:
        engine.add_request(p, a, params)
    seq = engine.add_request(TARGET, "a0", SamplingParams(max_new_tokens=0), score=True)
    while engine.scheduler.has_work:
        engine.step()
    beside = np.concatenate(seq.prompt_logits, axis=0)
    assert beside.shape == alone.shape == (len(TARGET), TINY.vocab_size)
    np.testing.assert_array_equal(beside, alone)


def test_fixed_buckets_compile_one_program_per_kind():
    b = Buckets(max_batch_size=64, max_prefill_tokens=2048, max_pages=512, fixed=True)
    assert b.all() == [("decode", 64, 1, 512), ("extend", 4, 512, 512)]
    assert b.decode(1) == 64 and b.extend(1, 17) == (4, 512) and b.extend(5, 17) is None


def test_a_long_prompt_fills_the_extend_rows_with_pieces_of_itself():
    engine = _engine("prefix")
    seq = engine.add_request(TARGET, "a0", SamplingParams(max_new_tokens=4, ignore_eos=True))
    batch = engine.scheduler.schedule()
    assert batch.seqs == [seq] * 3 and batch.chunks == [(0, 32), (32, 64), (64, 77)]
