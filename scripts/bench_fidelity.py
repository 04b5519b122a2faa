"""Fidelity of every cache policy on real text: SmolLM2-135M-Instruct and its trained agents
(scripts/train_agents.py) answer questions about a shared staff directory whose K/V another
agent computed first (forkjax/workflows/tasks.py), on the CPU.

    python scripts/bench_fidelity.py --quick --out /tmp/fidelity        # ~6 min on 2 cores
    python scripts/bench_fidelity.py --out /tmp/fidelity                # 1k/2k/4k: ~25 min
    # the rank sweep: agents of other ranks first (train_agents.py), then every set in one run
    python scripts/train_agents.py --rank 4 --sets own --steps 80 --out /tmp/agents-r4   # and 16
    R=forkjax/models/adapters/smollm2-135m
    python scripts/bench_fidelity.py --adapters $R,/tmp/agents-r4,/tmp/agents-r16 --contexts 1024 \
        --policies forkkv,full_reuse,base --out /tmp/fidelity-rank

Per directory one agent (the writer, each role in turn) prefills the directory; every other agent
(a reader) then asks `--tasks` questions on it. `prefix` is exact: every reader computes its own
K/V. `forkkv`: the readers read the writer's base K/V and compute their own residuals.
`forkkv+fanout`: the writer also wrote the readers' residuals from its own hidden states.
`full_reuse`: the readers read the writer's merged K/V. `lrshared` runs the shared-A agents
(one A, own B) and is compared against `prefix` on those same agents. Per policy, over the
readers' answers: task accuracy, mean KL(exact || policy) of the next-token distributions at
the answer positions (teacher-forced on the expected answer) and top-1 agreement there, the
share of greedy answers equal to exact's, and per layer the mean cosine similarity of the
hidden states at those positions with exact's (ForkKV Fig. 5). `base` is the base model without
any adapter against exact: the adapters' own effect on the answers, the scale of every other
row's loss. Float32 throughout, so the differences are the policies' own.

Writes DIR/fidelity.json ({"policies": {name: {...}}, "sweep": [...], ...}: `policies` is the
first adapter set over every context, the sweep every policy at every (rank, context length) run)
and DIR/fidelity.png, DIR/layer_cosine.png, DIR/sweep.png (loss against context length and rank).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

import forkjax
from forkjax.models.builtin import trained_adapters
from forkjax.workflows import tasks

POLICIES = ("prefix", "forkkv", "forkkv+fanout", "full_reuse", "lrshared", "base")
EXACT = {"prefix": "prefix", "forkkv": "prefix", "forkkv+fanout": "prefix", "full_reuse": "prefix",
         "lrshared": "prefix/shared-a", "base": "prefix"}  # policy -> the exact run it is compared against


def build_engine(policy: str, adapters: dict, max_len: int, args):
    cache = "prefix" if policy in ("prefix", "base") else policy.removesuffix("+fanout")
    # One residual share for every residual policy: equal pool shapes, so they share programs.
    return forkjax.Engine.from_pretrained(
        "smollm2-135m", adapters=adapters, cache_policy=cache, dtype="float32",
        residual_fanout=policy == "forkkv+fanout",
        residual_fraction=0.25 if cache in ("forkkv", "lrshared") else None,
        kv_cache_bytes=args.kv_cache_bytes, max_batch_size=4, max_model_len=max_len,
        max_prefill_tokens=1024, warmup=False, progress=False)


def directories(tok, args):
    """[(context tokens, directory index, records)], the same for every policy."""
    return [(n, j, tasks.directory_for_tokens(tok, np.random.default_rng([args.seed, n, j]), n))
            for n in args.contexts for j in range(args.directories)]


def run_policy(policy: str, adapters: dict, args) -> list[dict]:
    """Every reader's answers under `policy`: [{context, role, answer ids, correct, answer
    logprobs [A, vocab], hidden [L + 1, A, d]}]."""
    roles = list(adapters)
    engine = build_engine(policy, adapters, max(args.contexts) + 256, args)
    tok = engine.tokenizer.tok
    out = []
    for n, j, records in directories(tok, args):
        engine.flush_cache()
        writer = roles[j % len(roles)]
        readers = [r for r in roles if r != writer]
        head, _ = tasks.chat_pieces(tok)
        ctx = tasks.encode(tok, head + tasks.context_text(records))
        if policy != "base":  # the base model reads nothing the writer computes
            engine.generate([ctx], adapters=[writer], max_new_tokens=1,
                            fanout_adapters=readers if policy == "forkkv+fanout" else None)
        print(f"  {policy}: directory {j} of {n} tokens, written by {writer}", flush=True)
        for reader in readers:
            rng = np.random.default_rng([args.seed, n, j, roles.index(reader)])
            for _ in range(args.tasks):
                p = tasks.make_prompt(tok, reader, records, rng, context=ctx)
                prompt = p.context + p.task
                agent = None if policy == "base" else reader
                ids = engine.generate([prompt], adapters=[agent], max_new_tokens=len(p.answer) + 8,
                                      fanout_adapters=[] if policy == "forkkv+fanout" else None)[0]
                start = len(prompt) - 1
                logits, hidden = engine.score(prompt + p.answer, adapter=agent, start=start,
                                              return_hidden_states=True)
                a = len(p.answer)
                logp = logits[:a] - np.logaddexp.reduce(logits[:a], axis=-1, keepdims=True)
                out.append(dict(context=n, role=p.role, ids=ids, logp=logp, hidden=hidden[:, :a],
                                correct=tasks.correct(p.role, tok.decode(ids, skip_special_tokens=True),
                                                      p.expected)))
    del engine
    gc.collect()
    return out


def compare(runs: list[dict], exact: list[dict]) -> dict:
    """Metrics of `runs` against the exact run of the same tasks."""
    kl, top1, cos = [], [], []
    for r, e in zip(runs, exact):
        p = np.exp(e["logp"])
        kl.append(np.sum(p * (e["logp"] - r["logp"]), axis=-1))
        top1.append(r["logp"].argmax(-1) == e["logp"].argmax(-1))
        num = np.sum(r["hidden"] * e["hidden"], axis=-1)
        den = np.linalg.norm(r["hidden"], axis=-1) * np.linalg.norm(e["hidden"], axis=-1)
        cos.append(num / np.maximum(den, 1e-30))  # [L + 1, A]
    return dict(accuracy=float(np.mean([r["correct"] for r in runs])),
                kl=float(np.mean(np.concatenate(kl))), top1=float(np.mean(np.concatenate(top1))),
                greedy_agreement=float(np.mean([r["ids"] == e["ids"] for r, e in zip(runs, exact)])),
                layer_cosine=[float(v) for v in np.concatenate(cos, axis=1).mean(axis=1)],
                tasks=len(runs))


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
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="fidelity_out")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.directories, args.tasks = "1024", 1, 3
    args.contexts = [int(c) for c in args.contexts.split(",")]
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
        sets.append((own, shared))
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    result = dict(model="smollm2-135m", dtype="float32", contexts=args.contexts,
                  directories=args.directories, tasks_per_reader=args.tasks,
                  command=" ".join(["python", *sys.argv]), seconds={}, policies={}, sweep=[])
    # The exact runs first: every other policy is compared against one of them.
    names = ["prefix", *(["prefix/shared-a"] if "lrshared" in policies else []),
             *[p for p in policies if p != "prefix"]]
    for k, (own, shared) in enumerate(sets):
        rank, runs = adapter_rank(own), {}
        for name in names:
            t = time.perf_counter()
            runs[name] = run_policy(name.split("/")[0], shared if name in ("lrshared", "prefix/shared-a")
                                    else own, args)
            seconds = result["seconds"][f"{name}, rank {rank}"] = time.perf_counter() - t
            print(f"{name}, rank {rank}: {seconds:.0f} s", flush=True)
        for name in names:
            exact = runs[EXACT.get(name, name)]
            if k == 0:
                result["policies"][name] = compare(runs[name], exact)
            for n in args.contexts:
                pick = [i for i, r in enumerate(runs[name]) if r["context"] == n]
                m = compare([runs[name][i] for i in pick], [exact[i] for i in pick])
                result["sweep"].append(dict(policy=name, context=n, rank=rank, **m))
    result["total_s"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "fidelity.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out)
    for r in result["sweep"]:
        print(f"{r['policy']:16s} rank {r['rank']:2d} {r['context']:5d} tokens: accuracy "
              f"{r['accuracy']:.3f}  KL {r['kl']:.4f}  top-1 {r['top1']:.3f}  greedy "
              f"{r['greedy_agreement']:.3f}  last-layer cosine {r['layer_cosine'][-1]:.4f}")


def adapter_rank(adapters: dict) -> int:
    with open(os.path.join(next(iter(adapters.values())), "adapter_config.json")) as f:
        return json.load(f)["r"]


def plot(result: dict, out: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(result["policies"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for rank, n in dict.fromkeys((r["rank"], r["context"]) for r in result["sweep"]):
        rows = {r["policy"]: r for r in result["sweep"] if (r["rank"], r["context"]) == (rank, n)}
        a.plot(names, [rows[p]["accuracy"] for p in names], marker="o", label=f"rank {rank}, {n} tokens")
        b.plot(names, [rows[p]["kl"] for p in names], marker="o", label=f"rank {rank}, {n} tokens")
    a.set_ylabel("task accuracy")
    b.set_ylabel("KL(exact || policy), answer positions")
    b.set_yscale("symlog", linthresh=1e-4)
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "fidelity.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for p in names:
        ax.plot(result["policies"][p]["layer_cosine"], label=p)
    ax.set_xlabel("layer (0: embeddings)")
    ax.set_ylabel("cosine similarity to exact")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "layer_cosine.png"), dpi=120)
    # ForkKV Fig. 15's shape: loss against context length (first rank) and LoRA rank (first length)
    sweep = result["sweep"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, (key, other) in zip(axes, (("context", "rank"), ("rank", "context"))):
        fixed = sweep[0][other]
        for p in names:
            pts = sorted((r[key], r["kl"]) for r in sweep if r["policy"] == p and r[other] == fixed)
            ax.plot(*zip(*pts), marker="o", label=p)
        ax.set_xscale("log", base=2)
        xs = sorted({r[key] for r in sweep if r[other] == fixed})
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(f"{'context tokens' if key == 'context' else 'LoRA rank'} ({other} {fixed})")
        ax.set_ylabel("KL(exact || policy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "sweep.png"), dpi=120)
    plt.close("all")


if __name__ == "__main__":
    main()
