"""Three agents of the OpenAI Agents SDK, each a LoRA adapter of one base model, on one staff
directory, through `python -m forkjax.serve` and the SDK's default model (the Responses API).

By default the agents are smollm2-135m's trained ones (`extractor`, `critic`, `caller`): the
extractor returns a person's entry (`output_type`: the SDK parses it), the critic checks a claim
built from that entry, and the caller must call the `calculate` tool, which runs here and whose
result ends its run. Every agent's instructions start with the same directory, so the server keeps
its K/V once for all of them.

    python examples/agents_sdk.py                      # starts the server on smollm2-135m itself
    python examples/agents_sdk.py --base-url http://127.0.0.1:8000/v1   # one already running
                                                       #   (`make serve`)
    python examples/agents_sdk.py --base-url http://127.0.0.1:8000/v1 --agents planner,coder,critic
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
from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_client,
                    set_tracing_disabled)
from openai import AsyncOpenAI

from forkjax.workflows import tasks
from forkjax.workflows.local_server import add_server_args, server_url

from directory_answers import Entry, Verdict, calculate  # examples/directory_answers.py

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "4096", "--warmup", "none"]
calculate = function_tool(calculate)


async def run(agents: list[str], seed: int, max_tokens: int) -> None:
    rng = np.random.default_rng(seed)
    records = tasks.directory(rng, 8)
    directory = tasks.context_text(records)
    settings = ModelSettings(temperature=0, max_tokens=max_tokens)
    extractor = Agent(name=agents[0], model=agents[0], output_type=Entry, model_settings=settings,
                      instructions=directory + "Return the entry the user asks for.")
    critic = Agent(name=agents[1], model=agents[1], output_type=Verdict, model_settings=settings,
                   instructions=directory + "Check the user's claim against the directory.")
    # the caller's turn is its call of calculate (named: the output is its arguments), whose result
    # is the run's output
    caller = Agent(name=agents[2], model=agents[2], tools=[calculate], tool_use_behavior="stop_on_first_tool",
                   instructions=directory,
                   model_settings=ModelSettings(temperature=0, max_tokens=max_tokens, tool_choice="calculate",
                                                parallel_tool_calls=False))

    person, other = (records[i] for i in rng.choice(len(records), 2, replace=False))
    entry = (await Runner.run(extractor, f"Return the entry of {person.name} as JSON.")).final_output
    print(f"[{extractor.name}] {entry.model_dump_json()}\n  expected: {person.line()}")
    # the critic checks the extractor's answer
    claim = f"Claim: {person.name} lives in {entry.city}. Check the claim against the directory."
    verdict = (await Runner.run(critic, claim)).final_output
    print(f"[{critic.name}] {person.name} lives in {entry.city}? {verdict.model_dump_json()}\n"
          f"  expected: {person.city}, {'yes' if entry.city == person.city else 'no'}")
    question = f"What is the sum of the ages of {person.name} and {other.name}? Call the calculator."
    total = (await Runner.run(caller, question)).final_output
    print(f"[{caller.name}] the ages of {person.name} and {other.name}: {total}\n"
          f"  expected: {person.age + other.age}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--agents", default=",".join(tasks.ROLES),
                   help="the adapters playing extractor, critic and caller")
    p.add_argument("--seed", type=int, default=0, help="the staff directory and the questions")
    p.add_argument("--max-tokens", type=int, default=160)
    args = p.parse_args(argv)
    set_tracing_disabled(True)  # traces would go to OpenAI's platform
    with server_url(args.base_url, args.model, SERVER_ARGS) as base_url:
        # every Agent's `model` (an adapter name) goes to this server, by the Responses API
        set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key=args.api_key), use_for_tracing=False)
        asyncio.run(run(args.agents.split(","), args.seed, args.max_tokens))


if __name__ == "__main__":
    main()
