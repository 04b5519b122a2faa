"""Agent workflows: the shapes ReAct and MapReduce hand the engine, the length profiles, the
closed-loop driver's timing, and a smoke run of scripts/bench_workflows.py for every policy."""

import csv
import importlib.util
import json
import os

import numpy as np
import pytest

from forkjax.config import ModelConfig
from forkjax.models.builtin import BUILTIN_CONFIGS
from forkjax.workflows import (PROFILES, LengthDist, MapReduceWorkflow, ReActWorkflow, TokenSampler,
                               agent_names, fixed_profile, get_profile, longest_request, make_workflows)
from forkjax.workflows.driver import run_in_process

TINY = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
TOKENS = TokenSampler.for_model(TINY)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    path = os.path.join(REPO, "scripts", "bench_workflows.py")
    spec = importlib.util.spec_from_file_location("bench_workflows", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_output(req):
    return [int(t) for t in np.random.default_rng(req.turn).integers(0, 256, req.max_tokens)]


# ---- workflow shapes ----------------------------------------------------------------------------

def test_react_turns_share_the_longest_prefix_and_follow_the_flags():
    agents, rounds, ctx, cue, gen, obs = ["a", "b", "c"], 2, 40, 3, 5, 7
    w = ReActWorkflow(0, agents, rounds, fixed_profile(ctx, gen, obs, cue), TOKENS, np.random.default_rng(1))
    prompts, t = [], 0.0
    while not w.done:
        (req,) = w.pop_ready(t)
        assert w.pop_ready(t) == []  # one turn at a time
        k = req.turn
        assert req.session_id == "wf0" and req.adapter == agents[k % 3] and req.max_tokens == gen
        assert len(req.prompt) == ctx + k * (cue + gen + obs) + cue
        assert req.prompt[-cue:] == w.cues[req.adapter]  # the agent's cue comes last
        assert req.fanout_adapters == (() if k == 5 else tuple(a for a in agents if a != req.adapter))
        out = _fake_output(req)
        w.complete(req, out, t)
        prompts.append((req.prompt, out))
        t += 1.0
    assert len(prompts) == w.num_turns == 6
    for (p, out), (q, _) in zip(prompts, prompts[1:]):
        # The next agent reads this turn's prompt, its output, then an observation.
        assert q[:len(p)] == p and q[len(p):len(p) + gen] == out
    assert max(len(p) for p, _ in prompts) + gen == longest_request("react", w.profile, agents=3, rounds=2)
    assert all(0 <= x < 256 for p, _ in prompts for x in p)  # tiny-llama: 256 bos, 257 eos


def test_tool_latency_delays_the_next_turn():
    w = ReActWorkflow(3, ["a", "b"], 1, fixed_profile(16, 2, 4, 1), TOKENS, np.random.default_rng(0), 0.5)
    assert w.next_ready_at() == 0.0
    (req,) = w.pop_ready(0.0)
    assert w.next_ready_at() is None  # running
    w.complete(req, [1, 2], now=1.0)
    assert w.pop_ready(1.2) == [] and w.next_ready_at() == 1.5
    (nxt,) = w.pop_ready(1.5)
    assert nxt.turn == 1 and nxt.adapter == "b"
    w.complete(nxt, [3, 4], now=2.0)
    assert w.done and w.next_ready_at() is None and w.pop_ready(9.0) == []


def test_mapreduce_maps_together_then_reduces_in_mapper_order():
    doc, instr, gen = 48, 4, 3
    w = MapReduceWorkflow(1, ["m0", "m1", "m2"], "r", fixed_profile(doc, gen, 0, instr), TOKENS,
                          np.random.default_rng(2))
    maps = w.pop_ready(0.0)
    assert [r.adapter for r in maps] == ["m0", "m1", "m2"] and w.pop_ready(0.0) == []
    for r in maps:
        assert r.prompt[:doc] == w.document and len(r.prompt) == doc + instr and r.max_tokens == gen
        assert set(r.fanout_adapters) == {"m0", "m1", "m2", "r"} - {r.adapter}
    outs = {r.adapter: _fake_output(r) for r in maps}
    for r in reversed(maps):  # finish out of order
        assert w.pop_ready(0.1) == []  # the reducer waits for every mapper
        w.complete(r, outs[r.adapter], 0.1)
    (red,) = w.pop_ready(0.2)
    assert red.adapter == "r" and red.fanout_adapters == () and w.next_ready_at() is None
    assert red.prompt == w.document + outs["m0"] + outs["m1"] + outs["m2"] + w.instructions[3]
    assert len(red.prompt) + gen == longest_request("mapreduce", w.profile, mappers=3)
    w.complete(red, _fake_output(red), 0.3)
    assert w.done


def test_workflows_are_seeded_per_index():
    prof = PROFILES["apigen"]
    a = make_workflows("react", 1, prof, TOKENS, seed=5)[0]
    b = make_workflows("react", 4, prof, TOKENS, seed=5)
    assert a.context == b[0].context and a.cues == b[0].cues and a.context != b[1].context
    assert agent_names("mapreduce", mappers=2) == ["mapper0", "mapper1", "reducer"]
    with pytest.raises(ValueError, match="ReAct only"):
        make_workflows("mapreduce", 1, prof, TOKENS, tool_latency=1.0)


# ---- profiles -----------------------------------------------------------------------------------

def test_profiles_draw_their_documented_lengths():
    rng = np.random.default_rng(0)
    d = LengthDist.from_mean_median(100, 80, 1, None)
    x = np.array([d.sample(rng) for _ in range(40_000)])
    assert abs(x.mean() / 100 - 1) < 0.03 and abs(np.median(x) / 80 - 1) < 0.03
    for p in PROFILES.values():
        for dist in (p.context, p.instruction, p.gen, p.obs):
            s = np.array([dist.sample(rng) for _ in range(2_000)])
            assert dist.lo <= s.min() and s.max() <= dist.upper
    loogle = np.array([PROFILES["loogle"].context.sample(rng) for _ in range(4_000)])
    assert 25_000 < loogle.mean() < 33_000  # long-dependency documents: ~30k tokens
    fixed = get_profile("fixed", context=4096, gen=64, obs=64, instruction=8)
    assert [fixed.context.sample(rng), fixed.gen.sample(rng), fixed.obs.sample(rng)] == [4096, 64, 64]
    with pytest.raises(ValueError, match="--gen"):
        fixed_profile(4096, 0, 64, 8)
    with pytest.raises(ValueError, match="profile"):
        get_profile("hotpotqa")


def test_random_tokens_avoid_special_ids():
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS["llama3-8b-random"])  # bos 128000, eos 128001
    ids = TokenSampler.for_model(cfg).draw(np.random.default_rng(0), 50_000)
    assert max(ids) < 32_000 and min(ids) >= 0
    tiny = TokenSampler(258, {0, 256, 257}).draw(np.random.default_rng(0), 5_000)
    assert set(tiny) == set(range(1, 256))


# ---- the in-process driver ----------------------------------------------------------------------

def test_driver_runs_closed_loop_and_waits_out_tool_latencies():
    # The engine the smoke runs below build for forkkv: they then reuse its compiled programs.
    bench = _bench()
    args = bench.build_parser().parse_args(SMOKE)
    bench.check_args(args)
    names = agent_names("react")
    engine, _ = bench.build_engine(args, "forkkv", names, TINY, 1024)
    workflows = make_workflows("react", 2, fixed_profile(32, 3, 2, 1), TOKENS, rounds=2, tool_latency=0.2)
    result = run_in_process(engine, workflows, progress=False)
    assert all(w.done for w in workflows) and len(result.records) == 12
    assert all(r.output_tokens == 3 for r in result.records)
    for sid in ("wf0", "wf1"):
        turns = sorted((r for r in result.records if r.session_id == sid), key=lambda r: r.turn)
        assert [r.adapter for r in turns] == names * 2
        for a, b in zip(turns, turns[1:]):
            assert b.submit_s >= a.finish_s + 0.2
    window = result.last_finish_s - result.first_submit_s
    assert result.tasks_per_s == 2 / window and result.tokens_per_s == 36 / window


# ---- the benchmark script -----------------------------------------------------------------------

# Small enough for 2 CPU cores: 2 workflows; ReAct 3 agents x 2 rounds, MapReduce 2 mappers +
# reducer (3 agents too: both patterns compile the same programs); one 16-token prefill chunk
# shape, so each engine compiles about three step programs.
SMOKE = ["--model", "tiny-llama", "--workflows", "2", "--context", "64", "--gen", "4", "--obs", "4",
         "--rounds", "2", "--mappers", "2", "--no-warmup", "--max-batch-size", "8",
         "--max-prefill-tokens", "16", "--dtype", "float32",
         "--policy", "prefix,full_reuse,forkkv,lrshared,forkkv+fanout"]
KEYS = {"tasks_per_s", "tokens_per_s", "per_agent_kv_bytes", "base_hit_rate", "residual_hit_rate",
        "decode_batch_size_mean", "prefill_tokens_computed", "compile_s", "policy", "workflows",
        "pattern", "model", "kv_cache_bytes", "tool_latency", "rank", "device_kind", "jax_version",
        "git_commit", "command", "wall_s", "preemptions", "latencies_s"}


@pytest.mark.parametrize("pattern", ["react", "mapreduce"])
def test_bench_smoke_every_policy(tmp_path, pattern):
    rows = _bench().main([*SMOKE, "--pattern", pattern, "--out", str(tmp_path)])
    by = {}
    for policy in ("prefix", "full_reuse", "forkkv", "lrshared", "forkkv+fanout"):
        with open(tmp_path / f"{policy.replace('+', '-')}-2" / "results.json") as f:
            r = by[policy] = json.load(f)
        assert KEYS <= r.keys() and r["policy"] == policy and r["workflows"] == 2 and r["pattern"] == pattern
        assert r["tasks_per_s"] > 0 and r["tokens_per_s"] > 0 and r["per_agent_kv_bytes"] > 0
        assert r["decode_batch_size_mean"] >= 1 and r["prefill_tokens_computed"] > 0
    with open(tmp_path / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [t["policy"] for t in table] == list(by) and len(rows) == 5
    for png in ("throughput.png", "breakdown.png"):
        assert (tmp_path / png).stat().st_size > 1000
    # Sharing the base K/V across agents: less memory per agent, more prompt tokens found cached.
    assert by["forkkv"]["per_agent_kv_bytes"] < by["prefix"]["per_agent_kv_bytes"]
    assert by["forkkv"]["base_hit_rate"] > by["prefix"]["base_hit_rate"]
    assert by["prefix"]["residual_hit_rate"] == 0


def test_bench_single_run_over_http(tmp_path):
    bench = _bench()
    (row,) = bench.main([*SMOKE[:-2], "--policy", "forkkv", "--pattern", "react", "--http",
                         "--out", str(tmp_path)])
    with open(tmp_path / "results.json") as f:
        r = json.load(f)
    assert KEYS - {"prefill_tokens_computed"} <= r.keys() and r["http"] is True
    assert r["tasks_per_s"] > 0 and r["base_hit_rate"] > 0 and r["per_agent_kv_bytes"] > 0
    assert not (tmp_path / "summary.csv").exists()


def test_bench_refuses_bad_flags(tmp_path):
    bench = _bench()
    for argv, match in ((["--policy", "forkkv,nope"], "--policy"),
                        (["--policy", "prefix", "--residual-fanout"], "--residual-fanout"),
                        (["--profile", "loogle", "--context", "100"], "--context"),
                        (["--sweep", "1,x"], "--sweep"),
                        (["--pattern", "mapreduce", "--tool-latency", "1"], "--tool-latency"),
                        (["--residual-fraction", "1.5"], "--residual-fraction"),
                        (["--model", "no-such-model"], "--model")):
        with pytest.raises(ValueError, match=match):
            bench.main(["--model", "tiny-llama", *argv, "--out", str(tmp_path)])
