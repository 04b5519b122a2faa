"""The model-free replay (forkjax/workflows/replay.py): its step costs reproduce the H200 rows
they come from, it runs on virtual time, and at Llama-3.1-8B's geometry (16 GB of K/V, max batch
64) 32 ReAct workflows keep at least the throughput of 16 under every cache policy."""

import time

import pytest

from conftest import bench_workflows
from forkjax.config import ModelConfig
from forkjax.models.builtin import BUILTIN_CONFIGS
from forkjax.workflows import TokenSampler, agent_names, fixed_profile, make_workflows
from forkjax.workflows.driver import run_in_process
from forkjax.workflows.replay import DECODE_ROWS, DECODE_TOKENS, PREFILL, ReplayEngine

MODEL = "llama3.1-8b-random"
TOKENS = TokenSampler.for_model(ModelConfig.from_hf(BUILTIN_CONFIGS[MODEL]))
REACT = ["--replay", "--model", MODEL, "--pattern", "react", "--context", "4096", "--gen", "64",
         "--obs", "64"]


class _Batch:
    def __init__(self, kind, lengths=(), chunks=()):
        self.kind, self.seqs, self.chunks = kind, [[0] * n for n in lengths], list(chunks)


def test_step_costs_reproduce_their_h200_rows():
    cost = ReplayEngine(MODEL, agent_names("react")).cost  # forkkv: the rows' policy
    for batch, seconds in DECODE_ROWS:
        step = cost.step_s(_Batch("decode", [DECODE_TOKENS] * batch))
        assert abs(step / seconds - 1) < 0.05, (batch, step, seconds)
    tokens, seconds, chunk = PREFILL
    steps = [(s, min(s + chunk, tokens)) for s in range(0, tokens, chunk)]
    prefill = sum(cost.step_s(_Batch("extend", chunks=[c])) for c in steps)
    assert abs(prefill / seconds - 1) < 1e-6
    # Context is read at decode: a longer one costs more, a prefix pool reads no residual.
    assert cost.step_s(_Batch("decode", [8192])) > cost.step_s(_Batch("decode", [1024]))
    assert ReplayEngine(MODEL, ["a"], cache_policy="prefix").cost.kv_bytes_per_token < cost.kv_bytes_per_token


def test_replay_runs_on_virtual_time():
    engine = ReplayEngine(MODEL, agent_names("react"), max_model_len=2048)
    engine.metrics.record_steps()
    prof = fixed_profile(512, 16, 16, 4)
    wall = time.perf_counter()
    result = run_in_process(engine, make_workflows("react", 2, prof, TOKENS, rounds=2,
                                                   tool_latency=5.0),
                            progress=False, clock=engine.clock, sleep=engine.sleep)
    assert time.perf_counter() - wall < 10
    # Five 5-second tool calls a workflow, on the virtual clock.
    assert 25 < result.last_finish_s < 30 and engine.clock() >= result.last_finish_s
    stats = engine.stats()
    assert stats["decode_steps"] > 0 and stats["workflows_running_peak"] == 2
    assert stats["prefill_tokens_computed"] > 0 and engine.describe()["replay"] is True
    # The step log holds each step's modelled seconds: they add up to the device time, and its
    # decode steps are the ones the stats count.
    log = engine.metrics.record_steps(False)
    assert sum(s[4] for s in log) == pytest.approx(engine.metrics.step_times["device_s"])
    decode = [s for s in log if s[0] == 1]
    assert len(decode) == stats["decode_steps"] and all(s[2] == s[1] for s in decode)
    assert sum(s[1] for s in decode) / len(decode) == pytest.approx(stats["decode_batch_size_mean"])
    assert engine.metrics.step_log is None


@pytest.mark.parametrize("policy", ["prefix", "full_reuse", "forkkv", "lrshared", "forkkv+fanout"])
def test_replay_32_workflows_are_no_slower_than_16(tmp_path, policy):
    rows = bench_workflows().main([*REACT, "--sweep", "16,32", "--total", "3x", "--policy", policy,
                          "--out", str(tmp_path)])
    by = {r["workflows"]: r for r in rows}
    for r in rows:
        assert r["replay"] is True and r["max_batch_size"] == 64 and r["kv_cache_bytes"] == int(16e9)
        assert r["total"] == 3 * r["workflows"] and r["recompute_ratio"] <= 1.10
        assert r["step_cost"]["decode_fixed_s"] > 0
    # The steady state: the sustained figure (results.py), which workflows finishing in bursts
    # moves little, unlike the steady window's whole-workflow count.
    assert by[32]["tasks_per_s_sustained"] >= 0.95 * by[16]["tasks_per_s_sustained"], \
        {n: (r["tasks_per_s_sustained"], r["tasks_per_s_steady"], r["tasks_per_s"]) for n, r in by.items()}


def test_replay_64_prefix_workflows_wait_at_the_gate_past_max_wait_s(tmp_path):
    """Under `prefix` 7 of 64 workflows fit: the others wait at the gate for longer than
    max_wait_s (60 s) and, urgent, still go in only as admitted ones end, so 64 slots run as
    fast as 32 and nothing is computed twice."""
    rows = bench_workflows().main([*REACT, "--sweep", "32,64", "--total", "3x", "--policy", "prefix",
                                   "--out", str(tmp_path)])
    by = {r["workflows"]: r for r in rows}
    assert max(by[64]["latencies_s"]) > 60  # urgent requests at the gate
    assert by[64]["workflows_running_peak"] == by[32]["workflows_running_peak"]
    assert by[64]["recompute_ratio"] <= 1.001
    assert by[64]["tasks_per_s_sustained"] >= 0.95 * by[32]["tasks_per_s_sustained"]
