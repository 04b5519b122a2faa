"""Three LoRA agents of one base model taking turns over one shared context, through
`python -m forkjax.serve` and the official `openai` client.

By default the agents are smollm2-135m's trained ones (SmolLM2-135M-Instruct with `extractor`,
`critic` and `caller`, scripts/train_agents.py): they read one staff directory and, in turn,
return an entry as JSON, check a claim, and call the calculator (the tool runs here). Every
agent also reads the turns before its own: the directory and the transcript come first and the
agent's question last, so all prompts share one long prefix, and the server keeps its base K/V
once for all agents (ForkKV), which the hit rates printed at the end show.

    python examples/react_agents.py                    # starts the server on smollm2-135m itself
    python examples/react_agents.py --base-url http://127.0.0.1:8000/v1   # one already running
                                                       #   (`make serve`)
    python examples/react_agents.py --tiny-llama       # tiny-llama's demo agents

`--tiny-llama` runs a planner, a coder and a critic with `Thought:` / `Action: tool[input]`
turns on tiny-llama, whose weights and demo adapters are random: its agents write noise, which
the loop treats like any malformed action (the Observation says so).
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import re

import httpx
import numpy as np
import openai

from forkjax.workflows import tasks
from forkjax.workflows.local_server import server_url

# tiny-llama's demo agents: a generic ReAct loop until one calls finish[...]
SYSTEM = """Three agents (planner, coder, critic) share this transcript. On your turn write a
Thought line, then one Action line, then stop:
Action: calculate[expression] | note[text] | finish[answer]"""
TASK = "Task: 3 agents each handle 14 requests a minute. How many per hour in total?"

MAX_TURN_CHARS = 200  # of a turn's text kept in the shared transcript
ACTION = re.compile(r"Action:\s*(\w+)\[(.*?)\]", re.S)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg}
# A server this example starts: float32 (the agents were trained in it), the prompts' short
# context, and only the step programs the turns need compiled.
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--warmup", "none"]


def calculate(expr: str) -> str:
    """Arithmetic only: the model's text is never `eval`ed."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 64:
                raise ValueError("exponent too large")
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")
    try:
        return str(ev(ast.parse(expr, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"


def act(text: str, notes: list[str]) -> tuple[str, str | None]:
    """Run the agent's action -> (observation, final answer or None)."""
    m = ACTION.search(text)
    if m is None:
        return "no valid Action line; use calculate[...], note[...] or finish[...]", None
    tool, arg = m[1].lower(), m[2].strip()
    if tool == "calculate":
        return calculate(arg), None
    if tool == "note":
        notes.append(arg)
        return f"noted ({len(notes)} notes)", None
    if tool == "finish":
        return "done", arg
    return f"unknown tool {tool!r}", None


def observe(role: str, text: str) -> str:
    """A trained agent's answer, read: the caller's calculation run, the extractor's JSON parsed,
    the critic's verdict taken."""
    if ACTION.search(text):
        return act(text, [])[0]
    if role == "extractor":
        try:
            entry = json.loads(text)
            return f"entry of {entry['name']}: age {entry['age']}, {entry['city']}, {entry['job']}"
        except (ValueError, TypeError, KeyError):
            return "not a JSON entry with keys name, age, city, job"
    verdicts = re.findall(r"\b(yes|no)\b", text.lower())
    return f"verdict: {verdicts[-1]}" if verdicts else "no yes/no verdict"


def printable(text: str) -> str:
    return "".join(c if (c.isprintable() and c != "\ufffd") or c == "\n" else "?" for c in text)


def hit_rates(base_url: str, api_key: str) -> dict[str, float]:
    """The server's prefix-cache hit rates per pool, from its Prometheus /metrics."""
    root = base_url.rstrip("/").removesuffix("/v1")
    text = httpx.get(f"{root}/metrics", headers={"Authorization": f"Bearer {api_key}"}).text
    return {m[1]: float(m[2]) for m in re.finditer(
        r'^forkjax:prefix_cache_hit_rate\{[^}]*pool="(\w+)"[^}]*\} (\S+)', text, re.M)}


def trained_turns(rounds: int, seed: int):
    """(agent, its messages given the transcript so far, expected answer) a turn: each trained
    role in turn asks its own kind of question (forkjax/workflows/tasks.py) about one staff
    directory, which every prompt starts with."""
    rng = np.random.default_rng(seed)
    records = tasks.directory(rng, 8)
    directory = tasks.context_text(records)
    for _ in range(rounds):
        for role in tasks.ROLES:
            question, expected = tasks.task(role, records, rng)
            yield role, lambda transcript, q=question: [
                {"role": "user", "content": directory + transcript + q}], expected


def demo_turns(rounds: int, agents: list[str]):
    """(agent, messages, None) a turn: `agents` in turn on TASK, until one calls finish[...]."""
    for turn in range(rounds * len(agents)):
        agent = agents[turn % len(agents)]
        yield agent, lambda transcript, a=agent: [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{TASK}\n{transcript}\n{a}, your turn."}], None


def run(client: openai.OpenAI, turns, max_tokens: int) -> None:
    """Each turn: the agent answers the shared transcript, its answer is acted on, and the
    answer and the Observation join the transcript."""
    transcript, notes, answer, right = "", [], None, []
    for turn, (agent, messages, expected) in enumerate(turns, 1):
        try:
            reply = client.chat.completions.create(
                model=agent, temperature=0, max_tokens=max_tokens, stop=["\nObservation:"],
                messages=messages(transcript))
        except openai.BadRequestError as e:
            if e.code != "context_length_exceeded":
                raise
            print("=== the shared context is full")
            break
        text = printable(reply.choices[0].message.content or "").strip()[:MAX_TURN_CHARS]
        if expected is None:
            observation, answer = act(text, notes)
        else:
            observation = observe(agent, text)
            right.append(tasks.correct(agent, text, expected))
            observation += f" ({'right' if right[-1] else 'expected: ' + expected})"
        transcript += f"[{agent}]\n{text}\nObservation: {observation}\n\n"
        print(f"--- turn {turn}: {agent} ({reply.usage.prompt_tokens} prompt tokens)\n"
              f"{text}\nObservation: {observation}", flush=True)
        if answer is not None:
            break
    if right:
        print(f"=== right answers: {sum(right)} of {len(right)}")
    else:
        print(f"=== final answer: {answer if answer is not None else '(none within the turns)'}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"),
                   help="a running server's /v1 URL (default: start one for the model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    p.add_argument("--tiny-llama", action="store_true",
                   help="tiny-llama's random demo agents instead of smollm2-135m's trained ones")
    p.add_argument("--agents", default="planner,coder,critic",
                   help="with --tiny-llama: the adapters (models) taking turns")
    p.add_argument("--rounds", type=int, default=2, help="turns of each agent")
    p.add_argument("--seed", type=int, default=0, help="the staff directory and the questions")
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args(argv)
    model = "tiny-llama" if args.tiny_llama else "smollm2-135m"
    agents = args.agents.split(",") if args.tiny_llama else list(tasks.ROLES)

    with server_url(args.base_url, model, SERVER_ARGS) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key=args.api_key)
        served = {m.id for m in client.models.list()}
        if missing := [a for a in agents if a not in served]:
            p.error(f"the server has no model {missing}; it serves {sorted(served)}"
                    + ("" if args.tiny_llama else " (--tiny-llama for tiny-llama's demo agents)"))
        turns = (demo_turns(args.rounds, agents) if args.tiny_llama
                 else trained_turns(args.rounds, args.seed))
        run(client, turns, args.max_tokens)
        rates = hit_rates(base_url, args.api_key)
        print("=== prefix cache hit rate: " + ", ".join(f"{pool} {rate:.0%}" for pool, rate in rates.items()))


if __name__ == "__main__":
    main()
