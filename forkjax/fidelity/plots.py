"""The fidelity result's plots: each policy's KL to exact and accuracy with their 95% intervals
(fidelity.png), and the hidden-state cosine to exact per layer (layer_cosine.png)."""

from __future__ import annotations

import os


def plot(result: dict, out: str) -> None:
    try:  # matplotlib comes with the test extra; a serving install has the numbers without plots
        import matplotlib
    except ModuleNotFoundError:
        print("no plots: matplotlib is not installed (pip install matplotlib); the numbers are in "
              + os.path.join(out, "fidelity.json"))
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    rows = [result["policies"][n] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, key, label in ((axes[0], "kl", "KL(exact || policy)"), (axes[1], "accuracy", "task accuracy")):
        pts = [(i, r[key], r[f"{key}_ci"]) for i, r in enumerate(rows) if r[key] is not None]
        if pts:
            xs, ys, cis = zip(*pts)
            err = [[y - ci[0] for y, ci in zip(ys, cis)], [ci[1] - y for y, ci in zip(ys, cis)]]
            ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=4)
        if key == "accuracy" and result.get("exact_accuracy") is not None:
            ax.axhline(result["exact_accuracy"], color="gray", ls="--", lw=1, label="exact")
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("symlog", linthresh=1e-4)
    fig.suptitle(f"{result['model']}: {result['tasks']} tasks, 95% bootstrap intervals", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "fidelity.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for name, r in zip(names, rows):
        line, = ax.plot(r["layer_cosine"], label=name)
        lo, hi = zip(*r["layer_cosine_ci"])
        ax.fill_between(range(len(lo)), lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("layer (0: embeddings)")
    ax.set_ylabel("hidden-state cosine to exact")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "layer_cosine.png"), dpi=120)
    plt.close("all")
