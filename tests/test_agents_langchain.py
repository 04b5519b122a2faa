"""LangChain's ChatOpenAI and a LangGraph graph against the server (`agents_server`: tiny-llama,
random weights), each model an adapter name: `bind_tools` calls with arguments that validate
against the tool's schema and its result goes back; `with_structured_output` parses into its type
by `json_schema` (response_format) and by `function_calling` (a named tool); a graph of two
adapters, a tool node between them, streams its messages token by token into the messages it
ends with; examples/langgraph_agents.py runs as its docstring says.
"""

from __future__ import annotations

import operator
from typing import Annotated, TypedDict

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode

from framework_utils import AGES, Entry, Recorder, Verdict, lookup_age, run_example
from serve_utils import KEY


@pytest.fixture
def chat(agents_server):
    """chat(adapter) -> a ChatOpenAI on it, greedy and short; `chat.rec` records its requests."""
    rec = Recorder()

    def make(model: str, **kw) -> ChatOpenAI:
        return ChatOpenAI(model=model, base_url=f"{agents_server.url}/v1", api_key=KEY, temperature=0,
                          max_tokens=64, max_retries=0, http_client=rec.client(),
                          http_async_client=rec.async_client(), **kw)
    make.rec = rec
    return make


def test_bind_tools_call_and_result(chat):
    """A named tool choice: the call validates against the tool's schema; its result goes back as
    a tool message, and the next turn answers (text: noise, cut by max_tokens)."""
    llm = chat("coder")
    messages = [HumanMessage("How old is Ana?")]
    ai = llm.bind_tools([lookup_age], tool_choice="lookup_age", parallel_tool_calls=False,
                                strict=True).invoke(messages)
    assert isinstance(ai, AIMessage) and [c["name"] for c in ai.tool_calls] == ["lookup_age"]
    args = chat.rec.check_call("lookup_age", ai.tool_calls[0]["args"])
    assert ai.response_metadata["finish_reason"] == "tool_calls"
    messages += [ai, ToolMessage(str(lookup_age(**args)), tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.invoke(messages)
    assert isinstance(final.content, str) and final.response_metadata["model_name"] == "coder"
    sent = chat.rec.bodies[-1]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == ai.tool_calls[0]["id"]
    assert sent[2] == {"role": "tool", "tool_call_id": ai.tool_calls[0]["id"],
                       "content": str(AGES[args["name"]])}


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(chat, method):
    """Both ways of structured output parse into the declared type: a JSON-schema response_format,
    or a call of a tool shaped like the type that the request names."""
    llm = chat("critic").with_structured_output(Entry, method=method, include_raw=True, strict=True)
    out = llm.invoke("Return Ben's entry.")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Entry)
    body = chat.rec.bodies[0]
    if method == "json_schema":
        assert body["response_format"]["type"] == "json_schema" and "tools" not in body
    else:
        assert body["tool_choice"]["function"]["name"] == "Entry" and "response_format" not in body
        chat.rec.check_call("Entry", out["raw"].tool_calls[0]["args"])


class State(TypedDict):
    messages: Annotated[list, operator.add]
    verdict: Verdict | None


# langchain-openai model_dump()s the openai client's structured-output stream events, whose
# `parsed` field the client types as None: pydantic warns on the client's side
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
def test_two_adapter_graph_streams(chat):
    """planner (must call the tool) -> the tool node -> critic (a Verdict): two adapters reading one
    conversation. `.stream()` in "messages" mode gives each model's tokens as they come: they
    assemble into the messages the nodes return."""
    planner = chat("planner").bind_tools([lookup_age], tool_choice="lookup_age", parallel_tool_calls=False,
                                strict=True)
    critic = chat("critic").with_structured_output(Verdict, method="json_schema", strict=True)

    def plan(state):
        return {"messages": [planner.invoke(state["messages"])]}

    def check(state):
        return {"verdict": critic.invoke(state["messages"] + [HumanMessage("Is Ana 34? yes or no")])}

    graph = StateGraph(State)
    graph.add_node("planner", plan)
    graph.add_node("tools", ToolNode([lookup_age]))
    graph.add_node("critic", check)
    graph.add_edge(START, "planner")
    graph.add_edge("planner", "tools")
    graph.add_edge("tools", "critic")
    graph.add_edge("critic", END)
    app = graph.compile()

    chunks: dict[str, list] = {}
    updates = []
    for mode, data in app.stream({"messages": [HumanMessage("How old is Ana?")], "verdict": None},
                                 stream_mode=["messages", "updates"]):
        if mode == "messages" and isinstance(data[0], AIMessageChunk):
            chunks.setdefault(data[1]["langgraph_node"], []).append(data[0])
        elif mode == "updates":
            updates.append(next(iter(data)))
    assert updates == ["planner", "tools", "critic"]
    assert chat.rec.models == ["planner", "critic"] and all(b["stream"] for b in chat.rec.bodies)
    planned = sum(chunks["planner"][1:], chunks["planner"][0])  # the chunks add up to the message
    call = planned.tool_calls[0]
    assert call["name"] == "lookup_age" and chat.rec.check_call("lookup_age", call["args"])
    assert planned.response_metadata["model_name"] == "planner"
    critic_text = "".join(c.content for c in chunks["critic"])
    assert Verdict.model_validate_json(critic_text).verdict in ("yes", "no") and len(chunks["critic"]) > 1
    sent = chat.rec.bodies[1]["messages"]
    assert sent[2]["role"] == "tool" and sent[2]["content"] == str(AGES[call["args"]["name"]])


def test_langgraph_example_runs(agents_server):
    out = run_example("langgraph_agents.py", agents_server, "--agents", "planner,coder,critic")
    for agent in ("planner", "coder", "critic"):
        assert f"[{agent}]" in out, out
