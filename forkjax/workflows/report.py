"""What a workflow benchmark run reports: the line it prints per point, its results.json, and for
a sweep summary.csv with the Fig. 11 and Fig. 14 plots (plots.py), rewritten after every point."""

from __future__ import annotations

import csv
import json
import os

from forkjax.workflows.plots import plot_breakdown, plot_throughput

# summary.csv's columns; results.json holds every key of a point
SUMMARY = ("policy", "replicas", "route", "workflows", "total", "max_batch_size", "session_hints",
           "tasks_per_s", "tasks_per_s_steady", "tasks_per_s_sustained", "tokens_per_s", "per_agent_kv_bytes",
           "base_hit_rate", "residual_hit_rate", "decode_batch_size_mean", "workflows_running_peak",
           "prefill_tokens_computed", "prefill_tokens_minimal", "recompute_ratio", "preemptions",
           "latency_p50_s", "compile_s", "build_s", "server_start_s", "wall_s")


def summary_line(row: dict) -> str:
    def f(key, spec):
        return "n/a" if row.get(key) is None else format(row[key], spec)
    # over HTTP the server's start-up (weights and warm-up) is timed, not its compiles
    start = (f"server start {row['server_start_s']:.1f} s" if row.get("server_start_s") is not None
             else f"compile {row['compile_s']:.1f} s {row['compile_breakdown']}" if row.get("compile_s") is not None
             else f"{row.get('replicas')} running replicas")  # --router: a cluster started beforehand
    replicas = f"{row['replicas']} replicas ({row['route']}) " if row.get("route") else ""
    return (f"{'replay ' if row.get('replay') else ''}{replicas}{row['pattern']} {row['policy']} "
            f"x{row['workflows']} ({row['total']} in all): {row['tasks_per_s']:.3f} tasks/s, steady "
            f"{f('tasks_per_s_steady', '.3f')}, sustained {f('tasks_per_s_sustained', '.3f')}, "
            f"{row['tokens_per_s']:.1f} tok/s, KV/agent {row['per_agent_kv_bytes'] / 2**20:.2f} MiB, "
            f"hit base {row['base_hit_rate']:.3f} residual {row['residual_hit_rate']:.3f}, decode batch "
            f"{f('decode_batch_size_mean', '.1f')} (max {row['max_batch_size']}), workflows running "
            f"peak {row.get('workflows_running_peak')}, prefill {row.get('prefill_tokens_computed')} tok"
            f" / minimal {row['prefill_tokens_minimal']} = {f('recompute_ratio', '.3f')}, "
            f"{row.get('preemptions')} preemptions, {row.get('workflows_suspended')} workflows suspended "
            f"(run {row['wall_s']:.1f} s, {start})")


def write_json(path: str, obj: dict):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def write_summary(out: str, rows: list[dict], title: str):
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot_throughput(rows, os.path.join(out, "throughput.png"), title)
    plot_breakdown(rows, os.path.join(out, "breakdown.png"), title)
