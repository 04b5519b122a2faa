"""The fidelity result's plots: each policy's KL to exact and accuracy with their 95% intervals
(fidelity.png), and the hidden-state cosine to exact per layer (layer_cosine.png)."""

from __future__ import annotations

import math
import os


def plot(result: dict, out: str) -> None:
    try:  # matplotlib comes with the test extra; a serving install has the numbers without plots
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        print("no plots: matplotlib is not installed (pip install matplotlib); the numbers are in "
              + os.path.join(out, "fidelity.json"))
        return
    plot_policies(result, os.path.join(out, "fidelity.png"))
    plot_layer_cosine(result, os.path.join(out, "layer_cosine.png"))


def plot_policies(result: dict, path: str) -> None:
    """Each policy's KL to exact (log scale: the policies differ by orders of magnitude; a KL of
    exactly 0, as `prefix` has, is written at the axis' foot) and accuracy (0 to 1)."""
    plt = pyplot()
    names = list(result["policies"])
    rows = [result["policies"][n] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, key in ((axes[0], "kl"), (axes[1], "accuracy")):
        pts = [(i, r[key], r[f"{key}_ci"]) for i, r in enumerate(rows)
               if r[key] is not None and (key != "kl" or r[key] > 0)]
        if pts:
            xs, ys, cis = zip(*pts)
            err = [[y - ci[0] for y, ci in zip(ys, cis)], [ci[1] - y for y, ci in zip(ys, cis)]]
            # clipped on the log KL axis, where an interval down to 0 runs off the axes
            ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=4, clip_on=key == "kl")
        ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    positive = [v for r in rows if r["kl"] for v in (*r["kl_ci"], r["kl"]) if v > 0]
    if positive:  # whole decades, one below the smallest value to leave the foot to the zeros
        axes[0].set_ylim(10 ** (math.floor(math.log10(min(positive))) - 1),
                         10 ** math.ceil(math.log10(max(positive))))
    axes[0].yaxis.set_minor_formatter(plt.NullFormatter())
    axes[0].set_ylabel("KL(exact || policy), log scale")
    axes[0].set_xlim(-0.5, len(names) - 0.5)
    for i, r in enumerate(rows):
        if r["kl"] == 0:
            axes[0].annotate("KL = 0", (i, 0), xycoords=("data", "axes fraction"), xytext=(0, 4),
                             textcoords="offset points", ha="center", fontsize=8)
    axes[1].set_ylim(0, 1)
    axes[1].set_ylabel("task accuracy")
    if result.get("exact_accuracy") is not None:
        axes[1].axhline(result["exact_accuracy"], color="gray", ls="--", lw=1, label="exact")
        axes[1].legend(fontsize=8)
    fig.suptitle(f"{result['model']}: {result['tasks']} tasks, 95% bootstrap intervals", fontsize=9)
    save(fig, path)


def plot_layer_cosine(result: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for name, r in result["policies"].items():
        line, = ax.plot(r["layer_cosine"], label=name)
        lo, hi = zip(*r["layer_cosine_ci"])
        ax.fill_between(range(len(lo)), lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("layer (0: embeddings)")
    ax.set_ylabel("hidden-state cosine to exact")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
