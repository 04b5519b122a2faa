"""The model-free replay (forkjax/workflows/replay.py): its step and host copy costs reproduce
the H200 rows they come from, it runs on virtual time, and at Llama-3.1-8B's geometry (16 GB of
K/V, max batch 64) 32 ReAct workflows keep at least the throughput of 16 under every cache
policy; with 1 s tool calls a 64 GB host tier makes `prefix` 1.5 times as fast at 32."""

import time

import pytest

from conftest import bench_workflows
from forkjax.config import ModelConfig
from forkjax.models.builtin import BUILTIN_CONFIGS
from forkjax.workflows import TokenSampler, agent_names, fixed_profile, make_workflows
from forkjax.workflows.driver import run_in_process
from forkjax.workflows.replay import (DECODE_ROWS, DECODE_TOKENS, HOST_COPY_ROWS, PREFILL, ReplayEngine,
                                      VirtualClock)

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
    # Slots beyond the rows' eight add what 65 slots measured over none, per slot, to a decode
    # step (Many adapters: 10.35 against 9.48 ms at B=64, 2k), and their FLOPs to an extend.
    many = ReplayEngine(MODEL, [f"a{i}" for i in range(64)], max_loras=65).cost
    decode = _Batch("decode", [DECODE_TOKENS] * 64)
    assert many.step_s(decode) - cost.step_s(decode) == pytest.approx(57 / 64 * (10.35e-3 - 9.48e-3))
    extend = _Batch("extend", chunks=[(0, 2048)])
    assert many.step_s(extend) - cost.step_s(extend) > many.step_s(decode) - cost.step_s(decode)


def test_host_copy_costs_fit_their_h200_rows():
    cost = ReplayEngine(MODEL, ["a"]).cost
    for nbytes, store_s, load_s in HOST_COPY_ROWS:  # a line through 2 MiB-512 MiB: within 20% each
        assert cost.copy_s([("store", nbytes)]) == pytest.approx(store_s, rel=0.2)
        assert cost.copy_s([("load", nbytes)]) == pytest.approx(load_s, rel=0.2)
    assert cost.copy_s([("store", 1 << 26)] * 2) > cost.copy_s([("store", 1 << 27)])  # each copy's fixed part
    assert cost.copy_s([]) == 0


def test_the_virtual_clock_reaches_a_time_a_rounding_error_away():
    """The driver sleeps until a workflow's next call, measured from its start t0: here
    t + (wake - (t - t0)) - t0 falls short of wake, and a float addition of what remains
    would leave t as it is."""
    clock, t0, wake = VirtualClock(), 6.183689966753317, 125.55317068122027
    clock.t = 131.4368606479736
    for _ in range(4):
        clock.sleep(max(0.0, wake - (clock() - t0)))
    assert clock() - t0 >= wake


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


def test_replay_a_host_tier_runs_32_pausing_prefix_workflows_half_again_as_fast(tmp_path):
    """ReAct with 1 s tool calls under `prefix`: each agent keeps its own copy of the history,
    so 16 GB of K/V holds 7 of 32 workflows with all their paths. With a 64 GB host tier, a
    workflow in a tool call keeps one path on the device, its idle agents' paths wait on the
    host: three times as many run, at least 1.5 times the tasks/s, nothing recomputed, each
    path stored about once and loaded about once a turn. Without tool calls the tier moves
    nothing and changes nothing (at 16)."""
    def run(*flags, n="32"):
        rows = bench_workflows().main([*REACT, "--sweep", n, "--total", "3x", "--policy", "prefix",
                                       "--out", str(tmp_path), *flags])
        return rows[0]
    plain, tier = run("--tool-latency", "1"), run("--tool-latency", "1", "--host-kv-bytes", "64e9")
    assert tier["tasks_per_s_sustained"] >= 1.5 * plain["tasks_per_s_sustained"], (tier, plain)
    assert tier["workflows_running_peak"] >= 3 * plain["workflows_running_peak"]
    assert tier["recompute_ratio"] <= 1.001 and plain["recompute_ratio"] <= 1.05
    path = tier["per_agent_kv_bytes"]  # one agent's path of one workflow
    turns = tier["requests"]
    assert tier["host_bytes_stored"] < 1.5 * tier["total"] * 3 * path
    assert tier["host_bytes_loaded"] < 1.2 * turns * path
    busy, unhosted = run("--host-kv-bytes", "64e9", n="16"), run(n="16")
    assert busy["host_bytes_stored"] == busy["host_bytes_loaded"] == 0
    assert busy["tasks_per_s"] == unhosted["tasks_per_s"]


def test_replay_a_host_tier_writes_back_nothing_of_ended_parallel_workflows(tmp_path):
    """Parallel rounds under `prefix`: a workflow's last round runs its three agents at once,
    each request saying the session ends. Every one of their paths is retired when it ends, and
    each agent's answer branch of an earlier round when its next prompt leaves it (the answers
    are read again inside the next history), so the host tier stores nothing (a whole-path
    write-back of each ended workflow would be 96 paths, ~60 GB) and changes nothing."""
    def run(*flags):
        return bench_workflows().main(["--replay", "--pattern", "parallel", "--context", "4096",
                                       "--gen", "64", "--sweep", "16", "--total", "3x", "--policy",
                                       "prefix", "--out", str(tmp_path), *flags])[0]
    tier, plain = run("--host-kv-bytes", "64e9"), run()
    assert tier["host_bytes_stored"] == tier["host_bytes_loaded"] == 0
    assert tier["recompute_ratio"] == plain["recompute_ratio"] == 1.0
    assert tier["tasks_per_s_sustained"] == plain["tasks_per_s_sustained"]


def test_replay_workflows_with_agents_of_their_own_swap_them_at_little_cost(tmp_path):
    """32 ReAct workflows each with three agents of its own: 96 adapters, 63 device slots. The
    residual pool has room for a workflow's agents' residuals (not 63 copies of every base
    token), so fan-out runs within 10% of the same workflows on three shared agents, adapters
    swapping in as turns need them and nothing computed twice."""
    def run(*flags):
        return bench_workflows().main([*REACT, "--sweep", "32", "--total", "3x", "--policy",
                                       "forkkv+fanout", "--out", str(tmp_path), *flags])[0]
    own, shared = run("--distinct-agents", "--max-loras", "64"), run()
    assert own["groups"] == 32 and own["lora_swaps"] > 0 and own["recompute_ratio"] == 1.0
    assert own["tasks_per_s_sustained"] >= 0.9 * shared["tasks_per_s_sustained"], (own, shared)
