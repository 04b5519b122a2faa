"""How many key splits the Mosaic residual decode should default to below one item an SM.

    PYTHONPATH=. python3 scripts/diag_decode_splits.py --out $OUT

With fewer (batch row, KV head) items than SMs the keys are split so that every SM works, one
CTA an SM (shared memory). Rounding the splits up (ceil(132 / items)) launches a few more CTAs
than SMs: a second wave of 4 CTAs at B=1 (136 CTAs), of 60 at B=8 (192), each as long as the
first. Rounding down (132 // items; the default since the seventeenth session) launches at most
one wave, with up to a split's worth of SMs idle. Times `mgpu_residual_decode` both ways (`bench_kernels.sweep_decode`: CUPTI sums of a
call's kernels, medians, Llama-3-8B heads, rank 16) -> $OUT/diag_decode_splits.json.
"""

import argparse
import json
import os

import bench_kernels as bk  # scripts/ is on sys.path when this script runs

SMS = 132
SHAPES = [(1, 2048), (1, 8192), (1, 32768), (2, 8192), (4, 8192), (4, 32768), (8, 8192),
          (8, 32768), (12, 8192), (16, 2048), (16, 8192)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="diag_out")
    args = ap.parse_args()
    rows = []
    for B, L in SHAPES:
        items, blocks = B * bk.HKV, L // 64
        ways = {"up": min(-(-SMS // items), blocks), "down": max(1, min(SMS // items, blocks))}
        times = {}
        for rep in range(2):
            for way, ks in ways.items():
                for ms, _ in bk.sweep_decode(B, L, [{"k_splits": ks}], "mgpu_residual", 4.3e12):
                    times.setdefault(way, []).append(round(ms * 1e3, 1))
        rows.append(dict(B=B, L=L, splits=ways, us=times))
        print(f"B={B:3d} L={L:6d} " + "  ".join(
            f"{way} {ways[way]:2d} splits ({items * ways[way]} CTAs): {times.get(way)} us"
            for way in ways), flush=True)
        with open(os.path.join(args.out, "diag_decode_splits.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
