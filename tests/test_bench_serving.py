"""scripts/bench_serving.py: the lengths and arrivals it draws, its roofline arithmetic, and smoke
runs on tiny-llama offline, at a request rate, in a closed loop and over HTTP."""

import importlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from forkjax.config import ModelConfig
from forkjax.models.builtin import BUILTIN_CONFIGS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))  # as when a script runs
bench = importlib.import_module("bench_serving")
serving_roofline = importlib.import_module("serving_roofline")
workload = importlib.import_module("serving_workload")

TINY = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
# Every run on one engine shape (2 adapters, 8 rows, 64-token prefill steps): the later runs reuse
# the programs the first compiles. Uniform lengths: inputs 12..36, outputs 3..9 tokens.
SMOKE = ["--model", "tiny-llama", "--num-prompts", "6", "--dataset", "uniform", "--input-len", "24",
         "--output-len", "6", "--adapters", "2", "--max-batch-size", "8", "--max-prefill-tokens", "64",
         "--dtype", "float32", "--no-warmup"]


def _args(*argv, base=SMOKE):
    args = bench.build_parser().parse_args([*base, *argv])
    bench.check_args(args)
    return args


# ---- the workload -------------------------------------------------------------------------------

def test_lengths_follow_the_dataset():
    fixed = workload.sample_requests(_args("--dataset", "fixed"), TINY)
    assert [(len(r.prompt), r.output_len) for r in fixed] == [(24, 6)] * 6
    assert [r.adapter for r in fixed] == ["lora0", "lora1"] * 3
    uniform = workload.draw_lengths(_args("--num-prompts", "2000"), np.random.default_rng(0))
    assert (uniform[0].min(), uniform[0].max(), uniform[1].min(), uniform[1].max()) == (12, 36, 3, 9)
    fixed_out = workload.draw_lengths(_args("--output-range-ratio", "0"), np.random.default_rng(0))
    assert fixed_out[0].max() > fixed_out[0].min() and set(fixed_out[1]) == {6}
    again = workload.sample_requests(_args(), TINY)  # the same seed draws the same requests
    assert [r.prompt for r in again] == [r.prompt for r in workload.sample_requests(_args(), TINY)]
    assert max(t for r in again for t in r.prompt) < 256  # no bos (256) nor eos (257)
    sharegpt = _args("--dataset", "sharegpt", "--num-prompts", "40000", base=[])
    inp, out = workload.draw_lengths(sharegpt, np.random.default_rng(0))
    for x, mean in ((inp, 161.31), (out, 337.99)):  # the vLLM paper's ShareGPT means, clipped
        assert abs(x.mean() / mean - 1) < 0.03 and x.min() >= 4 and x.max() <= 1024
    assert np.median(inp) < inp.mean()  # long-tailed
    for argv, match in ((["--dataset", "fixed", "--range-ratio", "0.2"], "--range-ratio"),
                        (["--range-ratio", "1"], "--range-ratio"), (["--num-prompts", "0"], "--num-prompts"),
                        (["--dataset", "fixed", "--output-range-ratio", "0"], "--output-range-ratio"),
                        (["--dataset", "sharegpt"], "--input-len"),
                        (["--request-rate", "0"], "--request-rate"), (["--model", "nope"], "--model")):
        with pytest.raises(ValueError, match=match):
            _args(*argv)


def test_poisson_arrivals():
    t = workload.arrival_times(20_000, 4.0, seed=3)
    assert t[0] == 0 and np.all(np.diff(t) >= 0) and abs(np.diff(t).mean() * 4 - 1) < 0.03
    assert np.array_equal(t, workload.arrival_times(20_000, 4.0, seed=3))
    assert not workload.arrival_times(5, math.inf, seed=3).any()


def test_roofline_counts_causal_query_key_pairs():
    costs = serving_roofline.StepCosts(weight_bytes=100.0, layer_params=10, head_params=3,
                                       lora_flops_per_token=4.0, kv_bytes_per_token=2.0, flops_per_pair=1.0)
    # decode, 3 rows ending at 10, 20, 30: each query reads its whole row
    (w, gemm), (kv, attn) = costs.operations(3, 3, 60)
    assert (w, gemm, kv, attn) == (100, (20 + 4) * 3 + 6 * 3, (60 + 3) * 2, 60)
    # one row computing positions 8..15: queries attend 9, 10, ..., 16 keys
    assert costs.operations(1, 8, 16)[1] == ((16 + 8) * 2, sum(range(9, 17)))
    rates = dict(copy_rate_GBps=1e-9, matmul_rate_TFLOPs=1e-12)  # 1 byte/s, 1 FLOP/s
    r = serving_roofline.roofline([[1, 3, 3, 60, 0.5], [0, 1, 8, 16, 0.25]], costs, rates)
    assert r["roofline_s"] == pytest.approx(max(100, 90) + max(126, 60) + max(100, 24 * 8 + 6) + max(48, 100))
    assert r["roofline_decode_s"] == 226 and r["device_s"] == 0.75 and r["num_steps"] == 2


# ---- smoke runs ---------------------------------------------------------------------------------

def _check_run(r, tmp_path, argv):
    with open(tmp_path / "results.json") as f:
        assert json.load(f) == json.loads(json.dumps(r))
    reqs = workload.sample_requests(_args(*argv), TINY)
    assert r["completed"] == 6 and r["failed"] == 0
    assert [(q["input_len"], q["output_len"], q["generated"]) for q in r["requests"]] == \
        [(len(s.prompt), s.output_len, s.output_len) for s in reqs]
    assert r["total_input_tokens"] == sum(len(s.prompt) for s in reqs)
    assert r["total_output_tokens"] == sum(s.output_len for s in reqs)
    assert r["output_throughput"] * r["duration_s"] == pytest.approx(r["total_output_tokens"])
    assert r["total_token_throughput"] == pytest.approx(r["input_throughput"] + r["output_throughput"])
    assert r["request_throughput"] * r["duration_s"] == pytest.approx(6)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = r[key]
        assert 0 <= d["p50"] <= d["p90"] <= d["p99"], key
    assert r["ttft_ms"]["p99"] <= r["e2el_ms"]["p99"]
    assert r["e2el_ms"]["p99"] <= r["duration_s"] * 1e3 and r["wall_s"] == r["duration_s"]
    assert r["decode_batch_size_mean"] >= 1
    if r["http"]:  # the server's steps are not logged: no roofline
        assert r["server_start_s"] > 0 and r["config"]["kv_pool_bytes"] > 0
        assert all(r[k] is None for k in ("roofline_s", "efficiency", "rates", "step_costs", "step_log"))
        return reqs
    assert 0 < r["roofline_s"] and 0 < r["efficiency"] <= 1
    assert r["rates"]["copy_rate_GBps"] > 0 and r["step_costs"]["lora_flops_per_token"] > 0
    # the step log covers every token: prompts, then each output token but the first
    computed = sum(s[2] for s in r["step_log"])
    assert computed >= r["total_input_tokens"] + r["total_output_tokens"] - 6
    return reqs


def test_offline_and_poisson_runs(tmp_path):
    r = bench.main([*SMOKE, "--out", str(tmp_path)])
    _check_run(r, tmp_path, [])
    assert r["mode"] == "offline" and r["request_rate"] is None and r["config"]["max_loras"] == 3
    assert all(q["sent_s"] == 0 for q in r["requests"])
    argv = ["--request-rate", "20", "--seed", "1"]
    r = bench.main([*SMOKE, *argv, "--out", str(tmp_path)])
    _check_run(r, tmp_path, argv)
    assert r["mode"] == "online" and r["request_rate"] == 20
    # each request's clock starts at its arrival, not when the driver got round to it
    assert [q["sent_s"] for q in r["requests"]] == pytest.approx(list(workload.arrival_times(6, 20, 1)))


def _in_flight_peak(requests):
    events = sorted([(q["sent_s"], 1) for q in requests] + [(q["last_token_s"], -1) for q in requests])
    n = peak = 0
    for _, d in events:  # a finish at the same instant as a send is counted first (-1 < 1)
        n += d
        peak = max(peak, n)
    return peak


def test_closed_loop_and_http(tmp_path):
    argv = ["--max-concurrency", "2"]
    r = bench.main([*SMOKE, *argv, "--out", str(tmp_path)])
    _check_run(r, tmp_path, argv)
    assert _in_flight_peak(r["requests"]) == 2 and r["decode_batch_size_mean"] <= 2
    # Against a `python -m forkjax.serve` process; the benchmark's own process (a fresh one here)
    # starts no JAX backend, which on a GPU would take memory from the server.
    argv = ["--http", "--request-rate", "30", "--max-concurrency", "4", "--client-procs", "2"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=os.path.join(root, ".cache", "jax"),
               PYTHONPATH=os.pathsep.join([root, os.path.join(root, "scripts")]))
    code = ("import sys, bench_serving; from jax._src import xla_bridge; bench_serving.main(sys.argv[1:]); "
            "assert not xla_bridge.backends_are_initialized(), 'the client started a JAX backend'")
    out = tmp_path / "http"
    run = subprocess.run([sys.executable, "-c", code, *SMOKE, *argv, "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    h = json.loads((out / "results.json").read_text())
    _check_run(h, out, argv)
    assert h["http"] is True and _in_flight_peak(h["requests"]) <= 4 and h.keys() == r.keys()
    assert h["config"]["max_loras"] == r["config"]["max_loras"] == 3
