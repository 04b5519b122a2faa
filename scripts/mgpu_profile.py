"""Per-warpgroup timeline of the Mosaic GPU residual decode kernel (GPU only).

Runs `mgpu_residual_decode` with `profile_dir`, so Mosaic GPU records the kernel's named scopes
(`c_*` attention warpgroup, `kl_*` K-LoRA, `prod_*` producer) per warpgroup per CTA, and sums the
trace: for each warpgroup the mean time per step in each scope and the rest of the step (its
own math). A short context (L=1152, 18 steps) keeps every range inside the shared-memory trace
buffer; longer ones (or CTAs running several items) record their first ~20 steps, and the means
are per recorded step. The profiler's own cost is large: a step takes ~2.5 µs profiled at B=64,
L=2k against ~1.3 µs unprofiled (fourteenth session), so read the waits, not the step time.
Usage: PYTHONPATH=. python3 scripts/mgpu_profile.py --out $OUT [--configs JSON]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile

import jax
import numpy as np

import bench_kernels as bk
from forkjax.pallas_kernels.mgpu_decode import mgpu_residual_decode

ROLES = {"c": "attention", "kl": "k_lora", "prod": "producer"}


def summarize(trace_file: str) -> dict:
    """{role: {scope: mean us per CTA, "span": mean us from first to last event, "steps": mean
    ring steps recorded per CTA}}. Steps are counted from the recorded ranges (the role's most
    frequent scope), so a trace cut short by the buffer, or a CTA running several items, still
    gives per-step means."""
    events = json.load(open(trace_file))["traceEvents"]
    per_tid = collections.defaultdict(list)
    for e in events:
        per_tid[e["tid"]].append(e)
    totals = collections.defaultdict(lambda: collections.defaultdict(list))
    for evs in per_tid.values():
        open_at, sums, counts = {}, collections.Counter(), collections.Counter()
        for e in evs:
            if e["ph"] == "B":
                open_at[e["name"]] = e["ts"]
            elif e["name"] in open_at:
                sums[e["name"]] += e["ts"] - open_at.pop(e["name"])
                counts[e["name"]] += 1
        if not sums:
            continue
        prefixes = {name.split("_")[0] for name in sums} & ROLES.keys()  # (and Mosaic's "Init")
        if len(prefixes) != 1:
            continue
        role = ROLES[prefixes.pop()]
        totals[role]["span"].append(evs[-1]["ts"] - evs[0]["ts"])
        totals[role]["steps"].append(max(counts.values()))
        for name, t in sums.items():
            totals[role][name].append(t)
    return {role: {k: float(np.mean(v)) for k, v in d.items()} for role, d in totals.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=1152)
    ap.add_argument("--configs", default='[{"stages": 3}]')
    ap.add_argument("--keep-traces", action="store_true", help="gzipped Perfetto traces in --out")
    args = ap.parse_args()
    d = bk.make_decode(args.batch, args.length, 1)
    results = {}
    for cfg in json.loads(args.configs):
        if "skip" in cfg:  # a static argument: hashable
            cfg["skip"] = tuple(cfg["skip"])
        with tempfile.TemporaryDirectory() as tmp:
            f = jax.jit(lambda d, cfg=cfg, tmp=tmp: mgpu_residual_decode(
                d["q"], d["kb"], d["vb"], d["kr"], d["vr"], d["bpt"][0], d["rpt"][0],
                d["lengths"], d["bk"], d["bv"], d["aid"], d["inv_freq"], profile_dir=tmp,
                **cfg))
            for _ in range(2):  # the first call compiles; keep the second trace
                jax.block_until_ready(f(d))
            jax.effects_barrier()
            trace = sorted(glob.glob(os.path.join(tmp, "*-trace.json")))[-1]
            s = summarize(trace)
            if args.keep_traces:
                with open(trace, "rb") as src, gzip.open(os.path.join(
                        args.out, f"trace{len(results)}.json.gz"), "wb") as dst:
                    dst.write(src.read())
        key = json.dumps(cfg, sort_keys=True)
        results[key] = s
        print(key)
        for role, d_ in s.items():
            steps = d_["steps"]
            parts = " ".join(f"{k}={v / steps * 1e3:.0f}ns" for k, v in sorted(d_.items())
                             if k not in ("span", "steps"))
            print(f"  {role:9s} span {d_['span']:.1f} us over {steps:.0f} steps "
                  f"({d_['span'] / steps * 1e3:.0f}ns a step)  per step: {parts}")
    with open(os.path.join(args.out, "mgpu_profile.json"), "w") as f:
        json.dump({"batch": args.batch, "length": args.length, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
