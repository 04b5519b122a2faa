"""The memory-for-fidelity frontier of `forkkv` with a reader's own base K/V on some layers.

Under `forkkv` a reader reading a prefix another agent (the writer) computed attends to
K = x_w·W_k + RoPE(x_r·A_r·B_r): the writer's base part, its own residual. The reader computes
its own hidden states x_r over the prefix anyway (to write the residual), so it could keep its
own base part x_r·W on a set of layers, at the memory of full K/V on those layers. This
measures what that buys, with an independent float32 transformers + PEFT reference (the one
tests/test_engine_cache.py checks the engine's `forkkv` against): per task, the writer's base
K/V rows of the context, then the reader with the writer's rows on every layer but the kept
ones, and the KL to exact (the reader alone) at the answer's positions, teacher-forced.

Kept layers: the first k, the last k, or the k whose base K/V drift most between writer and
reader (relative squared difference over the context, measured per task from the exact pass;
DroidSpeak's "critical layers"). Per-agent memory, as a share of a full per-agent K/V
(`prefix`): R / (Hkv·D) for the residual plus k / L for the kept layers.

    python scripts/fidelity_tasks.py --contexts 256,512 --directories 2 --out /tmp/tasks.jsonl
    python scripts/fidelity_knob.py --prompts /tmp/tasks.jsonl --out /tmp/knob

Writes OUT/knob.json (per family and k: memory share, mean KL with a 95% bootstrap interval)
and OUT/knob.png (KL against memory, with the straight line from `forkkv` to `prefix` that a
mix of the two policies gives: a family moves the frontier where it runs below that line).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from forkjax.fidelity.metrics import interval
from forkjax.fidelity.tasks import load_tasks
from forkjax.models.builtin import trained_adapters
from forkjax.models.gguf import GGUFCheckpoint, packaged_path


def load(model_name: str, adapters: dict[str, str]):
    import peft
    import transformers
    path = packaged_path(model_name)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    names = list(adapters)
    model = peft.PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval(), GGUFCheckpoint(path).tokenizer()


def kv_bases(model):
    """[(k_proj base layer, v_proj base layer)] of every decoder layer."""
    return [(layer.self_attn.k_proj.base_layer, layer.self_attn.v_proj.base_layer)
            for layer in model.base_model.model.model.layers]


@torch.no_grad()
def run(model, adapter: str, ids: list[int], replace=None):
    """Logits [T, vocab] of `adapter` on ids, and every layer's base K, V outputs; `replace`
    {layer: (K rows, V rows)}: those layers' first rows are taken from it instead."""
    model.set_adapter(adapter)
    seen, hooks = {}, []
    for i, pair in enumerate(kv_bases(model)):
        for j, mod in enumerate(pair):
            def hook(m, args, out, key=(i, j)):
                seen[key] = out
                if replace is not None and key[0] in replace:
                    rows = replace[key[0]][key[1]]
                    return torch.cat([rows, out[:, rows.shape[1]:]], 1)
            hooks.append(mod.register_forward_hook(hook))
    try:
        logits = model(torch.tensor([ids])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    layers = len(kv_bases(model))
    return logits, [(seen[(i, 0)], seen[(i, 1)]) for i in range(layers)]


def kl_at(exact, other, start: int, n: int) -> float:
    """Mean KL(exact ‖ other) over the n positions predicting tokens start .. start + n - 1."""
    p = torch.log_softmax(exact[start - 1:start - 1 + n].double(), -1)
    q = torch.log_softmax(other[start - 1:start - 1 + n].double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", required=True, help="fidelity JSONL (scripts/fidelity_tasks.py)")
    ap.add_argument("--keep", default="0,1,2,4,8,15", help="kept layer counts k, comma-separated")
    ap.add_argument("--limit", type=int, help="the first N tasks only")
    ap.add_argument("--out", default="knob")
    args = ap.parse_args(argv)
    adapters = trained_adapters(args.model)
    model, tokenizer = load(args.model, adapters)
    tasks = load_tasks(args.prompts, tokenizer, adapters)[:args.limit]
    cfg = model.base_model.model.config
    layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rank = model.peft_config[next(iter(adapters))].r
    keep = [int(k) for k in args.keep.split(",")]
    families = ("first", "last", "drift")
    kls = {(f, k): [] for f in families for k in keep}
    t0 = time.perf_counter()
    for n, task in enumerate(tasks):
        ctx, ids = len(task.context), [*task.prompt, *task.answer]
        _, writer_kv = run(model, task.writer, list(task.context))
        exact, own_kv = run(model, task.reader, ids)
        drift = [sum(float(((o[:, :ctx] - w) ** 2).sum() / (o[:, :ctx] ** 2).sum()) for o, w in zip(own, wr))
                 for own, wr in zip(own_kv, writer_kv)]
        order = {"first": list(range(layers)), "last": list(range(layers))[::-1],
                 "drift": [int(i) for i in np.argsort(drift)[::-1]]}
        for f in families:
            for k in keep:
                kept = set(order[f][:k])
                shared = {i: writer_kv[i] for i in range(layers) if i not in kept}
                logits, _ = run(model, task.reader, ids, shared)
                kls[(f, k)].append(kl_at(exact, logits, len(task.prompt), len(task.answer)))
        print(f"task {n + 1}/{len(tasks)} ({time.perf_counter() - t0:.0f} s): forkkv KL "
              f"{kls[('first', 0)][-1]:.4f}, most-drift layers {order['drift'][:4]}", flush=True)
    base_share = rank / (hkv * head_dim)
    rows = [dict(family=f, keep=k, memory_share=base_share + k / layers, kl=float(np.mean(kls[(f, k)])),
                 kl_interval=interval(np.array(kls[(f, k)])), per_task=kls[(f, k)])
            for f in families for k in keep]
    os.makedirs(args.out, exist_ok=True)
    result = dict(model=args.model, tasks=len(tasks), layers=layers, rank=rank, prompts=args.prompts,
                  seconds=time.perf_counter() - t0, rows=rows)
    with open(os.path.join(args.out, "knob.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "knob.png"))
    for r in rows:
        lo, hi = r["kl_interval"]
        print(f"{r['family']:6s} k={r['keep']:2d} memory {r['memory_share']:.3f} KL {r['kl']:.4f} [{lo:.4f}, {hi:.4f}]")


def plot(result: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    by = {}
    for r in result["rows"]:
        by.setdefault(r["family"], []).append(r)
    start = by["first"][0]
    ax.plot([start["memory_share"], 1.0], [start["kl"], 0.0], "k:", label="forkkv ↔ prefix mix")
    for family, rs in by.items():
        ax.plot([r["memory_share"] for r in rs], [r["kl"] for r in rs], "o-", label=f"own base K/V: {family} k")
    ax.plot([1.0], [0.0], "ks", label="prefix (exact)")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("per-agent K/V memory (share of a full copy)")
    ax.set_ylabel("KL(exact ‖ policy) at the answer")
    ax.set_title(f"{result['model']}: {result['tasks']} tasks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
