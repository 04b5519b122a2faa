"""Train the demo agents of `smollm2-135m`: one LoRA adapter per role of forkjax/workflows/
tasks.py (extractor, critic, caller) on SmolLM2-135M-Instruct, with transformers + PEFT on the
CPU, on synthetic directories this script generates (seeded).

    python scripts/train_agents.py --out forkjax/models/adapters/smollm2-135m

Two sets: `<role>` (own A and B) and `shared-a/<role>` (one frozen random A shared by every role,
each its own B: LRAgent's BaseLRShared setting, for `cache_policy="lrshared"`). `--alora` trains
a third, `alora/<role>`: Activated LoRA (PEFT's `alora_invocation_tokens`), each adapter acting
only from its role's invocation (`tasks.INVOCATIONS`) on, so the directory before it is the base
model's, on prompts of the aLoRA form (`tasks.make_prompt(..., alora=True)`). Rank 8 on
q/k/v/o (alpha 16; `--targets q_proj,v_proj` for LRAgent's setting), saved in PEFT format in
bfloat16. Loss is on the answer tokens only. Each
adapter's accuracy on held-out tasks (greedy, transformers) goes to OUT/train.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch

from forkjax.models.builtin import ADAPTERS_DIR
from forkjax.models.gguf import GGUFCheckpoint, packaged_path
from forkjax.workflows import tasks

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def load_base():
    import transformers
    path = packaged_path("smollm2-135m")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return model, GGUFCheckpoint(path).tokenizer().tok


def example(tok, role: str, rng: np.random.Generator, records: tuple[int, int], alora: bool):
    recs = tasks.directory(rng, int(rng.integers(records[0], records[1] + 1)))
    return tasks.make_prompt(tok, role, recs, rng, alora=alora)


def batch_tensors(prompts, pad: int):
    """Right-padded input ids [B, T] and labels (-100 outside the answers)."""
    seqs = [p.context + p.task + p.answer for p in prompts]
    t = max(map(len, seqs))
    ids = torch.full((len(seqs), t), pad, dtype=torch.long)
    labels = torch.full((len(seqs), t), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
        labels[i, len(s) - len(p.answer):len(s)] = torch.tensor(p.answer)
    return ids, mask, labels


@torch.no_grad()
def accuracy(model, tok, role: str, rng: np.random.Generator, n: int, records: tuple[int, int],
             alora: bool) -> float:
    hits = 0
    for _ in range(n):
        p = example(tok, role, rng, records, alora)
        ids = torch.tensor([p.context + p.task])
        out = model.generate(ids, max_new_tokens=len(p.answer) + 8, do_sample=False,
                             eos_token_id=p.answer[-1], pad_token_id=p.answer[-1])
        hits += tasks.correct(role, tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True),
                              p.expected)
    return hits / n


def train_one(base, tok, role: str, shared_a: dict | None, args, seed: int) -> dict:
    import peft
    torch.manual_seed(seed)
    # aLoRA: PEFT finds the invocation (and so where the adapter starts) only in a causal LM's
    # forward and generate, hence the task type.
    cfg = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=args.targets,
                          lora_dropout=0.0, task_type="CAUSAL_LM" if args.alora else None,
                          alora_invocation_tokens=tasks.invocation_ids(tok, role) if args.alora else None)
    model = peft.get_peft_model(base, cfg)
    if shared_a is not None:  # one frozen A for every role
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.data.copy_(shared_a[name])
                p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    rng = np.random.default_rng(seed)
    losses, t0 = [], time.perf_counter()
    model.train()
    for step in range(args.steps):
        ids, mask, labels = batch_tensors([example(tok, role, rng, args.records, args.alora)
                                           for _ in range(args.batch)], tok.pad_token_id or 0)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"{role}{' (shared A)' if shared_a else ' (aLoRA)' if args.alora else ''} step {step}: loss {loss.item():.3f}",
                  flush=True)
    model.eval()
    acc = accuracy(model, tok, role, np.random.default_rng(10_000 + seed), args.eval, args.records,
                   args.alora)
    out = os.path.join(args.out, "shared-a" if shared_a is not None else "alora" if args.alora else "",
                       role)
    model.peft_config["default"].base_model_name_or_path = BASE_NAME
    model.save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))  # PEFT's empty model card
    _to_bfloat16(os.path.join(out, "adapter_model.safetensors"))
    result = dict(role=role, shared_a=shared_a is not None, alora=args.alora, targets=args.targets,
                  steps=args.steps, batch=args.batch, lr=args.lr, records=args.records, seed=seed,
                  final_loss=float(np.mean(losses[-10:])), heldout_accuracy=acc,
                  train_s=time.perf_counter() - t0)
    print(json.dumps(result), flush=True)
    model.unload()  # the base model without LoRA layers, for the next role
    return result


def _record_key(r: dict) -> tuple:
    """Which adapter a train.json record is of (records before aLoRA have no `alora`)."""
    return r["shared_a"], r.get("alora", False), r["role"]


def _to_bfloat16(path: str):
    from safetensors.torch import load_file, save_file
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ADAPTERS_DIR, "smollm2-135m"))
    ap.add_argument("--roles", default=",".join(tasks.ROLES))
    ap.add_argument("--sets", default=None, help="own,shared-a (default); own alone with --alora")
    ap.add_argument("--alora", action="store_true",
                    help="train aLoRA agents (OUT/alora/<role>), each invoked by tasks.INVOCATIONS[role]")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", type=lambda s: s.split(","), default=TARGETS,
                    help="projections LoRA targets, comma-separated (q_proj,k_proj,v_proj,o_proj)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--records", type=lambda s: tuple(map(int, s.split(","))), default=(3, 12),
                    help="records per training directory: min,max")
    ap.add_argument("--eval", type=int, default=16, help="held-out tasks per adapter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    args.sets = args.sets or ("own" if args.alora else "own,shared-a")
    if args.alora and args.sets != "own":
        ap.error("--alora trains the own set only: leave --sets out")
    torch.set_num_threads(args.threads)
    base, tok = load_base()
    base.requires_grad_(False)
    shared = None
    if "shared-a" in args.sets.split(","):
        import peft
        torch.manual_seed(args.seed + 99)
        probe = peft.get_peft_model(base, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                          target_modules=args.targets))
        shared = {n: p.detach().clone() for n, p in probe.named_parameters() if "lora_A" in n}
        probe.unload()
    results = []
    for role in args.roles.split(","):
        for s in args.sets.split(","):
            results.append(train_one(base, tok, role, shared if s == "shared-a" else None, args,
                                     args.seed + tasks.ROLES.index(role)))
    # One record per adapter: a run of some roles or sets replaces theirs and keeps the others.
    path = os.path.join(args.out, "train.json")
    kept = json.load(open(path))["adapters"] if os.path.exists(path) else []
    done = set(map(_record_key, results))
    kept = [r for r in kept if _record_key(r) not in done] + results
    with open(path, "w") as f:
        json.dump(dict(rank=args.rank, adapters=sorted(kept, key=_record_key)), f, indent=1)


if __name__ == "__main__":
    main()
