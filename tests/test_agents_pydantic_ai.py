"""pydantic-ai against the server (`agents_server`: tiny-llama, random weights) through its
OpenAIChatModel, each model an adapter name: `output_type` parses into its type as an output tool
(pydantic-ai's default) and as NativeOutput (response_format), the latter beside a tool too; a
tool's call validates against its schema and its result goes back; `run_stream` streams outputs
that end at the run's; examples/pydantic_ai_agents.py runs as its docstring says.

Turns are forced where the random weights could loop: `tool_choice` per step (a callable's model
settings), the tool in the first step and the output tool in the second.
"""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.messages import ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from framework_utils import AGES, Entry, Recorder, lookup_age, run_example
from serve_utils import KEY

SETTINGS = {"temperature": 0, "max_tokens": 96, "parallel_tool_calls": False}


@pytest.fixture
def model(agents_server):
    """model(adapter) -> pydantic-ai's chat model on it; `model.rec` records its requests."""
    rec = Recorder()
    client = AsyncOpenAI(base_url=f"{agents_server.url}/v1", api_key=KEY, max_retries=0,
                         http_client=rec.async_client())

    def make(adapter: str) -> OpenAIChatModel:
        return OpenAIChatModel(adapter, provider=OpenAIProvider(openai_client=client))
    make.rec = rec
    return make


def steps(first: list[str], then: list[str] | None):
    """Model settings per step: tool_choice `first` in the run's first model request, `then`
    (None: pydantic-ai's default) after."""
    def settings(ctx):
        choice = first if ctx.run_step <= 1 else then
        return {**SETTINGS, **({"tool_choice": choice} if choice is not None else {})}
    return settings


def tool_results(body: dict) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


@pytest.mark.parametrize("native", [False, True], ids=["output_tool", "native_output"])
def test_output_type(model, native):
    """An output tool (tool_choice required, the `final_result` call) or a JSON-schema
    response_format: either parses into the type."""
    agent = Agent(model("critic"), output_type=NativeOutput(Entry) if native else Entry,
                  instructions="Return the entry.", model_settings=SETTINGS)
    result = asyncio.run(agent.run("Ben?"))
    assert isinstance(result.output, Entry)
    body, = model.rec.bodies
    if native:
        assert body["response_format"]["json_schema"]["schema"]["properties"].keys() == {"name", "age"}
    else:
        assert body["tool_choice"] == "required" and body["tools"][0]["function"]["name"] == "final_result"
        model.rec.check_call("final_result", result.output.model_dump())


def test_tool_result_goes_back(model):
    """Step 1 must call the tool; its result goes back in step 2, which must call the output
    tool: the run ends with its output."""
    agent = Agent(model("coder"), output_type=Entry, instructions="Look up the age, then answer.",
                  model_settings=steps(["lookup_age"], ["final_result"]))
    agent.tool_plain(lookup_age)
    result = asyncio.run(agent.run("How old is Ana?"))
    assert isinstance(result.output, Entry)
    call = next(p for m in result.all_messages() for p in m.parts
                if isinstance(p, ToolCallPart) and p.tool_name == "lookup_age")
    args = model.rec.check_call("lookup_age", call.args)
    assert tool_results(model.rec.bodies[1]) == [str(AGES[args["name"]])]
    assert model.rec.models == model.rec.answered == ["coder", "coder"]


def test_native_output_with_a_tool(model):
    """NativeOutput beside a tool: step 1 must call the tool (its response_format waits for the
    answer), step 2 (tool_choice auto) calls again or answers with JSON of the schema."""
    # planner: with these prompts the random weights answer in step 2
    agent = Agent(model("planner"), output_type=NativeOutput(Entry),
                  instructions="Look up the age, then answer.", model_settings=steps(["lookup_age"], None))
    agent.tool_plain(lookup_age)
    result = asyncio.run(agent.run("How old is Ana?"))
    assert isinstance(result.output, Entry)
    first, second = model.rec.bodies[:2]
    # pydantic-ai forces one tool by sending only it, with tool_choice required
    assert [t["function"]["name"] for t in first["tools"]] == ["lookup_age"]
    assert first["tool_choice"] == "required" and first["response_format"] == second["response_format"]
    assert tool_results(second)[0] in map(str, AGES.values()) and second["tool_choice"] == "auto"


def test_run_stream(model):
    """run_stream through a tool call: the streamed outputs grow into the run's output, and every
    request streamed."""
    agent = Agent(model("coder"), output_type=Entry, instructions="Look up the age, then answer.",
                  model_settings=steps(["lookup_age"], ["final_result"]))
    agent.tool_plain(lookup_age)

    async def run():
        async with agent.run_stream("How old is Ben?") as result:
            outputs = [out async for out in result.stream_output(debounce_by=None)]
            return outputs, await result.get_output()

    outputs, output = asyncio.run(run())
    assert isinstance(output, Entry) and outputs[-1] == output and len(outputs) >= 1
    assert all(b["stream"] for b in model.rec.bodies) and len(model.rec.bodies) == 2


def test_pydantic_ai_example_runs(agents_server):
    out = run_example("pydantic_ai_agents.py", agents_server, "--agents", "planner,coder,critic")
    for agent in ("planner", "coder", "critic"):
        assert f"[{agent}]" in out, out
