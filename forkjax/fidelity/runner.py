"""Every task under one cache policy, as deployed, or alone (exact).

Exact computes each task alone in a flushed `prefix` cache: the reader's own K/V of the context,
nothing shared. Every other policy runs as it is served: per (context, writer) the cache is
flushed, the writer prefills the context (under `forkkv+fanout` writing its readers' residuals
too), then each reader's tasks on it read what the cache holds. `prefix` shares nothing across
adapters, so its row checks that serving is exact (Activated LoRA agents share the base model's
K/V of the context exactly under every policy: for them it is the sharing row); `base` asks with no adapter at all (the
adapters' own effect, the scale of every other row's loss).

Per task the run keeps the greedy output, the log-probabilities and hidden states at the
compared positions (teacher-forced: the given answer, else exact's greedy continuation), and
whether the output is right.
"""

from __future__ import annotations

import numpy as np

from forkjax.fidelity.tasks import FidelityTask, correct

SLACK_TOKENS = 8  # generated past a given answer's length: room for the check to see it whole


def target_of(task: FidelityTask, exact_ids: list[int]) -> list[int]:
    """The positions a task compares: its answer, else exact's greedy output."""
    return list(task.answer) if task.answer is not None else list(exact_ids)


def targets_of(tasks: list[FidelityTask], exact: list[dict]) -> list[list[int]]:
    return [target_of(t, e["ids"]) for t, e in zip(tasks, exact)]


def run_policy(engine, policy: str, tasks: list[FidelityTask], max_new_tokens: int,
               targets: list[list[int]] | None = None, progress=None) -> list[dict]:
    """[{"ids", "logp" [A, vocab], "hidden" [L + 1, A, d], "correct"}] of every task, in order.
    `policy` "exact" (each task alone; `targets` None: its greedy outputs become them), else as
    deployed; `progress` (a tqdm bar or None) advances a task at a time."""
    out: list[dict | None] = [None] * len(tasks)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tasks):
        groups.setdefault(("alone", i) if policy == "exact" else (t.context, t.writer), []).append(i)
    for members in groups.values():
        engine.flush_cache()
        first = tasks[members[0]]
        if policy not in ("exact", "base"):
            readers = list(dict.fromkeys(tasks[i].reader for i in members if tasks[i].reader != first.writer))
            # an Activated LoRA writer's K/V of a context without its invocation is the base
            # model's own: the base model prefills it
            writer = None if engine.slots.invocation_of(first.writer) is not None else first.writer
            engine.generate([list(first.context)], adapters=[writer], max_new_tokens=1,
                            fanout_adapters=readers if policy == "forkkv+fanout" else None)
        for i in members:
            t = tasks[i]
            agent = None if policy == "base" else t.reader
            fanout = [] if policy == "forkkv+fanout" else None
            if t.answer is not None:
                ids = engine.generate([t.prompt], adapters=[agent], fanout_adapters=fanout,
                                      max_new_tokens=len(t.answer) + SLACK_TOKENS)[0]
            else:  # a fixed count of positions to compare: no early stop
                ids = engine.generate([t.prompt], adapters=[agent], fanout_adapters=fanout,
                                      max_new_tokens=max_new_tokens, ignore_eos=True)[0]
            out[i] = _score(engine, t, agent, ids, target_of(t, ids) if targets is None else targets[i])
            if progress is not None:
                progress.update(1)
    return out


def _score(engine, task: FidelityTask, agent, ids: list[int], target: list[int]) -> dict:
    prompt = task.prompt
    logits, hidden = engine.score(prompt + list(target), adapter=agent, start=len(prompt) - 1,
                                  return_hidden_states=True)
    a = len(target)
    logp = logits[:a] - np.logaddexp.reduce(logits[:a], axis=-1, keepdims=True)
    return dict(ids=list(ids), logp=logp, hidden=hidden[:, :a],
                correct=correct(task, ids, engine.tokenizer))
