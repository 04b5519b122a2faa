"""When the device idles during decode: a jax.profiler timeline of a few engine steps.

    PYTHONPATH=. python3 scripts/diag_engine_timeline.py --batch 64 --out $OUT

Brings `batch` requests to steady decode (as diag_engine_step.py does), traces a few steps with
the host's parts of each step annotated (schedule, launch = inputs + jit call, fetch = waiting for
the step's tokens, postprocess), and summarises the trace: how long the GPU streams are busy per
step, and the longest idle gaps with what the host was doing when each began. Writes the summary
to diag_engine_timeline_<policy>_b<batch>.json and the trace itself (trace.json.gz) under --out.
A diagnostic for the overlap of host and device work (issue 5), not a benchmark.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import shutil
import time

import jax

from diag_engine_step import engine_args, steady_engine  # scripts/ is on sys.path when this script runs


def annotate(obj, name: str, label: str):
    """Wrap obj.name so each call shows as a host event `label` in the trace."""
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        with jax.profiler.TraceAnnotation(label):
            return fn(*a, **k)

    setattr(obj, name, wrapped)


def busy_intervals(events):
    """Merge [start, end) µs intervals."""
    out = []
    for s, e in sorted(events):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def summarise(trace: dict, gap_us: float) -> dict:
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    per_thread = collections.Counter((procs.get(e["pid"], "?"), threads.get((e["pid"], e["tid"]), "?"))
                                     for e in spans)
    # Kernels and copies are on the GPU's "Stream" threads (other device lines repeat them).
    on_gpu = [e for e in spans if "GPU" in procs.get(e["pid"], "")
              and "Stream" in threads.get((e["pid"], e["tid"]), "")]
    device = [(e["ts"], e["ts"] + e["dur"]) for e in on_gpu]
    host = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in spans
                  if e["name"].startswith("fj_"))
    launches = [h for h in host if h[2] == "fj_launch"]
    if not device or len(launches) < 2:
        return dict(threads=per_thread.most_common(30), error="no device or launch events")
    t0, t1 = launches[0][0], launches[-1][0]  # whole steps: from one launch to the last
    busy = [(max(s, t0), min(e, t1)) for s, e in busy_intervals(device) if e > t0 and s < t1]
    gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    long_gaps = sorted((g for g in gaps if g[1] - g[0] >= gap_us), key=lambda g: g[0] - g[1])

    def host_at(t):
        return [name for s, e, name in host if s <= t < e] or ["(none)"]

    steps = len(launches) - 1
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for e in on_gpu:
        if t0 <= e["ts"] < t1:
            kernels[e["name"]][0] += 1
            kernels[e["name"]][1] += e["dur"]
    return dict(
        steps=steps, step_us=(t1 - t0) / steps,
        one_layer=one_layer([e for e in on_gpu if t0 <= e["ts"] < t1], t0),
        device_busy_us_per_step=sum(e - s for s, e in busy) / steps,
        idle_us_per_step=sum(e - s for s, e in gaps) / steps,
        idle_in_gaps_over_threshold_us_per_step=sum(e - s for s, e in long_gaps) / steps,
        host_us_per_step={name: sum(e - s for s, e, n in host if n == name and t0 <= s < t1) / steps
                          for name in sorted({h[2] for h in host})},
        launch_starts_us=[round(s - t0, 1) for s, _, _ in launches],
        launch_ends_us=[round(e - t0, 1) for _, e, _ in launches],
        longest_gaps=[dict(at_us=round(s - t0, 1), us=round(e - s, 1), host=host_at(s))
                      for s, e in long_gaps[:25]],
        kernels_us_per_step=[(name, n / steps, round(us / steps, 1)) for name, (n, us)
                             in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:40]],
        threads=per_thread.most_common(30))


def one_layer(kernels, t0) -> list:
    """The kernels from one attention kernel to the next (a decoder layer, in the middle of a
    step): (start µs from the step's launch, name, µs, idle µs before it). The attention kernel
    is the costliest kernel name's calls of at least half its longest call (Mosaic GPU kernels
    all share one name: the K/V write is another)."""
    kernels = sorted(kernels, key=lambda e: e["ts"])
    totals = collections.Counter()
    for e in kernels:
        totals[e["name"]] += e["dur"]
    attn = max(totals, key=totals.get)
    longest = max(e["dur"] for e in kernels if e["name"] == attn)
    at = [i for i, e in enumerate(kernels) if e["name"] == attn and e["dur"] >= longest / 2]
    if len(at) < 4:
        return []
    lo, hi = at[2], at[3]
    out, end = [], kernels[lo]["ts"]
    for e in kernels[lo:hi + 1]:
        out.append((round(e["ts"] - t0, 1), e["name"][:90], round(e["dur"], 1),
                    round(max(e["ts"] - end, 0.0), 1)))
        end = max(end, e["ts"] + e["dur"])
    return out


def main():
    ap = engine_args()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--gap-us", type=float, default=20.0, help="idle gaps listed from this long")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    engine = steady_engine(args)
    annotate(engine.scheduler, "schedule", "fj_schedule")
    annotate(engine.runner, "launch", "fj_launch")
    annotate(engine.runner, "fetch", "fj_fetch")
    annotate(engine, "_postprocess", "fj_postprocess")
    log_dir = os.path.join("/tmp", f"fj_trace_{os.getpid()}")
    walls = []
    with jax.profiler.trace(log_dir):
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            walls.append((time.perf_counter() - t) * 1e3)
    path, = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    with gzip.open(path) as f:
        summary = summarise(json.load(f), args.gap_us)
    summary.update(batch=args.batch, context=args.context, policy=args.policy,
                   overlap=engine.overlap, step_wall_ms=walls,
                   xla_flags=os.environ.get("XLA_FLAGS", ""))
    print(json.dumps({k: v for k, v in summary.items()
                      if k not in ("threads", "longest_gaps", "one_layer")}))
    for row in summary.get("one_layer", []):
        print(*row, sep="\t")
    tag = f"{args.policy}_b{args.batch}{'_sync' if args.no_overlap else ''}"
    with open(os.path.join(args.out, f"diag_engine_timeline_{tag}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    shutil.copy(path, os.path.join(args.out, f"trace_{tag}.json.gz"))


if __name__ == "__main__":
    main()
