"""Tabulate scripts/lm_eval/run.sh outputs: lm_eval's scores per policy, model and task, and how
far each run's per-request answers are from the exact reference run (the `prefix` run with the
same adapter set: `prefix` for the trained agents, `prefix-shared-a` for the shared-A ones).

    python scripts/lm_eval/summarize.py /tmp/forkjax-lm-eval/*      # stdlib only; any python

Per run directory (named after its policy by run.sh) and model:
  scores       forkjax_mc acc / acc_norm and forkjax_gen exact_match, with lm_eval's stderr
  vs ref       mc: max and mean |delta| of the per-choice log-likelihoods, and the number of
               questions whose chosen answer (argmax) changed; gen: generations that differ
  cache        the server's prefix-cache counters during that model's lm_eval run (/metrics
               deltas): prompt tokens, tokens found in the base / residual pool, positions
               computed
  wall         lm_eval's wall time for that model (both tasks), from timings.tsv
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

COUNTERS = {
    "prompt": r'^forkjax:prompt_tokens_total\{[^}]*\} (\S+)',
    "base_hit": r'^forkjax:prefix_cache_hit_tokens_total\{[^}]*pool="base"\} (\S+)',
    "res_hit": r'^forkjax:prefix_cache_hit_tokens_total\{[^}]*pool="residual"\} (\S+)',
    "computed": r'^forkjax:prefill_tokens_computed_total\{[^}]*\} (\S+)',
    "errors": r'^forkjax:request_success_total\{[^}]*finished_reason="error"\} (\S+)',
}


def latest(pattern: str) -> str | None:
    files = sorted(glob.glob(pattern))
    return files[-1] if files else None


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def counters(path: str) -> dict:
    text = open(path).read() if path and os.path.exists(path) else ""
    out = {}
    for key, pat in COUNTERS.items():
        m = re.search(pat, text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    return out


def load_run(run: str) -> dict:
    """{model: {"results": ..., "mc": {doc_id: [ll per choice]}, "gen": {doc_id: text},
    "cache": counter deltas, "wall": s}} for one run.sh output directory."""
    timings = {}
    if os.path.exists(os.path.join(run, "timings.tsv")):
        for line in open(os.path.join(run, "timings.tsv")).read().split("\n")[1:]:
            if line.strip():
                k, v = line.split("\t")
                timings[k] = float(v)
    models = {}
    metric_files = sorted(glob.glob(os.path.join(run, "metrics_*_*.txt")),
                          key=lambda p: int(os.path.basename(p).split("_")[1]))
    prev = {k: 0.0 for k in COUNTERS}
    deltas = {}
    for path in metric_files:
        model = os.path.basename(path).split("_", 2)[2][:-4]
        now = counters(path)
        deltas[model] = {k: now[k] - prev[k] for k in COUNTERS}
        prev = now
    for mdir in sorted(glob.glob(os.path.join(run, "lm_eval", "*"))):
        model = os.path.basename(mdir)
        res = latest(os.path.join(mdir, "results_*.json"))
        if res is None:
            continue
        entry = {"results": json.load(open(res))["results"], "cache": deltas.get(model),
                 "wall": timings.get(f"lm_eval_{model}")}
        mc = latest(os.path.join(mdir, "samples_forkjax_mc_*.jsonl"))
        gen = latest(os.path.join(mdir, "samples_forkjax_gen_*.jsonl"))
        entry["mc"] = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]]
                       for s in read_jsonl(mc)} if mc else {}
        entry["gen"] = {s["doc_id"]: s["filtered_resps"][0] for s in read_jsonl(gen)} if gen else {}
        models[model] = entry
    return {"models": models, "timings": timings}


def ref_name(name: str) -> str:
    return "prefix-shared-a" if name.endswith("-shared-a") else "prefix"


def fmt(results: dict, task: str, metric: str) -> str:
    r = results.get(task, {})
    v, se = r.get(f"{metric},none"), r.get(f"{metric}_stderr,none")
    return "-" if v is None else f"{v:.3f}±{se:.3f}"


def main(runs: list[str]):
    runs = [r.rstrip("/") for r in runs if os.path.isdir(r)]
    data = {os.path.basename(r): load_run(r) for r in runs}
    head = ("| run (policy) | model | mc acc | mc acc_norm | gen exact_match | mc max/mean abs dLL vs ref "
            "| mc answers changed | gen texts changed | prompt tok | base hits | residual hits "
            "| computed | errors | lm_eval s |")
    print(head)
    print("|" + "|".join(["---"] * (head.count("|") - 1)) + "|")
    for name, run in data.items():
        ref = data.get(ref_name(name))
        for model, e in run["models"].items():
            cmp_mc, chg_mc, chg_gen = "-", "-", "-"
            if ref is not None and model in ref["models"] and name != ref_name(name):
                r = ref["models"][model]
                d = [abs(a - b) for doc, lls in e["mc"].items() for a, b in zip(lls, r["mc"].get(doc, []))]
                if d:
                    cmp_mc = f"{max(d):.2e} / {sum(d) / len(d):.2e}"
                argmax = lambda xs: max(range(len(xs)), key=xs.__getitem__)  # noqa: E731
                chg_mc = str(sum(argmax(lls) != argmax(r["mc"][doc]) for doc, lls in e["mc"].items()
                                 if doc in r["mc"]))
                chg_gen = str(sum(t != r["gen"].get(doc) for doc, t in e["gen"].items()))
            c = e["cache"] or {}
            cache = " | ".join(f"{c[k]:.0f}" if k in c else "-" for k in
                               ("prompt", "base_hit", "res_hit", "computed", "errors"))
            wall = f"{e['wall']:.0f}" if e["wall"] is not None else "-"
            res = e["results"]
            print(f"| {name} | {model} | {fmt(res, 'forkjax_mc', 'acc')} | {fmt(res, 'forkjax_mc', 'acc_norm')} "
                  f"| {fmt(res, 'forkjax_gen', 'exact_match')} | {cmp_mc} | {chg_mc} | {chg_gen} | {cache} | {wall} |")
    print()
    print("Scale: how far apart two different agents' exact answers are (a reference run's models)")
    for name, run in data.items():
        if name != ref_name(name):
            continue
        ms = list(run["models"])
        for i, a in enumerate(ms):
            for b in ms[i + 1:]:
                ea, eb = run["models"][a], run["models"][b]
                d = [abs(x - y) for doc, lls in ea["mc"].items() for x, y in zip(lls, eb["mc"].get(doc, []))]
                chg = sum(t != eb["gen"].get(doc) for doc, t in ea["gen"].items())
                if d:
                    print(f"  {name}: {a} vs {b}: mc max/mean abs dLL {max(d):.2e} / {sum(d) / len(d):.2e}, "
                          f"gen texts differing {chg}")
    print()
    print("| run | server start s | total s |")
    print("|---|---|---|")
    for name, run in data.items():
        t = run["timings"]
        print(f"| {name} | {t.get('server_start', float('nan')):.0f} | {t.get('total', float('nan')):.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
