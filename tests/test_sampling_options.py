"""Logits processing and logprobs: the penalties, logit bias and min_tokens against a numpy
reference on fixed logits, and on the engine (overlap scheduling included) against a loop of
`Engine.score` calls with the same processing in numpy; logprobs against `Engine.score`; a
grammar's outputs against `jsonschema`."""

import json

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import forkjax
from conftest import SMALL
from forkjax.engine.sequence import SamplingParams, Status
from forkjax.runtime.input_batch import _padded
from forkjax.runtime.sampler import ProcessArrays, process_logits, top_logprobs
from forkjax.structured_output import json_schema_grammar


def _reference(logits, *, output, pending, prompt, presence, frequency, repetition, bias, banned):
    """float64 numpy: one row's processed logits (SamplingParams' order)."""
    z = logits.astype(np.float64).copy()
    for t, b in bias.items():
        z[t] += b
    masked = z.copy()
    masked[list(banned)] = -np.inf
    if np.isfinite(masked).any():
        z = masked
    out = list(output) + ([pending] if pending is not None else [])
    counts = np.bincount(out, minlength=len(z)).astype(np.float64)
    seen = (counts > 0) | (np.bincount(list(prompt), minlength=len(z)) > 0)
    z = np.where(seen, np.where(z > 0, z / repetition, z * repetition), z)
    return z - presence * (counts > 0) - frequency * counts


def test_process_logits_against_numpy():
    rng = np.random.default_rng(0)
    v, b = 40, 4
    logits = rng.normal(0, 3, (b, v)).astype(np.float32)
    prev_tokens = np.array([7, 3, 11, 0, 0, 0, 0, 0], np.int32)
    rows = [  # (output, pending row, prompt, presence, frequency, repetition, bias, banned)
        ([1, 1, 2, 5], 0, [], 0.5, 0.3, 1.0, {}, []),
        ([4, 4, 4], -1, [9, 9, 8], -1.0, 1.5, 1.3, {2: 5.0, 39: -100.0}, [3, 4]),
        ([], 2, [1, 2, 3], 0.0, 0.0, 0.7, {}, list(range(v))),  # every token banned
        ([6], -1, [], 2.0, -2.0, 1.0, {0: 1.0}, [6]),
    ]
    p = ProcessArrays(
        presence=np.array([r[3] for r in rows], np.float32),
        frequency=np.array([r[4] for r in rows], np.float32),
        repetition=np.array([r[5] for r in rows], np.float32),
        output_ids=_padded([r[0] for r in rows], b), pending_row=np.array([r[1] for r in rows], np.int32),
        prompt_ids=_padded([r[2] for r in rows], b),
        bias_ids=_padded([list(r[6]) for r in rows], b),
        bias=_padded([list(r[6].values()) for r in rows], b, np.float32, 0),
        banned_ids=_padded([r[7] for r in rows], b))
    got = np.asarray(process_logits(jnp.asarray(logits), p, jnp.asarray(prev_tokens)))
    for i, (out, pend, prompt, pres, freq, rep, bias, banned) in enumerate(rows):
        want = _reference(logits[i], output=out, pending=None if pend < 0 else int(prev_tokens[pend]),
                          prompt=prompt, presence=pres, frequency=freq, repetition=rep, bias=bias,
                          banned=banned)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5, err_msg=f"row {i}")
    assert np.isfinite(got[2]).all()  # a row with every token banned still yields a token
    assert np.isneginf(got[1, [3, 4]]).all() and np.isneginf(got[3, 6])


def test_top_logprobs_against_numpy():
    logits = np.random.default_rng(1).normal(0, 4, (3, 50)).astype(np.float32)
    chosen = np.array([5, 0, 49], np.int32)
    lp, ids, top = (np.asarray(x) for x in top_logprobs(jnp.asarray(logits), jnp.asarray(chosen), 4))
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp, ref[np.arange(3), chosen], atol=1e-5)
    np.testing.assert_array_equal(ids, np.argsort(-ref, axis=-1)[:, :4])
    np.testing.assert_allclose(top, np.sort(ref, axis=-1)[:, ::-1][:, :4], atol=1e-5)


@pytest.fixture(scope="module")
def engine():
    return forkjax.Engine.from_pretrained("tiny-llama", dtype="float32", cache_policy="prefix", **SMALL)


PROMPT = np.random.default_rng(5).integers(0, 256, 23).tolist()


def _run(engine, params, adapter="planner", prompt=PROMPT):
    seq = engine.add_request(prompt, adapter, params)
    engine._run_until_done([seq])
    assert seq.status is Status.FINISHED and seq.error is None
    return seq


def _log_softmax(x):
    x = x.astype(np.float64)
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def test_logprobs_agree_with_score(engine):
    seq = _run(engine, SamplingParams(max_new_tokens=6, logprobs=3, ignore_eos=True))
    logits = engine.score(PROMPT + seq.output, "planner")
    assert len(seq.output_logprobs) == 6
    for j, (lp, ids, top) in enumerate(seq.output_logprobs):
        ref = _log_softmax(logits[len(PROMPT) - 1 + j])
        assert abs(lp - ref[seq.output[j]]) < 1e-5
        np.testing.assert_array_equal(ids, np.argsort(-ref)[:3])
        np.testing.assert_allclose(top, np.sort(ref)[::-1][:3], atol=1e-5)
        assert ids[0] == seq.output[j]  # greedy


@pytest.mark.parametrize("options", [
    dict(frequency_penalty=1.5, presence_penalty=0.5),
    dict(repetition_penalty=1.8),
    dict(logit_bias=((17, 8.0), (3, -100.0)), frequency_penalty=-0.5),
])
def test_engine_processing_matches_a_score_loop(engine, options):
    """Greedy with processing, through overlap scheduling (a row's newest token is still on the
    device when the next step is processed), against score + numpy one token at a time."""
    n = 10
    seq = _run(engine, SamplingParams(max_new_tokens=n, ignore_eos=True, **options))
    out = []
    bias = dict(options.get("logit_bias", ()))
    for _ in range(n):
        logits = engine.score(PROMPT + out, "planner")[-1]
        z = _reference(logits, output=out, pending=None, prompt=PROMPT,
                       presence=options.get("presence_penalty", 0.0),
                       frequency=options.get("frequency_penalty", 0.0),
                       repetition=options.get("repetition_penalty", 1.0), bias=bias, banned=[])
        out.append(int(np.argmax(z)))
    assert seq.output == out
    plain = _run(engine, SamplingParams(max_new_tokens=n, ignore_eos=True)).output
    assert plain != out  # the options changed something


def test_min_tokens_masks_the_stop_tokens(engine):
    plain = _run(engine, SamplingParams(max_new_tokens=8, ignore_eos=True)).output
    k = next(k for k in range(1, 8) if plain[k] not in plain[:k])  # stop at the k-th token
    early = _run(engine, SamplingParams(max_new_tokens=8, stop_token_ids=(plain[k],), ignore_eos=True))
    assert early.output == plain[:k + 1] and early.finish_reason == "stop"
    held = _run(engine, SamplingParams(max_new_tokens=8, stop_token_ids=(plain[k],), ignore_eos=True,
                                       min_tokens=k + 3))
    assert len(held.output) >= k + 3 and plain[k] not in held.output[:k + 3]


def test_bad_options_are_refused(engine):
    for kw, match in ((dict(presence_penalty=3.0), "presence_penalty"),
                      (dict(repetition_penalty=0.0), "repetition_penalty"),
                      (dict(min_tokens=20, max_new_tokens=4), "min_tokens"),
                      (dict(logit_bias=((1, 200.0),)), "logit_bias"),
                      (dict(logprobs=21), "logprobs")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request(PROMPT, "planner", SamplingParams(logit_bias=((10**6, 1.0),)))
    assert not engine.scheduler.has_work


def test_generate_follows_a_grammar(engine):
    """`Engine.generate(guided=...)`: every sampled output (random weights, temperature 1) is a
    JSON document its schema accepts (checked with `jsonschema`)."""
    schema = {"type": "object", "additionalProperties": False, "required": ["colour", "n"],
              "properties": {"colour": {"enum": ["red", "green", "blue"]},
                             "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    outs = engine.generate([PROMPT] * 4, adapters="planner", max_new_tokens=64, temperature=1.0,
                           seed=3, guided=json_schema_grammar(schema))
    for out in outs:
        jsonschema.validate(json.loads(bytes(t for t in out if t < 256).decode()), schema)
