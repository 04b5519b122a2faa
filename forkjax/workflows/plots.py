"""The benchmark's figures, in the style of ForkKV's evaluation (matplotlib, Agg: no display).

throughput.png  Fig. 11: end-to-end tasks/s against concurrent workflows, one line per policy
                (and, for runs with --total, the sustained or else the steady tasks/s dashed).
breakdown.png   Fig. 14: why, per policy: (a) KV bytes per agent, (b) prefix cache hit rate
                (base and residual pools), (c) mean decode batch size, at the largest workflow
                count run.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_throughput(rows: list[dict], path: str, title: str):
    """Makespan tasks/s per policy (solid); dashed in the same colour, the sustained figure
    (--total, results.py) where every run has one, else the steady figure where every run has
    that (M = 2N runs have no sustained window)."""
    fig, ax = plt.subplots(figsize=(5, 3.6))
    window = next((w for w in ("sustained", "steady")
                   if all(r.get(f"tasks_per_s_{w}") is not None for r in rows)), None)
    for policy in _policies(rows):
        pts = sorted((r["workflows"], r["tasks_per_s"]) for r in rows if r["policy"] == policy)
        line, = ax.plot(*zip(*pts), marker="o", label=policy)
        if window:
            pts = sorted((r["workflows"], r[f"tasks_per_s_{window}"]) for r in rows if r["policy"] == policy)
            ax.plot(*zip(*pts), marker="x", linestyle="--", color=line.get_color())
    ax.set_xscale("log", base=2)
    counts = sorted({r["workflows"] for r in rows})
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent workflows")
    ax.set_ylabel("tasks/s" + (f" (dashed: {window})" if window else ""))
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_breakdown(rows: list[dict], path: str, title: str):
    n = max(r["workflows"] for r in rows)
    last = {r["policy"]: r for r in rows if r["workflows"] == n}
    policies = [p for p in _policies(rows) if p in last]
    x = range(len(policies))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(11, 3.4))
    a.bar(x, [last[p]["per_agent_kv_bytes"] / 2 ** 20 for p in policies], color="tab:blue")
    a.set_ylabel("KV per agent (MiB)")
    a.set_title("(a) per-agent memory", fontsize=9)
    base = [last[p]["base_hit_rate"] for p in policies]
    b.bar([i - 0.2 for i in x], base, width=0.4, label="base", color="tab:green")
    b.bar([i + 0.2 for i in x], [last[p]["residual_hit_rate"] for p in policies], width=0.4,
          label="residual", color="tab:olive")
    b.set_ylim(0, 1)
    b.set_ylabel("hit tokens / prompt tokens")
    b.set_title("(b) cache hit rate", fontsize=9)
    b.legend(fontsize=8)
    c.bar(x, [last[p]["decode_batch_size_mean"] for p in policies], color="tab:orange")
    c.set_ylabel("requests per decode step")
    c.set_title("(c) decode batch size", fontsize=9)
    for ax in (a, b, c):
        ax.set_xticks(list(x), policies, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{title}, {n} workflows", fontsize=9)
    _save(fig, path)


def _policies(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["policy"] for r in rows))  # in run order


def _save(fig, path: str):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
