"""`python -m forkjax.serve` as users run it (serve_utils.py): the endpoints, completions, chat
and streaming, over httpx and the official `openai` client."""

from __future__ import annotations

import socket
import time
from unittest.mock import ANY

import httpx
import numpy as np
from safetensors.numpy import load_file, save_file

import forkjax
from serve_utils import BASE, CONTEXT, DEMO, KEY, complete, sse_events, wait_for, write_peft


# ---- endpoints --------------------------------------------------------------------------------

def test_health_and_models(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = {m.id: m for m in server.openai().models.list()}
    assert set(models) == {BASE, *DEMO}
    assert all(models[a].model_extra["parent"] == BASE for a in DEMO)
    assert models[BASE].model_extra["max_model_len"] == CONTEXT


def test_model_tokenize_detokenize_and_version(server):
    with server.http() as http:
        assert http.get(f"/v1/models/{DEMO[1]}").json()["parent"] == BASE
        assert http.get(f"/v1/models/{BASE}").json()["max_model_len"] == CONTEXT
        missing = http.get("/v1/models/nobody")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        r = http.post("/tokenize", json={"model": "coder", "prompt": "héllo"}).json()
        assert r == {"count": 7, "max_model_len": CONTEXT, "tokens": [256, *"héllo".encode()]}
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        sent = complete(http, model=BASE, prompt=chat["tokens"], max_tokens=1, return_token_ids=True)
        assert sent["usage"]["prompt_tokens"] == chat["count"] > 3
        assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "héllo"}
        assert http.post("/detokenize", json={"tokens": [10 ** 6]}).status_code == 400
        assert http.post("/tokenize", json={"model": "nobody", "prompt": "x"}).status_code == 404
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{server.url}/version").json()["version"] == forkjax.__version__


def test_stalled_body_gets_408_while_others_are_served(server):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}"
                     "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mod".encode())
        t0 = time.time()
        with server.http() as http:  # served while the other body stalls
            complete(http, model="coder", prompt="meanwhile", max_tokens=2)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        waited = time.time() - t0
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b"connection: close" in reply.lower() and b"did not arrive within 5 s" in reply
        assert 4 <= waited < 20, waited
        assert sock.recv(4096) == b""  # closed


def test_a_request_that_computes_nan_fails_alone(server, tmp_path):
    """An adapter whose finite weights overflow: its request gets a 500 error body, the others
    are served, and the server keeps serving."""
    path = write_peft(tmp_path / "huge")
    tensors = {k: np.full_like(v, 3e38) if "lora_A" in k else v
               for k, v in load_file(str(path / "adapter_model.safetensors")).items()}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with server.http() as http:
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "huge", "lora_path": str(path)}
                         ).status_code == 200
        try:
            before = complete(http, model="planner", prompt="steady", max_tokens=4)
            r = http.post("/v1/completions", json={"model": "huge", "prompt": "boom", "max_tokens": 4})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert "NaN or inf" in r.json()["error"]["message"]
            assert complete(http, model="planner", prompt="steady", max_tokens=4) == {
                **before, "id": ANY, "created": ANY}
        finally:
            http.post("/v1/unload_lora_adapter", json={"lora_name": "huge"})


def test_cache_salt_separates_tenants(server):
    computed = "forkjax:prefill_tokens_computed_total"
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 250, 64)]
    with server.http() as http:
        def cost(salt):
            before = server.metrics()[computed]
            complete(http, model="critic", prompt=prompt, max_tokens=1, cache_salt=salt)
            return server.metrics()[computed] - before
        assert cost("tenant-a") == 64
        assert cost("tenant-b") == 64  # nothing of tenant-a's is read
        assert cost("tenant-a") < 64  # its own cache is
        bad = http.post("/v1/completions", json={"model": "critic", "prompt": "x", "cache_salt": ""})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_session_end_releases_the_session_over_http(server):
    """A session stays open between its turns and closes when its session_end request ends;
    bad session fields get a 400 naming the field."""
    open_ = "forkjax:sessions_open"
    with server.http() as http:
        before = server.metrics()[open_]
        complete(http, model="critic", prompt="turn one", max_tokens=2, session_id="http-wf",
                 session_tokens=64, session_next_s=2.5)
        assert server.metrics()[open_] == before + 1
        chat = http.post("/v1/chat/completions", json={
            "model": "critic", "messages": [{"role": "user", "content": "turn two"}], "max_tokens": 2,
            "session_id": "http-wf", "session_end": True})
        assert chat.status_code == 200, chat.text
        assert server.metrics()[open_] == before
        for field, value in (("session_end", "yes"), ("session_tokens", 0), ("session_next_s", -1)):
            bad = http.post("/v1/completions", json={"model": "critic", "prompt": "x",
                                                     "session_id": "s", field: value})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field
        bad = http.post("/v1/completions", json={"model": "critic", "prompt": "x", "session_end": True})
        assert bad.status_code == 400 and "session_id" in bad.json()["error"]["message"]
    assert server.metrics()[open_] == before


def test_completions_select_the_adapter(server):
    client = server.openai()
    outs = {}
    for model in (BASE, *DEMO):
        r = client.completions.create(model=model, prompt="The plan is", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        assert r.usage.prompt_tokens == len("The plan is") + 1  # bytes + BOS
        outs[model] = r.choices[0].text
    again = client.completions.create(model="coder", prompt="The plan is", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == outs["coder"]  # greedy is deterministic
    assert len(set(outs.values())) == 4, outs  # each adapter is its own model


def test_completion_batch_n_and_token_ids(server):
    with server.http() as http:
        r = complete(http, prompt=[[256, 65, 66], [256, 67]], max_tokens=3, n=2, ignore_eos=True,
                     return_token_ids=True)
    choices = r["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in choices] == [[256, 65, 66]] * 2 + [[256, 67]] * 2
    assert choices[0]["token_ids"] == choices[1]["token_ids"]  # greedy: n copies agree
    usage = r["usage"]
    # the n choices of a prompt count its cached tokens once; these prompts share at most their
    # BOS with what the cache holds
    assert usage.pop("prompt_tokens_details")["cached_tokens"] <= 2
    assert usage == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


def test_streaming_equals_non_streaming(server):
    body = dict(model="planner", prompt="Stream me", max_tokens=12, ignore_eos=True, return_token_ids=True)
    with server.http() as http:
        full = complete(http, **body)["choices"][0]
        with http.stream("POST", "/v1/completions", json={**body, "temperature": 0, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r.iter_lines())
    chunks, usage = events[:-1], events[-1]["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == full["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == 12
    # the same prompt again on the same adapter: all of it but its last token read from the cache
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_chat_and_chat_stream(server):
    client = server.openai()
    messages = [{"role": "system", "content": "You review code."}, {"role": "user", "content": "Review."}]
    full = client.chat.completions.create(model="critic", messages=messages, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.object == "chat.completion"
    # The documented default template: <|role|> lines, then the assistant cue, after BOS.
    prompt = "<|system|>\nYou review code.\n<|user|>\nReview.\n<|assistant|>\n"
    assert full.usage.prompt_tokens == len(prompt) + 1
    stream = client.chat.completions.create(model="critic", messages=messages, max_tokens=10,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stop_strings_cut_the_text(server):
    reason = 'forkjax:request_success_total{finished_reason="%s"}'
    with server.http() as http:
        text = complete(http, prompt="abc", max_tokens=24, ignore_eos=True)["choices"][0]["text"]
        before = server.metrics()
        k = next(k for k in range(2, len(text)) if text[k] != "\ufffd" and text[k] not in text[:k])
        body = dict(prompt="abc", max_tokens=24, ignore_eos=True, stop=[text[k], "never appears"])
        cut = complete(http, **body)["choices"][0]
        with http.stream("POST", "/v1/completions", json={**body, "temperature": 0, "stream": True}) as r:
            streamed = "".join(e["choices"][0]["text"] for e in sse_events(r.iter_lines()))
    assert cut == {**cut, "text": text[:k], "finish_reason": "stop"}
    assert streamed == text[:k]
    after = wait_for(server, lambda m: m[reason % "stop"] == before[reason % "stop"] + 2)
    assert after[reason % "abort"] == before[reason % "abort"]  # a stop string is no abort


def test_edge_values_are_served_and_seeds_reproduce(server):
    with server.http() as http:
        for extra in ({"temperature": 1e-40}, {"top_k": 10**9, "temperature": 1.0},
                      {"top_p": 1e-9, "temperature": 2}, {"stop_token_ids": [10**30, -1]},
                      {"seed": -5, "temperature": 1}, {"prompt": [257, 256]}):
            complete(http, **{"prompt": "edge", "max_tokens": 4, **extra})
        body = dict(prompt="roll", max_tokens=12, temperature=1.5, seed=1234, n=3, ignore_eos=True)
        first, second = complete(http, **body)["choices"], complete(http, **body)["choices"]
    assert [c["text"] for c in first] == [c["text"] for c in second]  # seeded sampling repeats
    assert len({c["text"] for c in first}) > 1  # and the n samples differ (seed + i)


def test_lora_path_and_prompt_token_ids_stand_for_model_and_prompt(server):
    """The form a gateway forwards (tests/test_cluster.py): the base model's name with the adapter
    in `lora_path`, token ids in `prompt_token_ids` beside an empty prompt."""
    with server.http() as http:
        want = complete(http, model="coder", prompt=[72, 105, 33], max_tokens=6)
        got = complete(http, model=BASE, lora_path="coder", prompt="", prompt_token_ids=[72, 105, 33], max_tokens=6)
        base = complete(http, model=BASE, prompt=[72, 105, 33], max_tokens=6)
    assert got["model"] == "coder" and got["choices"][0]["text"] == want["choices"][0]["text"]
    assert base["choices"][0]["text"] != want["choices"][0]["text"]
