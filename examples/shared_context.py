"""Two agents read one context: the second's prompt comes from the cache, although its adapter
differs. `extractor` and then `critic` (smollm2-135m's trained agents) each answer a question
about the same staff directory through the `openai` client. Under the server's defaults
(`forkkv` with residual fan-out) the first request also writes the other agents' residual K/V
of the directory, so the second agent's request is a full hit: it computes only its question.
Each answer's `usage.prompt_tokens_details.cached_tokens` says how many prompt tokens came from
the cache.

    python examples/shared_context.py                     # starts `python -m forkjax.serve --model smollm2-135m`
    python examples/shared_context.py --base-url http://127.0.0.1:8000/v1   # one already running
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import openai

from forkjax.workflows import tasks
from forkjax.workflows.local_server import add_server_args, server_url


def ask(client: openai.OpenAI, agent: str, context: str, question: str, max_tokens: int):
    t = time.perf_counter()
    r = client.chat.completions.create(model=agent, messages=[{"role": "user", "content": context + question}],
                                       max_tokens=max_tokens, temperature=0)
    seconds = time.perf_counter() - t
    cached = r.usage.prompt_tokens_details.cached_tokens
    print(f"{agent}: {seconds:.1f} s, {r.usage.prompt_tokens} prompt tokens, {cached} cached | "
          f"{r.choices[0].message.content!r}", flush=True)
    return seconds, cached


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--agents", default="extractor,critic", help="two adapters, in turn")
    p.add_argument("--entries", type=int, default=40, help="directory entries (~27 tokens each)")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--seed", type=int, default=0, help="the directory and the questions")
    args = p.parse_args(argv)
    first, second = args.agents.split(",")
    rng = np.random.default_rng(args.seed)
    records = tasks.directory(rng, args.entries)
    context = tasks.context_text(records)
    with server_url(args.base_url, args.model, []) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key=args.api_key)
        # roles of the trained agents ask their own kind of question; other adapters ask a critic's
        questions = [tasks.task(a if a in tasks.ROLES else "critic", records, rng)[0] for a in (first, second)]
        t1, _ = ask(client, first, context, questions[0], args.max_tokens)
        t2, cached = ask(client, second, context, questions[1], args.max_tokens)
        print(f"=== {second} read {cached} cached prompt tokens: {t1 / t2:.1f}x faster than {first}")


if __name__ == "__main__":
    main()
