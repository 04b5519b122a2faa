"""Three LoRA agents of one base model as the nodes of a LangGraph graph, through
`python -m forkjax.serve` and LangChain's ChatOpenAI (each node's `model` an adapter name).

By default the agents are smollm2-135m's trained ones: `extractor` returns a person's entry
(`with_structured_output`), `critic` checks a claim built from that entry, and `caller` must call
`calculate` (`bind_tools`), which the graph's tool node runs. Every prompt starts with the same
staff directory, so the server keeps its K/V once for all agents. Updates stream as nodes finish.

    python examples/langgraph_agents.py                # starts the server on smollm2-135m itself
    python examples/langgraph_agents.py --base-url http://127.0.0.1:8000/v1   # one already running
                                                       #   (`make serve`)
    python examples/langgraph_agents.py --base-url http://127.0.0.1:8000/v1 --agents planner,coder,critic
                                                       # tiny-llama's random demo agents
                                                       #   (`make serve ARGS="--model tiny-llama"`)

Every answer is constrained (a JSON schema, a named tool call), so even random weights give
well-formed, bounded answers. smollm2's extractor and critic are mostly right; its caller, trained
to write `Action: calculate[a + b]`, calls the tool well-formed but often with other ages.
"""

from __future__ import annotations

import argparse
from typing import TypedDict

import numpy as np
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode

from forkjax.workflows import tasks
from forkjax.workflows.local_server import add_server_args, server_url

from directory_answers import Entry, Verdict, calculate  # examples/directory_answers.py

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "4096", "--warmup", "none"]
calculate = tool(calculate)


class State(TypedDict, total=False):  # what the nodes read and write
    person: str  # the names asked about
    other: str
    entry: Entry
    verdict: Verdict
    messages: list  # the caller's call, then the tool's result


def build(directory: str, agents: list[str], chat) -> StateGraph:
    """extractor -> critic -> caller -> tools; chat(adapter): a ChatOpenAI on it."""
    extractor = chat(agents[0]).with_structured_output(Entry, method="json_schema", strict=True)
    critic = chat(agents[1]).with_structured_output(Verdict, method="json_schema", strict=True)
    caller = chat(agents[2]).bind_tools([calculate], tool_choice="calculate", strict=True)

    def ask(question: str) -> list:  # the directory first: one prefix for every agent
        return [SystemMessage(directory), HumanMessage(question)]

    def extract(s: State) -> State:
        return {"entry": extractor.invoke(ask(f"Return the entry of {s['person']} as JSON."))}

    def check(s: State) -> State:  # the critic checks the extractor's answer
        claim = f"Claim: {s['person']} lives in {s['entry'].city}. Check the claim against the directory."
        return {"verdict": critic.invoke(ask(claim))}

    def call(s: State) -> State:
        question = f"What is the sum of the ages of {s['person']} and {s['other']}? Call the calculator."
        return {"messages": [caller.invoke(ask(question))]}

    graph = StateGraph(State)
    for name, node in zip([*agents, "tools"], [extract, check, call, ToolNode([calculate])]):
        graph.add_node(name, node)
    for a, b in zip([START, *agents, "tools"], [*agents, "tools", END]):
        graph.add_edge(a, b)
    return graph


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--agents", default=",".join(tasks.ROLES),
                   help="the adapters playing extractor, critic and caller")
    p.add_argument("--seed", type=int, default=0, help="the staff directory and the questions")
    p.add_argument("--max-tokens", type=int, default=160)
    args = p.parse_args(argv)
    agents, rng = args.agents.split(","), np.random.default_rng(args.seed)
    records = tasks.directory(rng, 8)
    person, other = (records[i] for i in rng.choice(len(records), 2, replace=False))
    with server_url(args.base_url, args.model, SERVER_ARGS) as base_url:

        def chat(adapter: str) -> ChatOpenAI:
            return ChatOpenAI(model=adapter, base_url=base_url, api_key=args.api_key, temperature=0,
                              max_tokens=args.max_tokens)

        app = build(tasks.context_text(records), agents, chat).compile()
        print(f"=== expected: {person.line()} The sum of the ages: {person.age + other.age}")
        for update in app.stream({"person": person.name, "other": other.name}, stream_mode="updates"):
            (node, out), = update.items()  # one node's update, as it finishes
            if "messages" not in out:
                print(f"[{node}] {(out.get('entry') or out['verdict']).model_dump_json()}")
            elif node == "tools":
                print(f"[{node}] the sum: {out['messages'][-1].content}")
            else:
                print(f"[{node}] calls {out['messages'][-1].tool_calls[0]['args']}")


if __name__ == "__main__":
    main()
