"""`python -m forkjax.fidelity.merge DIR DIR ... --out DIR`: several fidelity runs of one model and
set of agents (other task files: more tasks, narrower intervals) as one result.

Every policy that all the runs served is summarized over all their tasks (metrics.summarize on
the per-task rows), with its paired accuracy difference to `prefix` and, under
`accuracy_differences`, to every other such policy; policies some runs lack are left out, named
on stdout. Writes DIR/fidelity.json (`python -m forkjax.fidelity`'s schema, `runs` naming the
merged ones) and its plots, and prints the table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

from forkjax.fidelity.__main__ import table
from forkjax.fidelity.metrics import paired_difference, summarize
from forkjax.fidelity.plots import plot

SAME = ("model", "adapters", "lora_scale", "dtype")  # what the merged runs must share


def merge(results: list[dict], seed: int = 0) -> dict:
    """fidelity.json contents -> one result over all their tasks."""
    first = results[0]
    for key in SAME:
        if any(r[key] != first[key] for r in results[1:]):
            raise ValueError(f"the runs differ in {key}: {[r[key] for r in results]}")
    names = [p for p in first["per_task"] if all(p in r["per_task"] for r in results)]
    rows = {p: [row for r in results for row in r["per_task"][p]] for p in names}
    scored = sum(r["scored_tasks"] for r in results)
    out = dict({k: first[k] for k in SAME}, prompts=[r["prompts"] for r in results],
               tasks=sum(r["tasks"] for r in results), scored_tasks=scored,
               runs=[r["command"] for r in results],
               exact_accuracy=sum(r["exact_accuracy"] * r["scored_tasks"] for r in results) / scored
               if scored else None,
               policies={}, accuracy_differences={}, per_task=rows)
    for p in names:
        out["policies"][p] = dict(summarize(rows[p], seed),
                                  accuracy_vs_prefix=paired_difference(rows[p], rows["prefix"], seed, "accuracy"))
    for b, a in itertools.combinations(names, 2):
        out["accuracy_differences"][f"{a} - {b}"] = paired_difference(rows[a], rows[b], seed, "accuracy")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m forkjax.fidelity.merge", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="output directories of `python -m forkjax.fidelity`")
    ap.add_argument("--seed", type=int, default=0, help="of the bootstrap resamples")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    results = []
    for run in args.runs:
        with open(os.path.join(run, "fidelity.json")) as f:
            results.append(json.load(f))
    result = merge(results, args.seed)
    left = sorted({p for r in results for p in r["per_task"]} - set(result["policies"]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fidelity.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out)
    print(table(result))
    for name, d in result["accuracy_differences"].items():
        if d is not None:
            print(f"{name}: {d['mean']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] over {d['tasks']} tasks")
    if left:
        print(f"left out (not in every run): {', '.join(left)}")
    return result


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, KeyError) as e:
        sys.exit(f"forkjax.fidelity.merge: {e}")
