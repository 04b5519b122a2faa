"""The OpenAI Agents SDK against the server (`agents_server`: tiny-llama, random weights), through
both of its OpenAI models: the default one on /v1/responses and OpenAIChatCompletionsModel on
/v1/chat/completions. Each agent's model is an adapter name. A function tool's call validates
against its schema and its result goes back; a handoff moves the run to another adapter;
`output_type` beside tools parses into its type; a streamed run's events assemble into its result;
examples/agents_sdk.py runs as its docstring says.

Every turn is constrained (framework_utils.py): the Responses model ends a run with an error on a
turn cut by max_tokens (status "incomplete"), which noise would otherwise always be.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from agents import (Agent, ModelSettings, RunConfig, Runner, ToolCallItem, ToolCallOutputItem,
                    function_tool, set_tracing_disabled)
from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
from agents.models.openai_provider import OpenAIProvider
from agents.models.openai_responses import OpenAIResponsesModel
from openai import AsyncOpenAI
from openai.types.responses import ResponseFunctionCallArgumentsDeltaEvent, ResponseTextDeltaEvent

from framework_utils import AGES, Entry, Recorder, Verdict, lookup_age, run_example
from serve_utils import KEY

set_tracing_disabled(True)  # no traces exported (no network here)
# parallel_tool_calls=False: one call a turn, so a `required` turn ends after it
SETTINGS = dict(temperature=0, max_tokens=96, parallel_tool_calls=False)


@pytest.fixture(params=["responses", "chat_completions"])
def sdk(request, agents_server):
    """(the RunConfig whose provider maps a model name to the SDK's Responses model, its default,
    or to OpenAIChatCompletionsModel; the Recorder of its requests)."""
    rec = Recorder()
    client = AsyncOpenAI(base_url=f"{agents_server.url}/v1", api_key=KEY, max_retries=0,
                         http_client=rec.async_client())
    provider = OpenAIProvider(openai_client=client, use_responses=request.param == "responses")
    kind = OpenAIResponsesModel if request.param == "responses" else OpenAIChatCompletionsModel
    assert isinstance(provider.get_model("planner"), kind)
    return RunConfig(model_provider=provider, tracing_disabled=True), rec


def output_schema(body: dict) -> dict | None:
    """The JSON schema a request constrains its final message to (chat's response_format,
    Responses' text.format)."""
    fmt = body.get("response_format") or body.get("text", {}).get("format") or {}
    return (fmt.get("json_schema") or fmt).get("schema")


def tool_outputs(body: dict) -> list[tuple[str, str]]:
    """(call id, output) of each tool result a request sends back (chat's `tool` messages,
    Responses' function_call_output items)."""
    return ([(m["tool_call_id"], m["content"]) for m in body.get("messages", ()) if m["role"] == "tool"]
            + [(i["call_id"], i["output"]) for i in body.get("input", ())
               if isinstance(i, dict) and i.get("type") == "function_call_output"])


def test_function_tool_and_output_type(sdk):
    """Turn 1 must call the tool (tool_choice required; the output schema rides along); its
    result goes back in turn 2, where the SDK resets tool_choice to auto: the model may call
    again or answer, and answers with JSON that parses into `output_type`."""
    config, rec = sdk
    # planner: with these prompts the random weights answer in turn 2 (coder keeps calling the
    # tool, which max_turns would end)
    agent = Agent(name="directory", instructions="Look up the age, then answer.", model="planner",
                  tools=[function_tool(lookup_age)], output_type=Entry,
                  model_settings=ModelSettings(tool_choice="required", **SETTINGS))
    result = asyncio.run(Runner.run(agent, "How old is Ana?", run_config=config, max_turns=4))
    assert isinstance(result.final_output, Entry)
    call = next(i.raw_item for i in result.new_items if isinstance(i, ToolCallItem))
    assert call.name == "lookup_age"
    args = rec.check_call("lookup_age", call.arguments)
    output = next(i for i in result.new_items if isinstance(i, ToolCallOutputItem))
    assert output.output == AGES[args["name"]]
    first, second = rec.bodies[0], rec.bodies[1]
    assert first["tool_choice"] == "required" and output_schema(first) == output_schema(second)
    assert output_schema(first)["properties"].keys() == {"name", "age"}
    assert tool_outputs(second) == [(call.call_id, str(AGES[args["name"]]))]
    assert "tool_choice" not in second and second["tools"] == first["tools"]
    assert rec.answered == ["planner"] * len(rec.bodies)


def test_handoff_switches_the_adapter(sdk):
    """The planner must hand off (a named tool choice of the handoff's tool); the critic, another
    adapter of the same base model, answers with a Verdict, reading the same conversation."""
    config, rec = sdk
    critic = Agent(name="critic", instructions="Check the claim: yes or no.", model="critic",
                   output_type=Verdict, model_settings=ModelSettings(**SETTINGS))
    planner = Agent(name="planner", instructions="Hand claims to the critic.", model="planner",
                    handoffs=[critic],
                    model_settings=ModelSettings(tool_choice="transfer_to_critic", **SETTINGS))
    result = asyncio.run(Runner.run(planner, "Claim: Ana is 34.", run_config=config, max_turns=3))
    assert result.last_agent is critic and isinstance(result.final_output, Verdict)
    assert rec.models == rec.answered == ["planner", "critic"]
    assert [t.get("function", t)["name"] for t in rec.bodies[0]["tools"]] == ["transfer_to_critic"]
    assert len(tool_outputs(rec.bodies[1])) == 1  # the handoff's call, answered, in the critic's input


def test_streamed_run_assembles_its_result(sdk):
    """A streamed run: the call's argument deltas assemble into the call that ran, the text
    deltas into the final output, and run items come in order."""
    config, rec = sdk
    agent = Agent(name="directory", instructions="Look up the age, then answer.", model="planner",
                  tools=[function_tool(lookup_age)], output_type=Entry,
                  model_settings=ModelSettings(tool_choice="lookup_age", **SETTINGS))

    async def run():
        result = Runner.run_streamed(agent, "How old is Ben?", run_config=config, max_turns=4)
        arguments, text, items = [], [], []
        async for event in result.stream_events():
            if event.type == "raw_response_event":
                if isinstance(event.data, ResponseFunctionCallArgumentsDeltaEvent):
                    arguments.append(event.data.delta)
                elif isinstance(event.data, ResponseTextDeltaEvent):
                    text.append(event.data.delta)
            elif event.type == "run_item_stream_event":
                items.append(event.name)
        return result, "".join(arguments), "".join(text), items

    result, arguments, text, items = asyncio.run(run())
    call = next(i.raw_item for i in result.new_items if isinstance(i, ToolCallItem))
    assert json.loads(arguments) == json.loads(call.arguments) == rec.check_call("lookup_age", arguments)
    assert items[:2] == ["tool_called", "tool_output"] and items[-1] == "message_output_created"
    assert isinstance(result.final_output, Entry) and Entry.model_validate_json(text) == result.final_output
    assert all(b["stream"] for b in rec.bodies) and len(text) > 1


def test_agents_sdk_example_runs(agents_server):
    out = run_example("agents_sdk.py", agents_server, "--agents", "planner,coder,critic")
    for agent in ("planner", "coder", "critic"):
        assert f"[{agent}]" in out, out
