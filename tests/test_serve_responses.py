"""POST /v1/responses (OpenAI's Responses API) through the real server (tiny-llama: random
weights, a byte tokenizer, so one token a byte): every body and stream event is parsed with the
`openai` client's own types, the input items are checked to reach the prompt as the equivalent
chat messages do (their token counts against /tokenize's), and the OpenAI Agents SDK's default
model runs a tool-calling agent and a streamed structured one against it. Outputs are
constrained (a required or named tool, a JSON schema) so that the tests check the protocol,
not what a random model says.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from serve_utils import KEY

# Tools go into the prompt in the Hermes format (~500 tokens with the tool) within the 1024-token
# context: one small tool.
PICK = {"type": "function", "name": "pick", "description": "Pick.", "strict": True, "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "c": {"enum": ["x", "y"]}},
    "required": ["n", "c"], "additionalProperties": False}}
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}},
           "required": ["ok", "n"], "additionalProperties": False}
EVENTS = TypeAdapter(ResponseStreamEvent)


def _create(http, **body) -> Response:
    r = http.post("/v1/responses", json={"temperature": 0, "max_output_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return Response.model_validate(r.json())


def _tokens(http, messages: list[dict], tools=None) -> int:
    """The prompt length of these chat messages, as /v1/chat/completions renders them."""
    body = {"messages": messages, **({"tools": [{"type": "function", "function": {
        k: v for k, v in t.items() if k != "type"}} for t in tools]} if tools else {})}
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _check_usage(r: Response):
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens >= 1
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    assert u.input_tokens_details.cache_write_tokens == u.input_tokens - u.input_tokens_details.cached_tokens
    assert u.output_tokens_details.reasoning_tokens == 0


def test_text_input_answers_a_message_with_usage_and_cached_tokens(server):
    with server.http() as http:
        first = _create(http, input="Say hi.", instructions="Be brief.", metadata={"k": "v"}, user="u1")
        again = _create(http, input="Say hi.", instructions="Be brief.")
        assert first.object == "response" and first.model == "tiny-llama" and first.metadata == {"k": "v"}
        assert first.instructions == "Be brief." and first.user == "u1" and first.temperature == 0
        [item] = first.output
        assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
        assert first.output_text == item.content[0].text and again.output_text == first.output_text
        if first.status == "incomplete":  # 8 tokens of a random model: cut, most likely
            assert first.incomplete_details.reason == "max_output_tokens" and item.status == "incomplete"
            assert first.usage.output_tokens == 8
        else:
            assert first.status == "completed" and first.incomplete_details is None
        _check_usage(first)
        _check_usage(again)
        assert again.usage.input_tokens == first.usage.input_tokens == _tokens(
            http, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}])
        assert again.usage.input_tokens_details.cached_tokens > 0  # the same prompt, from the prefix cache
    # the openai client parses the same body into its own types
    r = server.openai().responses.create(model="tiny-llama", input="Say hi.", instructions="Be brief.",
                                         max_output_tokens=8, temperature=0)
    assert r.output_text == first.output_text


def test_tool_choice_required_and_named_give_function_calls_and_items_round_trip(server):
    with server.http() as http:
        called = _create(http, input="Pick one.", tools=[PICK], tool_choice="required",
                         parallel_tool_calls=False, max_output_tokens=64)
        assert called.status == "completed" and called.tool_choice == "required"
        assert not called.parallel_tool_calls and called.tools[0].name == "pick"
        [call] = called.output
        assert call.type == "function_call" and call.name == "pick" and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), PICK["parameters"])
        # the call and its output sent back as items (the Agents SDK's shapes), then a named tool
        items = [{"role": "user", "content": "Pick one."}, call.model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": call.call_id, "output": "ok"},
                 {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again."}]}]
        named = _create(http, input=items, tools=[PICK], tool_choice={"type": "function", "name": "pick"},
                        max_output_tokens=24)
        [call2] = named.output
        assert call2.name == "pick" and call2.call_id != call.call_id
        jsonschema.validate(json.loads(call2.arguments), PICK["parameters"])
        assert named.usage.input_tokens == _tokens(http, [
            {"role": "user", "content": "Pick one."},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.call_id, "type": "function", "function": {"name": "pick", "arguments": call.arguments}}]},
            {"role": "tool", "content": "ok", "tool_call_id": call.call_id},
            {"role": "user", "content": "Again."}], tools=[PICK])


def test_text_format_json_schema_streams_valid_json(server):
    client = server.openai()
    fmt = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}}
    with client.responses.stream(model="tiny-llama", input="Judge.", text=fmt, max_output_tokens=40,
                                 temperature=0) as stream:  # the client's own stream state machine
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.status == "completed" and final.text.format.type == "json_schema"
    jsonschema.validate(json.loads(final.output_text), VERDICT)
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    whole = client.responses.create(model="tiny-llama", input="Judge.", text=fmt, max_output_tokens=40,
                                    temperature=0)
    assert whole.output_text == final.output_text


def test_stream_events_in_order_with_sequence_numbers(server):
    client = server.openai()
    events = list(client.responses.create(model="tiny-llama", input="Hello.", max_output_tokens=12,
                                          temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    end = "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done", end])
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(d.delta for d in deltas)
    final = events[-1].response
    assert text == events[-4].text == final.output_text and final.usage.output_tokens >= 1
    assert len({d.item_id for d in deltas} | {final.output[0].id}) == 1
    # a named function's arguments stream as argument deltas
    events = list(client.responses.create(model="tiny-llama", input="Pick.", tools=[PICK], temperature=0,
                                          tool_choice={"type": "function", "name": "pick"},
                                          max_output_tokens=24, stream=True))
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == events[-3].arguments == events[-1].response.output[0].arguments
    jsonschema.validate(json.loads(arguments), PICK["parameters"])


def test_previous_response_id_continues_the_conversation(server):
    with server.http() as http:
        first = _create(http, input="I am Ana.", instructions="Be brief.")
        second = _create(http, input="Who am I?", previous_response_id=first.id)
        assert second.previous_response_id == first.id
        # the first's input and output precede the new input; its instructions do not carry on
        assert second.usage.input_tokens == _tokens(http, [
            {"role": "user", "content": "I am Ana."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Who am I?"}])
        third = _create(http, input=[], previous_response_id=second.id, store=False)
        assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
        for missing in (third.id, "resp_nope"):  # not stored, or never was: OpenAI's 400
            r = http.post("/v1/responses", json={"input": "x", "previous_response_id": missing})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"
            assert missing in error["message"]


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "web_search"}]),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
    ("input", [{"type": "reasoning", "summary": []}]),
    ("input", [{"type": "function_call", "name": "f", "arguments": "{}"}]),  # no call_id
    ("tool_choice", {"type": "file_search"}),
    ("reasoning", {"effort": "high"}),
    ("background", True),
    ("truncation", "auto"),
    ("include", ["reasoning.encrypted_content"]),
    ("conversation", "conv_1"),
    ("prompt", {"id": "pmpt_1"}),
    ("prompt_cache_key", "k"),
    ("max_tool_calls", 3),
    ("top_logprobs", 5),
    ("text", {"format": {"type": "text"}, "verbosity": "low"}),
    ("stream_options", {"include_obfuscation": True}),
    ("session_end", True),  # without session_id, as the chat endpoint refuses it
    ("tool_choice", "required"),  # without tools
    ("tool_choice", {"type": "function", "name": "nope"}),
])
def test_unsupported_fields_are_refused_naming_them(server, field, value):
    with server.http() as http:
        body = {"input": "x", "max_output_tokens": 4, field: value}
        if field == "input":
            body["input"] = value
        r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error", error
    assert field in error["message"], error


def test_agents_sdk_runs_a_tool_then_a_streamed_structured_answer(server):
    """The Agents SDK's default model (OpenAIResponsesModel): an agent that must call its tool,
    then, streamed, a structured answer continuing that response by previous_response_id."""
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    set_tracing_disabled(True)  # no trace export: nothing leaves the machine
    calls = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add."""
        calls.append((a, b))
        return a + b

    class Verdict(BaseModel):
        ok: bool

    async def run():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        model = OpenAIResponsesModel("tiny-llama", client)
        calc = Agent(name="calc", instructions="Add.", tools=[add], model=model,
                     tool_use_behavior="stop_on_first_tool",
                     model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                  temperature=0, max_tokens=60))
        done = await Runner.run(calc, "1+2?")
        judge = Agent(name="judge", instructions="Judge.", output_type=Verdict, model=model,
                      model_settings=ModelSettings(temperature=0, max_tokens=20))
        # only the tool's output is new: the call and the question come from the stored response
        streamed = Runner.run_streamed(judge, done.to_input_list()[-1:],
                                       previous_response_id=done.last_response_id)
        raw = [e.data async for e in streamed.stream_events() if e.type == "raw_response_event"]
        return done, streamed, raw

    done, streamed, raw = asyncio.run(run())
    assert len(calls) == 1 and done.final_output == str(sum(calls[0]))
    assert isinstance(streamed.final_output, Verdict)
    assert raw[0].type == "response.created" and raw[-1].type == "response.completed"
    assert raw[-1].response.previous_response_id == done.last_response_id
    for e in raw:  # the SDK built them from the stream; they are the client's own types
        EVENTS.validate_python(e.model_dump(by_alias=True))



def test_the_store_keeps_the_recently_used_within_its_bounds():
    from forkjax.server.serving_responses import ResponseStore
    store = ResponseStore(max_responses=2, max_chars=100)
    store.put("a", ["a"], 10)
    store.put("b", ["b"], 10)
    assert store.get("a") == (["a"], 10)  # now the most recently used
    store.put("c", ["c"], 10)
    assert store.get("b") is None and list(store.entries) == ["a", "c"]
    store.put("d", ["d"], 95)  # past the count, then the size: only d stays
    assert list(store.entries) == ["d"] and store.chars == 95


def test_an_error_once_the_stream_began_is_an_error_event():
    """The stream already said 200: an engine error mid-answer is OpenAI's `error` event, and the
    choices are aborted."""
    from forkjax.server.protocol import APIError
    from forkjax.server.protocol_responses import ResponsesRequest
    from forkjax.server.responses_output import OutputBuilder
    from forkjax.server.serving_responses import OpenAIServingResponses, new_response
    from forkjax.server.streaming import Event

    class Gen:
        closed = False

        async def events(self):
            yield Event(0, "ab", [97, 98], None, None)
            raise APIError(400, "the request no longer fits the KV cache")

        def close(self):
            self.closed = True

    async def frames():
        return [f async for f in OpenAIServingResponses(None)._events(
            response, gen, lambda text, final: out.add(text), lambda n, reason: out.finish(False))]

    gen, out = Gen(), OutputBuilder()
    response = new_response(ResponsesRequest.model_validate({"input": "x"}), "tiny-llama")
    events = []
    for frame in asyncio.run(frames()):
        head, data = frame.removesuffix("\n\n").split("\n")
        events.append(EVENTS.validate_python(json.loads(data.removeprefix("data: "))))
        assert head == f"event: {events[-1].type}"
    assert [e.type for e in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1].message == "the request no longer fits the KV cache" and gen.closed
    assert [e.sequence_number for e in events] == list(range(len(events)))
