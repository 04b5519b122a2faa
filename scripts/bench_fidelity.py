"""Fidelity of every cache policy on real text: SmolLM2-135M-Instruct and its trained agents
(scripts/train_agents.py) answer questions about a shared staff directory whose K/V another
agent computed first (forkjax/workflows/tasks.py), on the CPU: `python -m forkjax.fidelity` on
those tasks, per adapter set.

    python scripts/bench_fidelity.py --quick --out /tmp/fidelity        # ~6 min on 2 cores
    python scripts/bench_fidelity.py --out /tmp/fidelity                # 1k/2k/4k: ~25 min
    # the rank sweep: agents of other ranks first (train_agents.py), then every set in one run
    python scripts/train_agents.py --rank 4 --sets own --steps 80 --out /tmp/agents-r4   # and 16
    R=forkjax/models/adapters/smollm2-135m
    python scripts/bench_fidelity.py --adapters $R,/tmp/agents-r4,/tmp/agents-r16 --contexts 1024 \
        --policies forkkv,full_reuse,base --out /tmp/fidelity-rank
    # the adapter-strength curve: the agents' B scaled; beside agents with LoRA on q and v only
    python scripts/train_agents.py --targets q_proj,v_proj --sets own --out /tmp/agents-qv
    python scripts/bench_fidelity.py --quick --adapters $R,/tmp/agents-qv --policies forkkv,full_reuse \
        --scales 0.25,0.5,1,2 --out /tmp/fs

Per directory one agent (the writer, each role in turn) prefills the directory; every other agent
(a reader) then asks `--tasks` questions on it (`tasks.fidelity_lines`: the JSONL written to
DIR/tasks.jsonl). forkjax.fidelity compares each policy as served with exact (each task alone):
`prefix` computes every reader's own K/V; `forkkv` reads the writer's base K/V with the
readers' own residuals; `forkkv+fanout` has the writer write the readers' residuals too;
`full_reuse` reads the writer's merged K/V; `lrshared` runs the shared-A agents (one A, own B),
against exact on those same agents (its `prefix` row: `prefix/shared-a`); `base` is the base
model without any adapter, the adapters' own effect on the answers; with --alora, `alora` runs
the Activated LoRA agents (train_agents.py --alora) on the tasks' aLoRA form, the base model's
K/V of the directory shared by every agent, against each task alone (`prefix` serves them so:
exact by construction, the row checks it). Float32 throughout.

Writes DIR/fidelity.json ({"policies": {name: {...}}, "sweep": [...], ...}: `policies` is the
first adapter set over every context, the sweep every policy at every (rank, context length)
run, both from forkjax.fidelity's per-task rows), DIR/fidelity.png (accuracy and KL per run),
DIR/sweep.png (loss against context length and rank), with --scales DIR/strength.png (each
set's policies' loss as their B is scaled, and against the adapters' own effect: ForkKV Fig.
5's relation), and per run forkjax.fidelity's own output (layer_cosine.png among it) under
DIR/<set>[-shared-a]/ and DIR/<set>-scale<s>/, <set> `rank<r>` and the targets' initials unless
q/k/v/o (`rank8-qv`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from forkjax.fidelity.__main__ import main as fidelity
from forkjax.fidelity.metrics import summarize
from forkjax.fidelity.plots import pyplot, save
from forkjax.lora.targets import TARGETS
from forkjax.models.builtin import trained_adapters
from forkjax.models.gguf import GGUFCheckpoint, packaged_path
from forkjax.sizes import size_flag
from forkjax.workflows.tasks import fidelity_lines

POLICIES = ("prefix", "forkkv", "forkkv+fanout", "full_reuse", "lrshared", "base")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one 1k directory, 3 tasks a reader")
    ap.add_argument("--contexts", default="1024,2048,4096", help="directory lengths in tokens")
    ap.add_argument("--directories", type=int, default=1, help="directories per length")
    ap.add_argument("--tasks", type=int, default=3, help="questions per reader and directory")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--adapters", default=None,
                    help="trained agents' directories, comma-separated (default: the built-in's); "
                         "the first gives `policies`, all of them the sweep (e.g. other ranks)")
    ap.add_argument("--kv-cache-bytes", type=size_flag, default=1 << 30)
    ap.add_argument("--scales", default="", help="adapter strengths (factors on B, e.g. "
                    "0.25,0.5,1,2): every set's runs for the strength curve (strength.png)")
    ap.add_argument("--alora", action="store_true", help="the Activated LoRA agents too (alora/): "
                    "their row `alora`, served sharing the base model's K/V of the directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="fidelity_out")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.directories, args.tasks = "1024", 1, 3
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.scales = [float(x) for x in args.scales.split(",") if x]
    policies = [p for p in args.policies.split(",") if p]
    if bad := [p for p in policies if p not in POLICIES]:
        sys.exit(f"--policies: unknown {bad}: expected names among {', '.join(POLICIES)}")
    sets = []  # (own agents, shared-A agents) per --adapters directory
    for root in args.adapters.split(",") if args.adapters else [None]:
        own = trained_adapters("smollm2-135m", root=root)
        shared = trained_adapters("smollm2-135m", shared_a=True, root=root)
        if not own:
            sys.exit(f"--adapters {root}: no trained agents (<role>/adapter_config.json) there")
        if "lrshared" in policies and not shared:
            sys.exit(f"--adapters {root}: no shared-a/ agents for lrshared; leave it out of --policies")
        alora = trained_adapters("smollm2-135m", root=root, alora=True) if args.alora else {}
        if args.alora and not alora:
            sys.exit(f"--adapters {root}: no alora/ agents for --alora")
        sets.append((own, shared, alora))
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer = GGUFCheckpoint(packaged_path("smollm2-135m")).tokenizer().tok
    result = dict(model="smollm2-135m", dtype="float32", contexts=args.contexts,
                  directories=args.directories, tasks_per_reader=args.tasks,
                  command=" ".join(["python", *sys.argv]), seconds={}, policies={}, sweep=[],
                  strength=[])
    served = [p for p in policies if p != "lrshared"]
    for k, (own, shared, alora) in enumerate(sets):
        rank, label = adapter_rank(own), set_label(own)
        runs = ([("", own, served)] + ([("-shared-a", shared, ["lrshared"])] if "lrshared" in policies else [])
                + ([("-alora", alora, ["prefix"])] if alora else []))
        for suffix, adapters, names in runs:
            t = time.perf_counter()
            r, lines = run_fidelity(os.path.join(args.out, f"{label}{suffix}"), adapters, names,
                                    tokenizer, args, alora=suffix == "-alora")
            result["seconds"][f"{label}{suffix}"] = time.perf_counter() - t
            context_of = {n + 1: c for n, c in enumerate(_contexts(lines, args))}  # by line
            for policy, rows in r["per_task"].items():
                name = {"-shared-a": "prefix/shared-a", "-alora": "alora"}.get(suffix, policy) \
                    if policy == "prefix" else policy
                if k == 0:
                    result["policies"][name] = r["policies"][policy]
                for n in args.contexts:
                    pick = [row for row in rows if context_of[row["line"]] == n]
                    result["sweep"].append(dict(policy=name, context=n, rank=rank, set=label,
                                                **summarize(pick, args.seed)))
    # ForkKV Fig. 5's relation: each policy's loss against the adapters' own effect (`base`'s
    # KL), every set's B scaled.
    for own, *_ in sets if args.scales else []:
        label = set_label(own)
        for scale in args.scales:
            t = time.perf_counter()
            r, _ = run_fidelity(os.path.join(args.out, f"{label}-scale{scale:g}"), own,
                                [*dict.fromkeys([*served, "base"])], tokenizer, args, scale)
            result["seconds"][f"{label} scale {scale:g}"] = time.perf_counter() - t
            for policy, m in r["policies"].items():
                result["strength"].append(dict(
                    set=label, scale=scale, policy=policy, adapter_kl=r["policies"]["base"]["kl"],
                    **{key: m[key] for key in ("kl", "kl_ci", "accuracy", "greedy_agreement")}))
    result["total_s"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "fidelity.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out)
    for r in result["sweep"]:
        print(f"{r['policy']:16s} rank {r['rank']:2d} {r['context']:5d} tokens: accuracy "
              f"{r['accuracy']:.3f}  KL {r['kl']:.4f}  top-1 {r['top1']:.3f}  greedy "
              f"{r['greedy_agreement']:.3f}  last-layer cosine {r['layer_cosine'][-1]:.4f}")


def run_fidelity(out: str, adapters: dict, policies: list[str], tokenizer, args, scale: float = 1.0,
                 alora: bool = False):
    """python -m forkjax.fidelity on the directory tasks of `adapters` ({role: dir}; `alora`:
    Activated LoRA agents, on the tasks' aLoRA form), output in `out` -> (its result, the task
    lines)."""
    os.makedirs(out, exist_ok=True)
    lines = fidelity_lines(tokenizer, list(adapters), args.contexts, args.directories, args.tasks, args.seed,
                           alora=alora)
    with open(os.path.join(out, "tasks.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    r = fidelity(["--model", "smollm2-135m", "--prompts", os.path.join(out, "tasks.jsonl"),
                  *[a for n, d in adapters.items() for a in ("--lora", f"{n}={d}")],
                  "--policies", ",".join(policies), "--kv-cache-bytes", str(args.kv_cache_bytes),
                  "--lora-scale", str(scale), "--seed", str(args.seed), "--out", out, "--no-progress"])
    return r, lines


def _contexts(lines: list[dict], args) -> list[int]:
    """The directory length of each task line, in `fidelity_lines`' order."""
    per_length = len(lines) // len(args.contexts)
    return [n for n in args.contexts for _ in range(per_length)]


def adapter_rank(adapters: dict) -> int:
    return _adapter_config(adapters)["r"]


def set_label(adapters: dict) -> str:
    """`rank<r>`, then the targeted projections' initials unless they are q/k/v/o (`rank8-qv`)."""
    targets = [t for t in TARGETS if t in _adapter_config(adapters)["target_modules"]]
    suffix = "" if targets == list(TARGETS[:4]) else "-" + "".join(t[0] for t in targets)
    return f"rank{adapter_rank(adapters)}{suffix}"


def _adapter_config(adapters: dict) -> dict:
    with open(os.path.join(next(iter(adapters.values())), "adapter_config.json")) as f:
        return json.load(f)


def plot(result: dict, out: str):
    plt = pyplot()
    names = list(result["policies"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for label, n in dict.fromkeys((r["set"], r["context"]) for r in result["sweep"]):
        rows = {r["policy"]: r for r in result["sweep"] if (r["set"], r["context"]) == (label, n)}
        a.plot(names, [rows[p]["accuracy"] for p in names], marker="o", label=f"{label}, {n} tokens")
        b.plot(names, [rows[p]["kl"] for p in names], marker="o", label=f"{label}, {n} tokens")
    a.set_ylim(0, 1)
    a.set_ylabel("task accuracy")
    b.set_ylim(bottom=0)
    b.set_ylabel("KL(exact || policy), answer positions")
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, os.path.join(out, "fidelity.png"))
    # ForkKV Fig. 15's shape: loss against context length (first rank) and LoRA rank (first length)
    sweep = result["sweep"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, (key, other) in zip(axes, (("context", "rank"), ("rank", "context"))):
        fixed = sweep[0][other]
        for p in names:
            # lengths: the first set's; ranks: the sets on q/k/v/o
            pts = sorted((r[key], r["kl"]) for r in sweep if r["policy"] == p and r[other] == fixed
                         and r["set"] == (sweep[0]["set"] if key == "context" else f"rank{r['rank']}"))
            ax.plot(*zip(*pts), marker="o", label=p)
        ax.set_xscale("log", base=2)
        xs = sorted({r[key] for r in sweep if r[other] == fixed})
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(f"{'context tokens' if key == 'context' else 'LoRA rank'} ({other} {fixed})")
        ax.set_ylim(bottom=0)
        ax.set_ylabel("KL(exact || policy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, os.path.join(out, "sweep.png"))
    if result["strength"]:
        plot_strength(result["strength"], os.path.join(out, "strength.png"))


def plot_strength(strength: list[dict], path: str):
    """Per set, each policy's KL as the adapters' B is scaled, and against the adapters' own
    effect (`base`'s KL at that scale). KL on a log scale: it spans two orders of magnitude."""
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(10, 3.6))
    for i, label in enumerate(dict.fromkeys(r["set"] for r in strength)):
        mine = [r for r in strength if r["set"] == label]
        for j, p in enumerate(dict.fromkeys(r["policy"] for r in mine if r["policy"] != "prefix")):
            pts = sorted((r["scale"], r["kl"], r["adapter_kl"]) for r in mine if r["policy"] == p)
            style = dict(marker="os^"[i % 3], ls="--" if p == "base" else "-", color=f"C{j}",
                         alpha=1.0 if i == 0 else 0.6, label=f"{label}: {p}")
            a.plot([x for x, _, _ in pts], [y for _, y, _ in pts], **style)
            if p != "base":
                b.plot([e for _, _, e in pts], [y for _, y, _ in pts], **style)
    xs = sorted({r["scale"] for r in strength})
    a.set_xscale("log", base=2)
    a.set_xticks(xs, [f"×{x:g}" for x in xs])
    a.set_xlabel("adapters' B scaled (base: the adapters' own effect)")
    b.set_xlim(left=0)
    b.set_xlabel("the adapters' own effect: KL(exact || base)")
    for ax in (a, b):
        ax.set_yscale("log")
        ax.set_ylabel("KL(exact || policy), log scale")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    main()
