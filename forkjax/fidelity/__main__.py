"""`python -m forkjax.fidelity`: how far each cache policy moves your own agents' outputs.

    python -m forkjax.fidelity --model smollm2-135m --lora critic=DIR --lora extractor=DIR \\
        --prompts tasks.jsonl --out /tmp/fidelity

Reads the tasks (forkjax/fidelity/tasks.py says the JSONL), runs exact (each task alone) and
every policy as served (runner.py), and compares them task by task (metrics.py): a table on
stdout, DIR/fidelity.json (per policy `kl`, `top1`, `greedy_agreement`, `accuracy`,
`layer_cosine`, each with `<name>_ci`, its 95% bootstrap interval, and `accuracy_vs_prefix`, the
paired difference; `per_task`, each policy's rows by task line, for summaries of subsets:
`metrics.summarize`), DIR/fidelity.png and DIR/layer_cosine.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tqdm import tqdm

import forkjax
from forkjax.engine.loading import describe_model, read_adapters
from forkjax.fidelity.metrics import paired_difference, per_task, summarize
from forkjax.fidelity.plots import plot
from forkjax.fidelity.runner import SLACK_TOKENS, run_policy, targets_of
from forkjax.fidelity.tasks import load_tasks
from forkjax.sizes import size_flag

POLICIES = ("prefix", "forkkv", "forkkv+fanout", "full_reuse", "lrshared", "base")
# Served unless --policies says otherwise; lrshared assumes agents trained with one shared A.
DEFAULT_POLICIES = ("prefix", "forkkv", "forkkv+fanout", "full_reuse", "base")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m forkjax.fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory, .gguf file or built-in name")
    ap.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                    help="a PEFT adapter directory (repeat for each agent)")
    ap.add_argument("--prompts", required=True, help="JSONL, one task a line (tasks.py)")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                    help=f"comma-separated among {', '.join(POLICIES)} (prefix always runs)")
    ap.add_argument("--dtype", default="float32", help="float32 (default: the policies' own "
                    "differences) or bfloat16 (as served)")
    ap.add_argument("--max-new-tokens", type=int, default=16,
                    help="positions compared on tasks without an answer (exact's greedy continuation)")
    ap.add_argument("--lora-scale", type=float, default=1.0,
                    help="multiplies every adapter's B, so its effect (the adapter-strength curve)")
    ap.add_argument("--kv-cache-bytes", type=size_flag, default=None,
                    help="KV budget, e.g. 16GB or 16G (the engine's default)")
    ap.add_argument("--seed", type=int, default=0, help="of the bootstrap resamples")
    ap.add_argument("--out", default="fidelity_out")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    adapters = {}
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            ap.error(f"--lora {spec!r}: expected NAME=DIR")
        if name in adapters:
            ap.error(f"--lora {name}: given twice")
        adapters[name] = path
    if not adapters:
        ap.error("--lora: give at least one adapter (NAME=DIR)")
    args.adapters = adapters
    policies = [p for p in args.policies.split(",") if p]
    if bad := [p for p in policies if p not in POLICIES]:
        ap.error(f"--policies: unknown {', '.join(bad)}; expected names among {', '.join(POLICIES)}")
    args.policies = ["prefix", *[p for p in dict.fromkeys(policies) if p != "prefix"]]
    if not 0 <= args.lora_scale < float("inf"):
        ap.error(f"--lora-scale {args.lora_scale}: a finite factor >= 0")
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens: at least 1")
    return args


def build_engine(args, policy: str, max_len: int):
    cache = "prefix" if policy in ("exact", "prefix", "base") else policy.removesuffix("+fanout")
    kw = {} if args.kv_cache_bytes is None else {"kv_cache_bytes": args.kv_cache_bytes}
    return forkjax.Engine.from_pretrained(
        args.model, adapters=args.adapters, cache_policy=cache, dtype=args.dtype,
        residual_fanout=policy == "forkkv+fanout", max_model_len=max_len, warmup=False,
        progress=False, **kw)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    model_cfg, tokenizer, _ = describe_model(args.model)  # no weights read yet
    adapters = read_adapters(args.adapters, model_cfg)  # a wrong adapter dir fails here
    tasks = load_tasks(args.prompts, tokenizer, args.adapters)
    longest = max(len(t.prompt) + (len(t.answer) + SLACK_TOKENS if t.answer else args.max_new_tokens)
                  for t in tasks)
    if longest > model_cfg.max_position_embeddings:
        raise ValueError(f"{args.prompts}: a task needs {longest} tokens, past the model's "
                         f"{model_cfg.max_position_embeddings}")
    args.adapters = {a.name: a.scaled(args.lora_scale) if args.lora_scale != 1.0 else a for a in adapters}
    # Every engine sized to the longest task: equal shapes, so they share compiled programs, and
    # page tables only as wide as the tasks need (the model's whole context would make every
    # step attend over it: ten times slower on the CPU for SmolLM2's 8k and tasks of 600 tokens).
    exact_engine = build_engine(args, "exact", longest)
    bar = tqdm(total=len(tasks) * (len(args.policies) + 1), unit="task", disable=args.no_progress)
    bar.set_description("exact")
    exact = run_policy(exact_engine, "exact", tasks, args.max_new_tokens, progress=bar)
    targets = targets_of(tasks, exact)
    runs = {}
    for policy in args.policies:
        bar.set_description(policy)
        engine = exact_engine if policy in ("prefix", "base") else build_engine(args, policy, longest)
        runs[policy] = run_policy(engine, policy, tasks, args.max_new_tokens, targets, progress=bar)
        if engine is not exact_engine:
            engine.close()
    bar.close()
    result = dict(model=args.model, adapters={n: getattr(a, "source", a) for n, a in args.adapters.items()},
                  lora_scale=args.lora_scale, prompts=args.prompts, dtype=args.dtype,
                  tasks=len(tasks), scored_tasks=sum(t.scored for t in tasks),
                  command=" ".join(["python -m forkjax.fidelity", *(argv or sys.argv[1:])]),
                  exact_accuracy=mean_or_none([e["correct"] for e in exact if e["correct"] is not None]),
                  policies={})
    result["per_task"] = {}
    for policy, r in runs.items():
        rows = [per_task(a, e) for a, e in zip(r, exact)]
        result["policies"][policy] = dict(summarize(rows, args.seed),
                                          accuracy_vs_prefix=paired_difference(r, runs["prefix"], args.seed))
        result["per_task"][policy] = [dict(row, line=t.line, layer_cosine=row["layer_cosine"].tolist())
                                      for t, row in zip(tasks, rows)]
    result["seconds"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fidelity.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out)
    print(table(result))
    return result


def mean_or_none(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def table(result: dict) -> str:
    """The policies' metrics with their intervals, one row each."""
    fmt = lambda v, ci, p=3: "—" if v is None else f"{v:.{p}f} [{ci[0]:.{p}f}, {ci[1]:.{p}f}]"  # noqa: E731
    lines = [f"{result['tasks']} tasks ({result['scored_tasks']} with an answer), exact accuracy "
             f"{'—' if result['exact_accuracy'] is None else format(result['exact_accuracy'], '.3f')}",
             f"{'policy':14s} {'KL':>26s} {'top-1':>23s} {'greedy':>23s} {'accuracy':>23s} last-layer cos"]
    for name, m in result["policies"].items():
        lines.append(f"{name:14s} {fmt(m['kl'], m['kl_ci'], 5):>26s} {fmt(m['top1'], m['top1_ci']):>23s} "
                     f"{fmt(m['greedy_agreement'], m['greedy_agreement_ci']):>23s} "
                     f"{fmt(m['accuracy'], m['accuracy_ci']):>23s} {m['layer_cosine'][-1]:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:  # a bad task file or adapter: the message names it
        sys.exit(f"forkjax.fidelity: {e}")
