"""A policy's runs against exact's, task by task, with 95% bootstrap intervals over the tasks.

Per task: the mean KL(exact || policy) of the next-token distributions over the compared
positions, the share of those positions whose top-1 token agrees, whether the greedy output
equals exact's, whether it is right (tasks with an answer or a regex), and per layer the mean
cosine similarity of the hidden states at those positions (ForkKV Fig. 5). A metric's value is
its mean over tasks; its interval the 2.5 and 97.5 percentiles of that mean over BOOTSTRAP
resamples of the tasks (percentile bootstrap).
"""

from __future__ import annotations

import numpy as np

BOOTSTRAP = 1000


def per_task(run: dict, exact: dict) -> dict:
    """run, exact: {"ids", "logp" [A, vocab], "hidden" [L + 1, A, d], "correct"} of one task."""
    p = np.exp(exact["logp"])
    num = np.sum(run["hidden"] * exact["hidden"], axis=-1)
    den = np.linalg.norm(run["hidden"], axis=-1) * np.linalg.norm(exact["hidden"], axis=-1)
    return dict(kl=float(np.mean(np.sum(p * (exact["logp"] - run["logp"]), axis=-1))),
                top1=float(np.mean(run["logp"].argmax(-1) == exact["logp"].argmax(-1))),
                greedy_agreement=float(run["ids"] == exact["ids"]),
                accuracy=None if run["correct"] is None else float(run["correct"]),
                layer_cosine=np.mean(num / np.maximum(den, 1e-30), axis=1))  # [L + 1]


def interval(values: np.ndarray, seed: int = 0) -> list:
    """95% percentile-bootstrap interval of the mean of `values` [n] or [n, k] over its rows."""
    values = np.asarray(values, np.float64)
    rows = np.random.default_rng(seed).integers(0, len(values), (BOOTSTRAP, len(values)))
    means = values[rows].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5], axis=0)
    return [float(lo), float(hi)] if values.ndim == 1 else [[float(a), float(b)] for a, b in zip(lo, hi)]


def compare(runs: list[dict], exact: list[dict], seed: int = 0) -> dict:
    """The policy's metrics against exact over the tasks, each with `<name>_ci`."""
    return summarize([per_task(r, e) for r, e in zip(runs, exact)], seed)


def summarize(rows: list[dict], seed: int = 0) -> dict:
    """The metrics of `per_task` rows (any subset of a run's tasks), each with `<name>_ci`."""
    out = {"tasks": len(rows)}
    for key in ("kl", "top1", "greedy_agreement"):
        values = np.array([r[key] for r in rows])
        out[key], out[f"{key}_ci"] = float(values.mean()), interval(values, seed)
    scored = np.array([r["accuracy"] for r in rows if r["accuracy"] is not None])
    out["accuracy"] = float(scored.mean()) if len(scored) else None
    out["accuracy_ci"] = interval(scored, seed) if len(scored) else None
    # float64, as the interval's means: a float32 mean of cosines near 1 rounds past them
    cos = np.stack([np.asarray(r["layer_cosine"], np.float64) for r in rows])
    out["layer_cosine"] = [float(v) for v in cos.mean(axis=0)]
    out["layer_cosine_ci"] = interval(cos, seed)
    return out


def paired_difference(runs: list[dict], base: list[dict], seed: int = 0, key: str = "correct") -> dict | None:
    """Accuracy of `runs` minus that of `base` on the same tasks, with its paired interval;
    None without scored tasks. `key`: "correct" (runs) or "accuracy" (`per_task` rows)."""
    pairs = [(r[key], b[key]) for r, b in zip(runs, base) if r[key] is not None]
    if not pairs:
        return None
    diff = np.array([float(a) - float(b) for a, b in pairs])
    return {"mean": float(diff.mean()), "ci": interval(diff, seed), "tasks": len(diff)}
