"""An agent loop over `python -m forkjax.serve` through the `openai` client's `tools`: the model
answers a question about a staff directory by calling tools (`lookup_age`, `calculate`), which
run here, and ends with `answer`. Each turn sends the transcript so far (the assistant's
`tool_calls` and a `tool` message with each call's result) and `tool_choice="required"`, so
the server constrains the output to the tools' calls (llguidance) and returns them as
`tool_calls`; `--stream` reassembles them from the stream's deltas.

    python examples/tool_agent.py                     # starts the server on smollm2-135m itself
    python examples/tool_agent.py --base-url http://127.0.0.1:8000/v1   # one already running
    python examples/tool_agent.py --model tiny-llama --max-tokens 300   # random weights:
                                                      #   well-formed calls of noise

smollm2-135m is small: its calls are well-formed (the constraint sees to it), their arguments
often not the right ones.
"""

from __future__ import annotations

import argparse
import json

import openai

from forkjax.workflows.local_server import add_server_args, server_url

AGES = {"Ana Silva": 34, "Ben Novak": 52, "Chen Wei": 47}
QUESTION = "What is the sum of the ages of Ana Silva and Ben Novak?"
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "4096", "--warmup", "none"]


def _function(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties),
                       "additionalProperties": False}}}


TOOLS = [
    _function("lookup_age", "The age of a person in the staff directory",
              {"name": {"type": "string", "maxLength": 40}}),
    _function("calculate", "Evaluate a sum of integers, e.g. 3 + 4",
              {"expression": {"type": "string", "maxLength": 40}}),
    _function("answer", "Give the final answer", {"text": {"type": "string", "maxLength": 80}}),
]


def run_tool(name: str, args: dict) -> str:
    """The tools, run here; arguments arrive as the schema says (the server enforces it)."""
    if name == "lookup_age":
        age = AGES.get(args["name"].strip())
        return str(age) if age is not None else f"no one named {args['name']!r} in the directory"
    if name == "calculate":
        try:
            return str(sum(int(x) for x in args["expression"].split("+")))
        except ValueError:
            return "only sums of integers, e.g. 3 + 4"
    return "done"


def create(client: openai.OpenAI, model: str, messages: list, stream: bool, max_tokens: int) -> dict:
    """One turn -> the assistant message as a dict (its tool calls reassembled when streamed)."""
    kw = dict(model=model, messages=messages, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, temperature=0, max_tokens=max_tokens)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.model_dump(exclude_none=True)
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(d.index, {"id": d.id, "type": "function",
                                              "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += d.function.name or ""
            call["function"]["arguments"] += d.function.arguments or ""
    return {"role": "assistant", "tool_calls": [calls[i] for i in sorted(calls)]}


def agent_loop(client: openai.OpenAI, model: str, turns: int, stream: bool, max_tokens: int) -> str | None:
    messages = [{"role": "system", "content": "Staff directory: " + ", ".join(AGES) + ". Look up each "
                                              "age with lookup_age, add them with calculate, then answer."},
                {"role": "user", "content": QUESTION}]
    for turn in range(1, turns + 1):
        message = create(client, model, messages, stream, max_tokens)
        messages.append(message)
        if not message.get("tool_calls"):  # cut at max_tokens before its call was complete
            print(f"--- turn {turn}: no complete tool call")
            continue
        for call in message["tool_calls"]:
            name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
            result = run_tool(name, args)
            print(f"--- turn {turn}: {name}({json.dumps(args, ensure_ascii=False)}) -> {result}", flush=True)
            if name == "answer":
                return args["text"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true", help="stream each turn, reassembling its tool calls")
    args = p.parse_args(argv)
    with server_url(args.base_url, args.model, SERVER_ARGS) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key=args.api_key)
        answer = agent_loop(client, args.model, args.turns, args.stream, args.max_tokens)
        print(f"=== answer: {answer if answer is not None else '(none within the turns)'} "
              f"(expected {AGES['Ana Silva'] + AGES['Ben Novak']})")


if __name__ == "__main__":
    main()
