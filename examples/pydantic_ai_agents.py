"""Three pydantic-ai agents, each a LoRA adapter of one base model, on one staff directory, through
`python -m forkjax.serve` and pydantic-ai's OpenAIChatModel (its model name: the adapter).

By default the agents are smollm2-135m's trained ones. The extractor returns a person's entry
(`NativeOutput`: JSON of the schema); the critic takes over its conversation (a programmatic
hand-off: `message_history`) and checks a claim built from that entry; the caller's output is a
function, `calculate`: the model must call it, and what it returns is the run's output. Every
agent's instructions are the same directory, so the server keeps its K/V once for all of them.

    python examples/pydantic_ai_agents.py              # starts the server on smollm2-135m itself
    python examples/pydantic_ai_agents.py --base-url http://127.0.0.1:8000/v1   # one already running
                                                       #   (`make serve`)
    python examples/pydantic_ai_agents.py --base-url http://127.0.0.1:8000/v1 --agents planner,coder,critic
                                                       # tiny-llama's random demo agents
                                                       #   (`make serve ARGS="--model tiny-llama"`)

Every answer is constrained (a JSON schema, a required tool call), so even random weights give
well-formed, bounded answers. smollm2's extractor and critic are mostly right; its caller, trained
to write `Action: calculate[a + b]`, calls the tool well-formed but often with other ages.
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
from openai import AsyncOpenAI
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from forkjax.workflows import tasks
from forkjax.workflows.local_server import add_server_args, server_url

from directory_answers import Entry, Verdict, calculate  # examples/directory_answers.py

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "4096", "--warmup", "none"]


async def run(client: AsyncOpenAI, agents: list[str], seed: int, max_tokens: int) -> None:
    rng = np.random.default_rng(seed)
    records = tasks.directory(rng, 8)
    directory = tasks.context_text(records)
    settings = {"temperature": 0, "max_tokens": max_tokens, "parallel_tool_calls": False}

    def model(adapter: str) -> OpenAIChatModel:
        return OpenAIChatModel(adapter, provider=OpenAIProvider(openai_client=client))

    extractor = Agent(model(agents[0]), output_type=NativeOutput(Entry), instructions=directory,
                      model_settings=settings)
    critic = Agent(model(agents[1]), output_type=NativeOutput(Verdict), instructions=directory,
                   model_settings=settings)
    caller = Agent(model(agents[2]), output_type=calculate, instructions=directory, model_settings=settings)

    person, other = (records[i] for i in rng.choice(len(records), 2, replace=False))
    extracted = await extractor.run(f"Return the entry of {person.name} as JSON.")
    entry = extracted.output
    print(f"[{agents[0]}] {entry.model_dump_json()}\n  expected: {person.line()}")
    # the hand-off: the critic goes on from the extractor's conversation, its answer included
    claim = f"Claim: {person.name} lives in {entry.city}. Check the claim against the directory."
    verdict = (await critic.run(claim, message_history=extracted.all_messages())).output
    print(f"[{agents[1]}] {person.name} lives in {entry.city}? {verdict.model_dump_json()}\n"
          f"  expected: {person.city}, {'yes' if entry.city == person.city else 'no'}")
    question = f"What is the sum of the ages of {person.name} and {other.name}? Call the calculator."
    total = (await caller.run(question)).output
    print(f"[{agents[2]}] the ages of {person.name} and {other.name}: {total}\n"
          f"  expected: {person.age + other.age}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--agents", default=",".join(tasks.ROLES),
                   help="the adapters playing extractor, critic and caller")
    p.add_argument("--seed", type=int, default=0, help="the staff directory and the questions")
    p.add_argument("--max-tokens", type=int, default=160)
    args = p.parse_args(argv)
    with server_url(args.base_url, args.model, SERVER_ARGS) as base_url:
        client = AsyncOpenAI(base_url=base_url, api_key=args.api_key)
        asyncio.run(run(client, args.agents.split(","), args.seed, args.max_tokens))


if __name__ == "__main__":
    main()
