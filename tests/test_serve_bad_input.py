"""Bad input gets an OpenAI-style error and changes nothing (serve_utils.py); /flush_cache."""

from __future__ import annotations

import re

import httpx
import pytest

from serve_utils import AUTH, BASE, complete


LONG = "x" * 2000  # > the 1024-token context
POOL = [1] * 1000  # fits the context, not the 960-token KV pool
TOOLS = [{"type": "function", "function": {"name": "lookup weather", "description": "a name with a blank"}}]

BAD = {  # name: (path, body (dict -> JSON, bytes -> raw), headers, status, param)
    "malformed_json": ("/v1/completions", b'{"prompt": "x",', None, 400, None),
    "not_an_object": ("/v1/completions", b"[1, 2]", None, 400, None),
    "not_json_content_type": ("/v1/completions", b'{"prompt": "x"}', {"content-type": "text/plain"}, 415, None),
    "prompt_wrong_type": ("/v1/completions", {"prompt": 12}, None, 400, "prompt"),
    "max_tokens_string": ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, None, 400, "max_tokens"),
    "max_tokens_negative": ("/v1/completions", {"prompt": "x", "max_tokens": -3}, None, 400, "max_tokens"),
    "max_tokens_zero": ("/v1/completions", {"prompt": "x", "max_tokens": 0}, None, 400, "max_tokens"),
    "max_tokens_absurd": ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, None, 400, "prompt"),
    "max_tokens_float": ("/v1/completions", {"prompt": "x", "max_tokens": 5.5}, None, 400, "max_tokens"),
    "temperature_bool": ("/v1/completions", {"prompt": "x", "temperature": True}, None, 400, "temperature"),
    "temperature_negative": ("/v1/completions", {"prompt": "x", "temperature": -1}, None, 400, "temperature"),
    "top_p_zero": ("/v1/completions", {"prompt": "x", "top_p": 0}, None, 400, "top_p"),
    "seed_huge": ("/v1/completions", {"prompt": "x", "seed": 2**70}, None, 400, "seed"),
    "n_too_many": ("/v1/completions", {"prompt": "x", "n": 1000}, None, 400, "n"),
    "unknown_model": ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, None, 404, "model"),
    "empty_prompt": ("/v1/completions", {"prompt": []}, None, 400, "prompt"),
    "empty_token_list": ("/v1/completions", {"prompt": [[]]}, None, 400, "prompt"),
    "token_out_of_vocab": ("/v1/completions", {"prompt": [5, 99999]}, None, 400, "prompt"),
    "token_past_int64": ("/v1/completions", {"prompt": [-2**63 - 1]}, None, 400, "prompt"),
    "prompt_beside_token_ids": ("/v1/completions", {"prompt": "x", "prompt_token_ids": [5]}, None, 400,
                                "prompt_token_ids"),
    "unknown_lora_path": ("/v1/completions", {"model": "tiny-llama", "lora_path": "gpt-4", "prompt": "x"}, None,
                          404, "model"),
    "prompt_over_context": ("/v1/completions", {"prompt": LONG}, None, 400, "prompt"),
    "prompt_over_pool": ("/v1/completions", {"prompt": POOL, "max_tokens": 8}, None, 400, "prompt"),
    "logprobs_too_many": ("/v1/completions", {"prompt": "x", "logprobs": 21}, None, 400, "logprobs"),
    "logit_bias_out_of_vocab": ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, None, 400,
                                "logit_bias"),
    "logit_bias_not_an_id": ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, None, 400,
                             "logit_bias"),
    "min_tokens_over_max": ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, None, 400,
                            "min_tokens"),
    "stop_empty": ("/v1/completions", {"prompt": "x", "stop": [""]}, None, 400, "stop"),
    "empty_body": ("/v1/completions", b"", None, 400, "prompt"),
    "null_body": ("/v1/chat/completions", b"null", None, 400, None),  # no object: no field to name
    "empty_body_load": ("/v1/load_lora_adapter", b"", None, 400, "lora_name"),
    "session_end_alone": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                   "session_end": True}, None, 400, "session_end"),
    "session_tokens_alone": ("/v1/completions", {"prompt": "x", "session_tokens": 64}, None, 400,
                             "session_tokens"),
    "session_next_s_alone": ("/v1/completions", {"prompt": "x", "session_next_s": 0}, None, 400,
                             "session_next_s"),
    "best_of": ("/v1/completions", {"prompt": "x", "best_of": 2}, None, 400, "best_of"),
    "suffix": ("/v1/completions", {"prompt": "x", "suffix": "what a suffix says " * 20}, None, 400, "suffix"),
    "tool_choice_required": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                      "tool_choice": "required"}, None, 400, "tool_choice"),
    "response_format_unenforceable": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, None, 400, "response_format"),
    "top_logprobs_alone": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "top_logprobs": 2}, None, 400, "top_logprobs"),
    "chat_messages_string": ("/v1/chat/completions", {"messages": "hi"}, None, 400, "messages"),
    "chat_no_messages": ("/v1/chat/completions", {"messages": []}, None, 400, "messages"),
    "chat_bad_role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400, "messages"),
    "chat_image": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, None, 400, "messages"),
    "chat_over_context": ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, None, 400, "messages"),
    "chat_tool_bad_name": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "tools": TOOLS}, None, 400, "tools"),
    "load_wrong_type": ("/v1/load_lora_adapter", {"lora_name": 3, "lora_path": "/tmp"}, None, 400, "lora_name"),
    "load_base_name": ("/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": "/tmp"}, None, 400, "lora_name"),
    "unload_unknown": ("/v1/unload_lora_adapter", {"lora_name": "nobody"}, None, 404, "lora_name"),
    "no_api_key": ("/v1/models", None, {"authorization": ""}, 401, None),
    "wrong_api_key": ("/v1/completions", {"prompt": "x"}, {"authorization": "Bearer nope"}, 401, None),
    "body_too_large": ("/v1/completions", {"prompt": "x" * (1 << 20)}, None, 413, None),
    "chunked_too_large": ("/v1/completions", "chunked", None, 413, None),
    "unknown_route": ("/v1/nothing", {}, None, 404, None),
    "too_many_prompts": ("/v1/completions", {"prompt": ["a"] * 65}, None, 400, "prompt"),
    "lone_surrogate": ("/v1/completions", b'{"prompt": "\\ud800"}', None, 400, "prompt"),
    "lone_surrogate_name": ("/v1/load_lora_adapter", b'{"lora_name": "\\udc80x", "lora_path": "/tmp"}',
                            None, 400, "lora_name"),
    "lone_surrogate_key": ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}', None, 400, None),
    "deep_nesting": ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, 400, None),
    "session_id_wrong_type": ("/v1/completions", {"prompt": "x", "session_id": 7}, None, 400, "session_id"),
    "session_id_too_long": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                     "session_id": "s" * 257}, None, 400, "session_id"),
    "fanout_not_a_list": ("/v1/completions", {"prompt": "x", "fanout_adapters": "coder"}, None, 400,
                          "fanout_adapters"),
    "fanout_too_long": ("/v1/completions", {"prompt": "x", "fanout_adapters": ["coder"] * 257}, None, 400,
                        "fanout_adapters"),
    "fanout_off_forkkv": ("/v1/completions", {"prompt": "x", "fanout_adapters": ["coder"]}, None, 400,
                          "fanout_adapters"),
    "flush_no_api_key": ("/flush_cache", {}, {"authorization": ""}, 401, None),
}


def send_bad(http: httpx.Client, name: str) -> httpx.Response:
    path, body, headers, _, _ = BAD[name]
    headers = {**AUTH, **(headers or {})}
    if body == "chunked":  # a generator is sent without Content-Length
        body = iter([b"{" + b" " * (1 << 19)] * 3)
    if isinstance(body, dict):
        return http.post(path, json=body, headers=headers)
    if body is None:
        return http.get(path, headers=headers)
    return http.post(path, content=body, headers={"content-type": "application/json", **headers})


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_gets_an_openai_error(server, name):
    _, _, _, status, param = BAD[name]
    with server.http() as http:
        r = send_bad(http, name)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error  # the top-level field at fault, or null where none is


def test_refusals_name_the_field_without_quoting_its_value(server):
    with server.http() as http:
        suffix = send_bad(http, "suffix").json()["error"]
        empty = send_bad(http, "empty_body").json()["error"]
    assert suffix["message"] == "suffix: only '' or null is supported by this server"
    assert "what a suffix says" not in suffix["message"]
    assert empty["message"] == "the request body is empty: expected a JSON object with prompt"


def test_bad_input_changes_nothing(server):
    with server.http() as http:
        complete(http, prompt="warm", max_tokens=2)
        models, before = http.get("/v1/models").json(), server.metrics()
        for name in BAD:
            assert send_bad(http, name).status_code in (400, 401, 404, 413, 415)
        assert http.get("/v1/models").json() == models
        after = server.metrics()
        for key in ("forkjax:prompt_tokens_total", "forkjax:generation_tokens_total",
                    'forkjax:kv_pages_used{pool="base"}', "forkjax:num_requests_running"):
            assert after[key] == before[key], key
        assert complete(http, prompt="still serving", max_tokens=3)["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_flush_cache_frees_every_idle_page(server):
    evicted = 'forkjax:kv_pages_evicted_total{pool="%s"}'
    with server.http() as http:
        complete(http, model="coder", prompt="flush me " * 4, max_tokens=4, session_id="flush-test")
        before = server.metrics()
        assert before['forkjax:kv_pages_used{pool="base"}'] > 0
        r = http.post("/flush_cache")
    assert r.status_code == 200 and (m := re.fullmatch(r"Cache flushed\. (\d+) KV pages freed\.", r.text))
    after = server.metrics()
    assert after['forkjax:kv_pages_used{pool="base"}'] == after['forkjax:kv_pages_used{pool="residual"}'] == 0
    assert after["forkjax:host_bytes_used"] == 0  # both tiers
    freed = sum(after[evicted % p] - before[evicted % p] for p in ("base", "residual"))
    assert freed == int(m[1]) == before['forkjax:kv_pages_used{pool="base"}']
