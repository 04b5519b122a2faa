"""Three ReAct agents (planner, coder, critic: three LoRA adapters of one base model) taking turns
over one shared context, through `python -m forkjax.serve` and the official `openai` client.

Every turn an agent reads the whole shared transcript and answers with `Thought:` and
`Action: tool[input]` lines; the tool runs here and its `Observation:` joins the transcript that
every agent reads next. The transcript comes first and the agent's cue last, so all agents'
prompts share one long prefix: the server keeps its base K/V once for all of them (ForkKV), which
the hit rates printed at the end show.

    python -m forkjax.serve &          # tiny-llama with the demo adapters planner, coder, critic
    python examples/react_agents.py

tiny-llama's weights are random, so its agents write noise; the loop treats that like any
malformed action (the Observation says so). Serve a real checkpoint with trained adapters
(`--model DIR --lora planner=DIR ...`) for meaningful turns.
"""

from __future__ import annotations

import argparse
import ast
import operator
import os
import re

import httpx
import openai

SYSTEM = """Three agents (planner, coder, critic) share this transcript. On your turn write a
Thought line, then one Action line, then stop:
Action: calculate[expression] | note[text] | finish[answer]"""

TASK = "Task: 3 agents each handle 14 requests a minute. How many per hour in total?"
MAX_TURN_CHARS = 200  # of a turn's text kept in the shared transcript
ACTION = re.compile(r"Action:\s*(\w+)\[(.*?)\]", re.S)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg}


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


def printable(text: str) -> str:
    return "".join(c if (c.isprintable() and c != "\ufffd") or c == "\n" else "?" for c in text)


def hit_rates(base_url: str, api_key: str) -> dict[str, float]:
    """The server's prefix-cache hit rates per pool, from its Prometheus /metrics."""
    root = base_url.rstrip("/").removesuffix("/v1")
    text = httpx.get(f"{root}/metrics", headers={"Authorization": f"Bearer {api_key}"}).text
    return {m[1]: float(m[2]) for m in re.finditer(
        r'^forkjax:prefix_cache_hit_rate\{[^}]*pool="(\w+)"[^}]*\} (\S+)', text, re.M)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    p.add_argument("--agents", default="planner,coder,critic", help="the adapters (models) taking turns")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args(argv)

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    served = {m.id for m in client.models.list()}
    agents = args.agents.split(",")
    missing = [a for a in agents if a not in served]
    if missing:
        p.error(f"the server has no model {missing}; it serves {sorted(served)}")

    transcript, notes, answer = "", [], None
    for turn in range(args.rounds * len(agents)):
        agent = agents[turn % len(agents)]
        try:
            reply = client.chat.completions.create(
                model=agent, temperature=0, max_tokens=args.max_tokens, stop=["\nObservation:"],
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": f"{TASK}\n{transcript}\n{agent}, your turn."}])
        except openai.BadRequestError as e:
            if e.code != "context_length_exceeded":
                raise
            print("=== the shared context is full")
            break
        text = printable(reply.choices[0].message.content or "").strip()[:MAX_TURN_CHARS]
        observation, answer = act(text, notes)
        transcript += f"\n[{agent}]\n{text}\nObservation: {observation}\n"
        print(f"--- turn {turn + 1}: {agent} ({reply.usage.prompt_tokens} prompt tokens)\n"
              f"{text}\nObservation: {observation}", flush=True)
        if answer is not None:
            break
    print(f"=== final answer: {answer if answer is not None else '(none within the turns)'}")
    rates = hit_rates(args.base_url, args.api_key)
    print("=== prefix cache hit rate: " + ", ".join(f"{pool} {rate:.0%}" for pool, rate in rates.items()))


if __name__ == "__main__":
    main()
