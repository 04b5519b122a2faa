"""The sampling options real clients send, over HTTP with the `openai` client, streamed and not:
logprobs (against `Engine.score` in this process, f32), the penalties, logit_bias, min_tokens
and include_stop_str_in_output (against `Engine.generate` with the same options), and unknown
fields (served, and named in the log)."""

import numpy as np
import pytest

import forkjax
from conftest import SMALL
from serve_utils import complete, sse_events

PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119]  # BOS "Hello, w"


@pytest.fixture(scope="module")
def engine():
    """The server's model and agents (built-in, seeded) in this process, under the same policy."""
    return forkjax.Engine.from_pretrained("tiny-llama", dtype="float32", cache_policy="prefix", **SMALL)


def _log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_completion_logprobs_agree_with_score(server, engine):
    body = dict(model="planner", prompt=PROMPT, max_tokens=6, ignore_eos=True, logprobs=3,
                return_token_ids=True)
    with server.http() as http:
        full = complete(http, **body, cache_salt="full")["choices"][0]  # salts: see the chat test below
        with http.stream("POST", "/v1/completions", json={**body, "temperature": 0, "stream": True,
                                                          "cache_salt": "stream"}) as r:
            chunks = [e["choices"][0] for e in sse_events(r.iter_lines())]
    ids, lp = full["token_ids"], full["logprobs"]
    logits = engine.score(PROMPT + ids, "planner")
    for j, token in enumerate(ids):
        ref = _log_softmax(logits[len(PROMPT) - 1 + j])
        assert abs(lp["token_logprobs"][j] - ref[token]) < 1e-5
        top = lp["top_logprobs"][j]
        assert len(top) <= 3 and max(top.values()) == pytest.approx(ref.max(), abs=1e-5)
    # Each token's own text (a byte of an unfinished character decodes to U+FFFD alone)
    assert len(lp["tokens"]) == len(ids) and all(lp["tokens"])
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1])
    streamed = [c["logprobs"] for c in chunks if c["logprobs"]]
    assert sum((s["token_logprobs"] for s in streamed), []) == lp["token_logprobs"]
    assert sum((s["text_offset"] for s in streamed), []) == lp["text_offset"]


def test_chat_logprobs_streamed_and_not(server):
    client = server.openai()
    kw = dict(model="critic", messages=[{"role": "user", "content": "Review."}], max_tokens=8,
              temperature=0, logprobs=True, top_logprobs=2)
    # Each call its own cache_salt, so both compute the whole prompt alike: a cache hit would
    # compute its last tokens in another batch shape, which may change the last bits (by
    # default the engine is not batch-invariant; deterministic mode is).
    salted = lambda salt: {**kw, "extra_body": {"cache_salt": salt}}  # noqa: E731
    full = client.chat.completions.create(**salted("logprobs-full")).choices[0]
    content = full.logprobs.content
    assert len(content) == 8
    for c in content:  # greedy: the chosen token is the most likely one
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert c.bytes == list(c.token.encode())
    stream = list(client.chat.completions.create(**salted("logprobs-stream"), stream=True))
    streamed = [t for s in stream for ch in s.choices if ch.logprobs for t in ch.logprobs.content]
    assert [t.logprob for t in streamed] == [c.logprob for c in content]
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("options", [
    dict(frequency_penalty=-1.5, presence_penalty=-0.5),  # repeats: greedy alone repeats nothing
    dict(extra_body=dict(repetition_penalty=0.3)),
    dict(logit_bias={"120": 6.0, "111": -100}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_penalties_and_bias_as_the_engine_applies_them(server, engine, options, stream):
    client = server.openai()
    extra = dict(options.get("extra_body", {}), ignore_eos=True, return_token_ids=True)
    kw = dict(model="coder", prompt=PROMPT, max_tokens=10, temperature=0,
              **{k: v for k, v in options.items() if k != "extra_body"}, extra_body=extra)
    if stream:
        ids = [t for c in client.completions.create(**kw, stream=True)
               for t in (c.choices[0].model_extra.get("token_ids") or [])]
    else:
        ids = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    bias = {int(k): v for k, v in options.get("logit_bias", {}).items()}
    want = engine.generate([PROMPT], "coder", max_new_tokens=10, ignore_eos=True,
                           presence_penalty=options.get("presence_penalty", 0.0),
                           frequency_penalty=options.get("frequency_penalty", 0.0),
                           repetition_penalty=options.get("extra_body", {}).get("repetition_penalty", 1.0),
                           logit_bias=bias)[0]
    assert ids == want
    assert ids != engine.generate([PROMPT], "coder", max_new_tokens=10, ignore_eos=True)[0]


def test_min_tokens_and_the_stop_string_kept(server):
    client = server.openai()
    base = dict(model="planner", prompt=PROMPT, max_tokens=12, temperature=0)
    greedy = client.completions.create(**base, extra_body=dict(ignore_eos=True, return_token_ids=True))
    ids = greedy.choices[0].model_extra["token_ids"]
    k = next(k for k in range(1, 12) if ids[k] not in ids[:k])
    early = client.completions.create(**base, extra_body=dict(stop_token_ids=[ids[k]], ignore_eos=True))
    assert early.choices[0].finish_reason == "stop"
    for stream in (False, True):
        held = client.completions.create(**base, stream=stream, extra_body=dict(
            stop_token_ids=[ids[k]], ignore_eos=True, min_tokens=k + 3, return_token_ids=True))
        out = (held.choices[0].model_extra["token_ids"] if not stream
               else [t for c in held for t in (c.choices[0].model_extra.get("token_ids") or [])])
        assert len(out) >= k + 3 and ids[k] not in out[:k + 3]
    text = greedy.choices[0].text
    j = next(j for j in range(2, len(text)) if text[j] not in text[:j] and text[j] != "\ufffd")
    for include in (False, True):
        cut = client.completions.create(**base, stop=[text[j]], extra_body=dict(
            ignore_eos=True, include_stop_str_in_output=include)).choices[0]
        assert cut.text == text[:j + include] and cut.finish_reason == "stop"


def test_unknown_fields_are_served_and_logged(server):
    with server.http() as http:
        r = complete(http, prompt=PROMPT, max_tokens=2, frobnicate=3, zeta="x")
    assert r["choices"][0]["finish_reason"] in ("length", "stop")
    assert "ignored fields the server does not know: 'frobnicate', 'zeta'" in server.log.read_text()


def test_echo_and_prompt_logprobs_agree_with_score(server, engine):
    """What lm-evaluation-harness's log-likelihood requests send: echo, logprobs, max_tokens 0
    or 1; vLLM's prompt_logprobs beside them."""
    logits = engine.score(PROMPT, "planner")
    ref = [_log_softmax(logits[j - 1])[PROMPT[j]] for j in range(1, len(PROMPT))]
    with server.http() as http:
        for max_tokens in (0, 1):
            body = dict(model="planner", prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=2,
                        prompt_logprobs=1, ignore_eos=True)
            c = complete(http, **body)["choices"][0]
            lp = c["logprobs"]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            np.testing.assert_allclose(lp["token_logprobs"][1:len(PROMPT)], ref, atol=1e-5)
            assert len(lp["tokens"]) == len(PROMPT) + max_tokens
            assert c["text"].startswith(engine.tokenizer.decode(PROMPT))
            pl = c["prompt_logprobs"]
            assert pl[0] is None and len(pl) == len(PROMPT)
            for j in range(1, len(PROMPT)):
                mine = pl[j][str(PROMPT[j])]
                assert abs(mine["logprob"] - ref[j - 1]) < 1e-5 and mine["rank"] >= 1
            with http.stream("POST", "/v1/completions", json={**body, "temperature": 0, "stream": True}) as r:
                chunks = [e["choices"][0] for e in sse_events(r.iter_lines())]
            assert "".join(ch["text"] for ch in chunks) == c["text"]
            assert sum((ch["logprobs"]["token_logprobs"] for ch in chunks if ch["logprobs"]), []) \
                == lp["token_logprobs"]
        r = http.post("/v1/completions", json=dict(prompt=PROMPT, max_tokens=0))
        assert r.status_code == 400 and "echo" in r.json()["error"]["message"]
