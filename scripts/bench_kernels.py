"""Benchmark the attention kernels at the Llama-3-8B attention shape on one GPU.

    PYTHONPATH=. python3 scripts/bench_kernels.py --out OUT_DIR [--sweep] [--quick]

Decode: ResidualAttention (forkkv; `residual_attention_decode` as called, i.e. the Mosaic GPU
kernel where it supports the shape, and its Triton kernel beside it), the unified path (prefix /
full_reuse), jax's
`pallas.ops.gpu.paged_attention` on the same unified cache, and a naive path that rebuilds the
merged K/V in HBM and then attends. Extend: 2k new tokens over 0 / 8k / 32k cached tokens.
Ceilings measured in the same run: device copy bandwidth and a bf16 matmul rate.

Times are medians of CUPTI kernel-time sums per call (every kernel the call launches, the split
combine and table set-up included); wall-clock timing is the fallback where CUPTI is missing.
Small caches would sit in the 60 MB L2 across repetitions, so each timed call runs the kernel
over several disjoint page-table sets (>= 256 MB of cache in all) and reports the time per set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import traceback

import jax

import timing  # scripts/ is on sys.path when this script runs
from provenance import run_info  # scripts/ is on sys.path when this script runs
from forkjax.pallas_kernels import (MosaicConfig, TritonConfig, residual_attention_extend,
                                    unified_attention_extend)
from forkjax.pallas_kernels.tuning import sm_count
from kernel_cases import (DT, decode_bytes, decode_fns, extend_flops, make_decode, make_extend,
                          n_sets_for, options, residual_config_class)

LOG = []
SMOKE = False  # --smoke: tiny sizes in interpret mode on the CPU, to check this script


def log(msg):
    print(msg, flush=True)
    LOG.append(msg)


# ------------------------------------------------------------------ timing


def time_ms(f, args, iters=20):
    """Median ms per call of f(*args) (timing.time_ms; one wall-clock pass with --smoke)."""
    return timing.time_ms(f, args, iters, quick=SMOKE, log=log)


def matmul_rate(n=8192):
    n = 256 if SMOKE else n
    k1, k2 = jax.random.split(jax.random.key(1))
    a = jax.random.normal(k1, (n, n), DT)
    b = jax.random.normal(k2, (n, n), DT)
    f = jax.jit(lambda x, y: x @ y)
    ms, how = time_ms(f, (a, b))
    return 2 * n**3 / (ms * 1e-3), ms, how


# ------------------------------------------------------------------ sections


def bench_decode_point(B, L, methods, cfg_res, cfg_uni, peak_bw):
    n_sets = n_sets_for(B, L)
    d = make_decode(B, L, n_sets)
    fns = decode_fns(cfg_res, cfg_uni, SMOKE)
    row = {"B": B, "L": L, "n_sets": n_sets}
    for name in methods:
        try:
            f = jax.jit(fns[name])
            ms, how = time_ms(f, (d,), iters=10)
            ms /= n_sets
            nbytes = decode_bytes(B, L, name in ("residual", "triton_residual", "naive"))
            row[name] = {"ms": ms, "bytes": nbytes, "tbps": nbytes / (ms * 1e-3) / 1e12,
                         "frac_copy": nbytes / (ms * 1e-3) / peak_bw, "timer": how}
        except Exception as e:  # noqa: BLE001
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(traceback.format_exc()[-1500:])
    del d
    return row


def fmt_decode(row):
    parts = [f"B={row['B']:4d} L={row['L']:6d}"]
    for k in ("residual", "triton_residual", "unified", "jax_paged", "naive"):
        v = row.get(k)
        if v is None:
            continue
        if "error" in v:
            parts.append(f"{k}=ERR")
        else:
            parts.append(f"{k}={v['ms'] * 1e3:8.1f}us({v['frac_copy'] * 100:4.0f}%)")
    if "residual" in row and "unified" in row and "ms" in row["residual"] and "ms" in row["unified"]:
        parts.append(f"res/uni={row['residual']['ms'] / row['unified']['ms']:.2f}")
    return " ".join(parts)


def bench_extend_point(prefix, T, cfg_res, cfg_uni, peak_flops):
    d = make_extend(prefix, T)
    res = jax.jit(lambda d: residual_attention_extend(
        d["q"], d["kb"], d["vb"], d["kr"], d["vr"], d["bpt"], d["rpt"], d["prefix"], d["chunk"],
        d["bk"], d["bv"], d["aid"], d["inv_freq"], config=cfg_res, interpret=SMOKE))
    uni = jax.jit(lambda d: unified_attention_extend(
        d["q"], d["kb"], d["vb"], d["bpt"], d["prefix"], d["chunk"], config=cfg_uni,
        interpret=SMOKE))
    row = {"prefix": prefix, "T": T, "flops": extend_flops(prefix, T)}
    for name, f in (("residual", res), ("unified", uni)):
        try:
            ms, how = time_ms(f, (d,))
            tf = row["flops"] / (ms * 1e-3)
            row[name] = {"ms": ms, "tflops": tf / 1e12, "frac_mm": tf / peak_flops, "timer": how}
        except Exception as e:  # noqa: BLE001
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(traceback.format_exc()[-1500:])
    return row


def fmt_extend(row):
    parts = [f"T={row['T']} prefix={row['prefix']:6d}"]
    for k in ("residual", "unified"):
        v = row[k]
        parts.append(f"{k}=ERR" if "error" in v else
                     f"{k}={v['ms']:.3f}ms {v['tflops']:.0f}TF/s({v['frac_mm'] * 100:.0f}%)")
    return " ".join(parts)


def sweep_decode(B, L, grid, method, peak_bw):
    """Time `method` under each config in grid at one (B, L); return sorted [(ms, cfg)]."""
    n_sets = n_sets_for(B, L)
    d = make_decode(B, L, n_sets)
    out = []
    for cfg in grid:
        fns = decode_fns(cfg, cfg, SMOKE)
        try:
            ms, _ = time_ms(jax.jit(fns[method]), (d,), iters=6)
            ms /= n_sets
            out.append((ms, cfg))
            frac = decode_bytes(B, L, method.endswith("residual")) / (ms * 1e-3) / peak_bw
            log(f"  sweep {method} B={B} L={L} {options(cfg)}: {ms * 1e3:.1f} us "
                f"({frac * 100:.0f}%)")
        except Exception as e:  # noqa: BLE001
            log(f"  sweep {method} {options(cfg)}: ERR {type(e).__name__}: {str(e)[:200]}")
    del d
    return sorted(out, key=lambda t: t[0])


def sweep_extend(prefix, T, grid, method, peak_flops):
    d = make_extend(prefix, T)
    out = []
    for cfg in grid:
        if method == "residual":
            f = jax.jit(lambda d, cfg=cfg: residual_attention_extend(
                d["q"], d["kb"], d["vb"], d["kr"], d["vr"], d["bpt"], d["rpt"], d["prefix"],
                d["chunk"], d["bk"], d["bv"], d["aid"], d["inv_freq"], config=cfg,
                interpret=SMOKE))
        else:
            f = jax.jit(lambda d, cfg=cfg: unified_attention_extend(
                d["q"], d["kb"], d["vb"], d["bpt"], d["prefix"], d["chunk"], config=cfg,
                interpret=SMOKE))
        try:
            ms, _ = time_ms(f, (d,), iters=6)
            out.append((ms, cfg))
            log(f"  sweep extend {method} prefix={prefix} {options(cfg)}: {ms:.3f} ms "
                f"({extend_flops(prefix, T) / (ms * 1e-3) / peak_flops * 100:.0f}% of matmul)")
        except Exception as e:  # noqa: BLE001
            log(f"  sweep extend {method} {options(cfg)}: ERR {type(e).__name__}: {str(e)[:200]}")
    return sorted(out, key=lambda t: t[0])


def run_sweeps(B0, L0, LX, TX, bw, mm, results):
    """Pick block sizes / formulations at B=32, L=8k (decode) and 2k over 8k (extend)."""
    res_grid = [TritonConfig(block_k=bk, num_warps=4, num_stages=2, swap_ab=True)
                for bk in (64, 32)]
    uni_grid = [TritonConfig(block_k=64, num_warps=4, num_stages=ns, swap_ab=False)
                for ns in (3, 4)]
    if SMOKE:
        res_grid, uni_grid = res_grid[1:2], uni_grid[1:2]
    best_r = sweep_decode(B0, L0, res_grid, "residual", bw)
    best_u = sweep_decode(B0, L0, uni_grid, "unified", bw)
    best_k1 = []
    results["sweep_decode"] = {"residual": best_r, "unified": best_u, "splits_b1": best_k1}
    egrid_u = [TritonConfig(block_q=bq, block_k=bk, num_warps=nw, swap_ab=False)
               for bq, bk, nw in [(32, 64, 4), (64, 64, 8)]]
    # Residual extend: on-chip reconstruction, or merged K/V rebuilt in HBM + unified kernel.
    egrid_r = ([TritonConfig(block_q=16, block_k=32, num_warps=4, swap_ab=False,
                             reconstruct_k=True, materialize=False)]
               + [dataclasses.replace(g, materialize=True) for g in egrid_u])
    if SMOKE:
        egrid_r, egrid_u = egrid_r[:1], egrid_u[:1]
    best_er = sweep_extend(LX, TX, egrid_r, "residual", mm)
    best_eu = sweep_extend(LX, TX, egrid_u, "unified", mm)
    results["sweep_extend"] = {"residual": best_er, "unified": best_eu}
    return tuple(best[0][1] if best else None for best in (best_r, best_u, best_er, best_eu))


def run_split_sweep(bw, results):
    """k_splits at the benchmark point (B=32, L=8k) and at the engine's decode shape (B=64, 2k),
    the residual decode's in the config of the backend its automatic choice runs."""
    points = ((2, 512, (1, 2)),) if SMOKE else ((32, 8192, (2, 4, 8)), (64, 2048, (1, 2, 4)))
    kind = {"residual": residual_config_class(SMOKE), "unified": TritonConfig}
    results["sweep_splits"] = {
        f"{method} B={B} L={L}": sweep_decode(B, L, [kind[method](k_splits=k) for k in splits],
                                              method, bw)
        for B, L, splits in points for method in ("residual", "unified")}


def run_breakdown(results):
    """Per-kernel CUPTI times of one decode call (median over calls): the attention kernel
    against the XLA work around it (padding, the K-LoRA operands, the combine)."""
    from jax.experimental.mosaic.gpu import profiler

    results["breakdown"] = {}
    for B, L in ((2, 512),) if SMOKE else ((32, 8192), (64, 2048)):
        d = make_decode(B, L, n_sets_for(B, L))
        for method in ("mgpu_residual", "unified"):
            f = jax.jit(decode_fns(interpret=SMOKE)[method])
            _, runs = profiler.measure(f, aggregate=False, iterations=7)(d)
            per_kernel = [(name, statistics.median(run[k][1] for run in runs) * 1e3)
                          for k, (name, _) in enumerate(runs[0])]
            results["breakdown"][f"{method} B={B} L={L}"] = per_kernel
            log(f"breakdown {method} B={B} L={L}: total "
                f"{sum(us for _, us in per_kernel):.1f} us per call of {d['bpt'].shape[0]} set(s)")
            for name, us in sorted(per_kernel, key=lambda t: -t[1]):
                log(f"  {us:8.1f} us  {name[:80]}")
        del d


def run_mgpu_sweep(bw, results):
    """Mosaic GPU decode kernels over (stages, consumers, k_splits), Triton defaults beside."""
    points = ((2, 512),) if SMOKE else ((32, 8192), (64, 2048))
    grids = {"mgpu_unified": [MosaicConfig(stages=st, consumers=c, k_splits=1)
                              for st, c in ((3, 1), (4, 2))],
             # shared memory allows 3 stages with one attention warpgroup, 2 with two (Llama-3-8B
             # shape); then fewer CTAs than items (each runs several in turn)
             "mgpu_residual": [MosaicConfig(stages=st, consumers=c, k_splits=ks)
                               for st, c, ks in ((3, 1, 1), (3, 1, 2), (2, 1, 1), (2, 2, 1))]
             + [MosaicConfig(stages=3, consumers=1, k_splits=ks, ctas=sm_count())
                for ks in (1, 2)]}
    results["sweep_mgpu"] = {}
    for B, L in points:
        for method in ("unified", "mgpu_unified", "triton_residual", "mgpu_residual"):
            cfgs = grids.get(method, [None])
            results["sweep_mgpu"][f"{method} B={B} L={L}"] = sweep_decode(B, L, cfgs, method, bw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--sweep", action="store_true", help="tune block sizes first")
    ap.add_argument("--quick", action="store_true", help="B=32 L=8k and extend 8k only")
    ap.add_argument("--split-sweep", action="store_true",
                    help="only time decode over k_splits (B=32 L=8k, B=64 L=2k)")
    ap.add_argument("--mgpu", action="store_true",
                    help="only time the Mosaic GPU decode kernels (B=32 L=8k, B=64 L=2k)")
    ap.add_argument("--breakdown", action="store_true",
                    help="only per-kernel CUPTI times of one decode call (GPU; B=32 L=8k, B=64 L=2k)")
    ap.add_argument("--smoke", action="store_true", help="tiny, interpret mode (CPU check)")
    args = ap.parse_args()
    global SMOKE
    SMOKE = args.smoke
    os.makedirs(args.out, exist_ok=True)
    results = run_info(__file__)

    def save():
        with open(os.path.join(args.out, "bench_kernels.json"), "w") as fh:
            json.dump(results, fh, indent=1,
                      default=lambda x: options(x) if dataclasses.is_dataclass(x) else str(x))
        with open(os.path.join(args.out, "bench_kernels.log"), "w") as fh:
            fh.write("\n".join(LOG) + "\n")

    tbw = None if SMOKE else timing.torch_copy_bandwidth(log=log)  # before JAX takes the memory
    if tbw:
        log(f"  torch copy_ float32 4 GiB: {tbw / 1e12:.2f} TB/s")
    bw, ms, how = timing.copy_bandwidth(quick=SMOKE, log=log)
    bw = max(bw, tbw or 0.0)
    log(f"copy bandwidth (best of the above) {bw / 1e12:.2f} TB/s")
    results["torch_copy_bw"] = tbw
    mm, ms, how = matmul_rate()
    log(f"bf16 matmul 8192^3 {mm / 1e12:.0f} TFLOP/s ({ms:.3f} ms, {how})")
    results.update(copy_bw=bw, matmul_flops=mm)
    save()

    cfg_res = cfg_uni = cfg_res_ext = cfg_uni_ext = None  # None: the tuned defaults
    B0, L0, LX, TX = (2, 512, 256, 64) if SMOKE else (32, 8192, 8192, 2048)
    if args.breakdown:
        run_breakdown(results)
        save()
        return
    if args.split_sweep or args.mgpu:
        (run_mgpu_sweep if args.mgpu else run_split_sweep)(bw, results)
        save()
        return
    if args.sweep:
        cfg_res, cfg_uni, cfg_res_ext, cfg_uni_ext = run_sweeps(B0, L0, LX, TX, bw, mm, results)
        save()
    results["configs"] = dict(decode_res=options(cfg_res), decode_uni=options(cfg_uni),
                              extend_res=options(cfg_res_ext), extend_uni=options(cfg_uni_ext))
    log(f"configs ({{}}: the tuned defaults): {results['configs']}")

    points = [(B0, L0)] if args.quick or SMOKE else [(b, l) for b in (1, 8, 32, 128)
                                                          for l in (1024, 8192, 32768)]
    results["decode"] = []
    for B, L in points:
        row = bench_decode_point(B, L, ("residual", "triton_residual", "unified", "jax_paged",
                                        "naive"), cfg_res, cfg_uni, bw)
        results["decode"].append(row)
        log(fmt_decode(row))
        save()

    results["extend"] = []
    for prefix in ((LX,) if args.quick or SMOKE else (0, 8192, 32768)):
        row = bench_extend_point(prefix, TX, cfg_res_ext, cfg_uni_ext, mm)
        results["extend"].append(row)
        log(fmt_extend(row))
        save()
    save()


if __name__ == "__main__":
    main()
