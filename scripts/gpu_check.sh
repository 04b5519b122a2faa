#!/usr/bin/env bash
# One device-tool command for a session's GPU check: the kernel and engine tests, the kernel
# sweep at B=32 L=8k (picks the fastest decode formulation), the engine benchmark with and
# without k_prepass. Writes 7 files under $OUT (the device tool returns at most 8). ~10 min.
#
#   bash scripts/gpu_check.sh          # from the repository root, on the GPU machine
set -u
: "${OUT:?set OUT to the output folder}"
export PYTHONPATH=.
run() {  # run <seconds> <log name> <command...>: time-boxed, log under $OUT, one summary line
    local limit=$1 log=$2
    shift 2
    timeout "$limit" "$@" > "$OUT/$log" 2>&1
    echo "$log: rc=$? $(grep -E 'passed|failed|error' "$OUT/$log" | tail -1)"
}
run 190 tests.log python3 -m pytest -q tests/test_residual_attention.py tests/test_engine_pallas.py
timeout 150 python3 scripts/bench_kernels.py --sweep --quick --out "$OUT" > /dev/null 2>&1
echo "bench_kernels: rc=$?"  # it writes bench_kernels.json and bench_kernels.log
grep -E "sweep|^B=|^T=|configs" "$OUT/bench_kernels.log"
for opt in "" --k-prepass; do
    run 115 "engine$opt.log" python3 scripts/bench_engine.py --batches 1,16,64 --steps 12 $opt \
        --out "$OUT/engine$opt.json"
    python3 - "$OUT/engine$opt.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for d in r["decode"]:
    print(f"B={d['batch']} step {d['step_ms']:.2f} ms = {d['ratio']:.2f}x roofline, host "
          f"{d['host_share'] * 100:.1f}%, dispatch {d['dispatch_share'] * 100:.0f}%")
print("prefill", r.get("prefill"), "copy GB/s", round(r["copy_bandwidth_GBps"]))
PY
done
