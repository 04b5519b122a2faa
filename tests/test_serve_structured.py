"""Structured outputs and tool calls through the real server (tiny-llama: random weights, a byte
tokenizer): whatever the model would say, the grammar decides what it may, so every output that
ends "stop" parses and validates against its schema (checked with `jsonschema`, independent of
llguidance); an output cut by max_tokens ends "length".
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
from serve_utils import sse_events

MAX_TOKENS = 200
# Tools go into the prompt (the Hermes system message: ~500 bytes, a token each) within the test
# server's 1024-token context: small tools, short tool-call answers.
TOOL_TOKENS = 64

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 6},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
CALC = {"type": "function", "function": {
    "name": "calculate", "parameters": {"type": "object", "properties": {
        "expr": {"type": "string", "maxLength": 8}}, "required": ["expr"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters


def random_schema(rng) -> dict:
    """A bounded schema with nested objects, enums, bounded strings and arrays, required fields."""
    leaf = [{"type": "string", "maxLength": int(rng.integers(1, 6))},
            {"enum": ["red", "green", "blue"]},
            {"type": "integer", "minimum": -5, "maximum": 500},
            {"type": "boolean"},
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
             "minItems": 1, "maxItems": int(rng.integers(1, 4))}]

    def obj(depth):
        n = int(rng.integers(1, 4))
        props = {f"k{i}": (obj(depth + 1) if depth < 2 and rng.random() < 0.3
                           else leaf[int(rng.integers(len(leaf)))]) for i in range(n)}
        required = [k for k in props if rng.random() < 0.7] or [next(iter(props))]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    return obj(0)


def _chat(http, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"temperature": 1.0, "max_tokens": MAX_TOKENS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream_chat(http, **body) -> tuple[str, list, str]:
    """(content, tool-call deltas, finish_reason) of a streamed chat completion."""
    with http.stream("POST", "/v1/chat/completions",
                     json={"temperature": 1.0, "max_tokens": MAX_TOKENS, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    content, calls, reason = "", [], None
    for e in events:
        for c in e["choices"]:
            content += c["delta"].get("content") or ""
            calls += c["delta"].get("tool_calls") or []
            reason = c["finish_reason"] or reason
    return content, calls, reason


def _valid(text: str, reason: str, schema: dict) -> bool:
    """Validates when it stopped; True if it stopped, False if cut by max_tokens."""
    assert reason in ("stop", "length"), reason
    if reason == "stop":
        jsonschema.validate(json.loads(text), schema)
    return reason == "stop"


def test_json_schema_outputs_validate_streamed_and_not(server):
    rng = np.random.default_rng(0)
    schemas = [random_schema(rng) for _ in range(50)]

    def one(i):
        body = dict(messages=[{"role": "user", "content": f"Item {i} as JSON"}], seed=i,
                    response_format={"type": "json_schema", "json_schema": {
                        "name": f"item{i}", "schema": schemas[i], "strict": True}})
        with server.http() as http:
            if i % 2:
                text, calls, reason = _stream_chat(http, **body)
                assert not calls
            else:
                c = _chat(http, **body)["choices"][0]
                text, reason = c["message"]["content"], c["finish_reason"]
        return _valid(text, reason, schemas[i])

    with ThreadPoolExecutor(16) as pool:  # concurrent: the engine batches them
        stopped = list(pool.map(one, range(50)))
    assert sum(stopped) >= 45, stopped  # bounded schemas finish well within MAX_TOKENS


def test_json_object_and_completions_json_schema(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    with server.http() as http:
        c = _chat(http, messages=[{"role": "user", "content": "JSON please"}], seed=3,
                  response_format={"type": "json_object"}, max_tokens=60)["choices"][0]
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(c["message"]["content"]), dict)
        r = http.post("/v1/completions", json={
            "prompt": "A number:", "max_tokens": 50, "temperature": 1.0, "seed": 1, "n": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert _valid(c["text"], c["finish_reason"], schema)
        r = http.post("/v1/completions", json={"prompt": "A number:", "max_tokens": 50, "seed": 2,
                                               "structured_outputs": {"json": schema}})
        c = r.json()["choices"][0]
        assert _valid(c["text"], c["finish_reason"], schema)
        # cut by max_tokens: "length", the JSON's beginning
        r = http.post("/v1/completions", json={"prompt": "A number:", "max_tokens": 3, "guided_json": schema})
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "length" and c["text"] == '{"n'[:len(c["text"])] and len(c["text"]) == 3


def test_guided_choice_regex_and_grammar(server):
    choices = ["alpha", "beta", "gamma delta"]
    with server.http() as http:
        for seed in range(6):
            r = http.post("/v1/completions", json={"prompt": "Pick:", "max_tokens": 20, "temperature": 1.0,
                                                   "seed": seed, "guided_choice": choices})
            c = r.json()["choices"][0]
            assert c["text"] in choices and c["finish_reason"] == "stop"
        c = _chat(http, messages=[{"role": "user", "content": "a date"}], seed=5,
                  guided_regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")["choices"][0]
        assert c["finish_reason"] == "stop" and len(c["message"]["content"]) == 10
        assert c["message"]["content"][4] == "-" and c["message"]["content"][:4].isdigit()
        c = _chat(http, messages=[{"role": "user", "content": "yes or no"}], seed=6,
                  guided_grammar='start: ("yes" | "no") "!"')["choices"][0]
        assert c["message"]["content"] in ("yes!", "no!")


@pytest.mark.parametrize("body,param,named", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"guided_json": {"type": "string", "pattern": "(?<=a)b"}}, "guided_json", "look-around"),
    ({"guided_regex": "a("}, "guided_regex", "unclosed group"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "response_format", "at most one"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"guided_choice": ["a", "b"], "min_tokens": 2}, "min_tokens", "min_tokens"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern",
     "guided_whitespace_pattern"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ({"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
])
def test_what_cannot_be_enforced_is_a_400(server, body, param, named):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert named in err["message"] and (err["param"] == param or param == "response_format"), err


def test_named_tool_choice_returns_a_valid_call_streamed_alike(server):
    schema = WEATHER["function"]["parameters"]
    body = dict(messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
                max_tokens=TOOL_TOKENS)
    with server.http() as http:
        c = _chat(http, **body)["choices"][0]
        content, deltas, reason = _stream_chat(http, **body)
    assert c["finish_reason"] == "tool_calls" and c["message"].get("content") is None
    (call,) = c["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    # the stream's deltas reassemble to the same call: the first names it, the rest add arguments
    assert reason == "tool_calls" and content == ""
    assert {d["index"] for d in deltas} == {0} and deltas[0]["function"]["name"] == "get_weather"
    assert deltas[0]["id"].startswith("chatcmpl-tool-") and all("id" not in d for d in deltas[1:])
    assert "".join(d["function"].get("arguments", "") for d in deltas) == call["function"]["arguments"]


def test_required_tool_choice_and_the_next_turn(server):
    body = dict(messages=[{"role": "user", "content": "Call a tool"}], tools=[CALC, NOW],
                tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=TOOL_TOKENS)
    schemas = {"calculate": CALC["function"]["parameters"], "now": {"type": "object", "maxProperties": 0}}
    with server.http() as http:
        c = _chat(http, **body)["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        (call,) = c["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        content, deltas, reason = _stream_chat(http, **body)  # greedy: the same call
        assert reason == "tool_calls" and {d["index"] for d in deltas} == {0}
        assert deltas[0]["function"]["name"] == call["function"]["name"]
        assert "".join(d["function"].get("arguments", "") for d in deltas) == call["function"]["arguments"]
        # the call and its result go back in the next turn; tool_choice none: plain text
        turn = body["messages"] + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": call["id"], "content": "12 C"}]
        r = _chat(http, messages=turn, tools=[CALC, NOW], tool_choice="none", max_tokens=8, temperature=0,
                  return_token_ids=True)
        c = r["choices"][0]
        assert c["finish_reason"] in ("stop", "length") and "tool_calls" not in c["message"]
        prompt = bytes(t for t in r["prompt_token_ids"] if t < 256).decode()  # the byte tokenizer's
        args = json.loads(call["function"]["arguments"])
        assert json.dumps({"name": call["function"]["name"], "arguments": args}) in prompt
        assert "<|tool|>\n12 C\n<|assistant|>\n" in prompt


ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
          "required": ["city"], "additionalProperties": False}


@pytest.mark.parametrize("parallel", [True, False])
def test_response_format_beside_tools_is_calls_or_the_final_answer(server, parallel):
    """tool_choice auto with a response_format: the output is Hermes tool calls (parsed into
    tool_calls) or a final message that follows the schema. A logit bias on the first byte of
    each (`<` of `<tool_call>`, `{` of the answer) picks the branch a random model takes, one
    on the end of text (id 257) ends it where the grammar allows."""
    body = dict(messages=[{"role": "user", "content": "2 + 2?"}], tools=[CALC],
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
                parallel_tool_calls=parallel, temperature=0, max_tokens=100)  # a call: < 80 bytes
    calling, answering = ({str(ord(first)): 100, "257": 100} for first in "<{")
    with server.http() as http:
        c = _chat(http, **body, logit_bias=calling)["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
        calls = c["message"]["tool_calls"]
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            assert call["function"]["name"] == "calculate"
            jsonschema.validate(json.loads(call["function"]["arguments"]), CALC["function"]["parameters"])
        content, deltas, reason = _stream_chat(http, **body, logit_bias=calling)
        assert reason == "tool_calls" and content == ""
        assert [d["function"]["name"] for d in deltas] == [c["function"]["name"] for c in calls]

        c = _chat(http, **body, logit_bias=answering)["choices"][0]
        assert c["finish_reason"] == "stop" and "tool_calls" not in c["message"], c
        jsonschema.validate(json.loads(c["message"]["content"]), ANSWER)
        content, deltas, reason = _stream_chat(http, **body, logit_bias=answering)
        assert reason == "stop" and not deltas and content == c["message"]["content"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "calculate"}}])
def test_response_format_waits_while_tool_choice_forces_a_call(server, choice):
    """required or a named function: this turn calls; the schema is for a later turn's answer."""
    with server.http() as http:
        c = _chat(http, messages=[{"role": "user", "content": "2 + 2?"}], tools=[CALC], tool_choice=choice,
                  response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
                  parallel_tool_calls=False, temperature=0, max_tokens=100)["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
    (call,) = c["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), CALC["function"]["parameters"])


def test_unconstrained_outputs_unchanged_beside_constrained_ones(server):
    """f32 greedy: requests run alone and beside running constrained ones give the same tokens.
    The constrained requests stream, and the unconstrained ones are sent once each constrained
    one has its first token: their strings of 40+ characters (52+ tokens, at most 4 bytes a
    character: under MAX_TOKENS) keep them running while the 24 unconstrained tokens come."""
    prompts = [f"Story {i}:" for i in range(4)]
    long_text = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40, "maxLength": 45}},
                 "required": ["text"], "additionalProperties": False}
    started = [threading.Event() for _ in range(4)]

    def plain(http, p):
        r = http.post("/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0})
        return r.json()["choices"][0]["text"]

    def constrained(i):
        body = {"messages": [{"role": "user", "content": f"q{i}"}], "seed": i, "stream": True,
                "max_tokens": MAX_TOKENS, "temperature": 1.0, "guided_json": long_text}
        with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if '"content":"' in line and '"content":""' not in line:
                    started[i].set()
        started[i].set()  # (if it failed: the assertions below say so)
        content, _, reason = "", None, None
        for e in sse_events(lines):
            for c in e["choices"]:
                content += c["delta"].get("content") or ""
                reason = c["finish_reason"] or reason
        return content, reason

    with server.http() as http:
        alone = [plain(http, p) for p in prompts]
    guided_steps = server.metrics()["forkjax:guided_steps_total"]
    with ThreadPoolExecutor(8) as pool, server.http() as http:
        guided = [pool.submit(constrained, i) for i in range(4)]
        assert all(e.wait(120) for e in started)
        beside = list(pool.map(lambda p: plain(http, p), prompts))
        for f in guided:
            text, reason = f.result()
            assert reason == "stop" and len(json.loads(text)["text"]) >= 40
    assert beside == alone
    assert server.metrics()["forkjax:guided_steps_total"] >= guided_steps + 40  # /metrics counts them


def test_continue_final_message_continues_the_assistant_text(server):
    """The chat prompt ends inside the last message: the same tokens as a completion of that
    text (the default template, greedy f32)."""
    with server.http() as http:
        c = _chat(http, messages=[{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}],
                  add_generation_prompt=False, continue_final_message=True, temperature=0, max_tokens=6)
        r = http.post("/v1/completions", json={"prompt": "<|user|>\nCount\n<|assistant|>\n1, 2,",
                                               "max_tokens": 6, "temperature": 0})
    assert c["choices"][0]["message"]["content"] == r.json()["choices"][0]["text"]
    assert c["usage"]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]


def test_tokenize_counts_the_prompt_a_chat_with_tools_sends(server):
    """/tokenize renders messages and tools as /v1/chat/completions does: the same count as the
    chat's prompt_tokens, more than without the tools; tools go with messages only."""
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Let me"}]
    with server.http() as http:
        for extra in ({}, {"tools": [NOW]}, {"tools": [NOW], "continue_final_message": True,
                                             "add_generation_prompt": False}):
            counted = http.post("/tokenize", json={"messages": messages, **extra}).json()["count"]
            chat = _chat(http, messages=messages, max_tokens=1, **extra)
            assert chat["usage"]["prompt_tokens"] == counted, extra
        bare = http.post("/tokenize", json={"messages": messages}).json()["count"]
        assert counted > bare
        r = http.post("/tokenize", json={"prompt": "hi", "tools": [NOW]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
