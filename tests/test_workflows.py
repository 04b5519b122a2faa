"""Agent workflows: the shapes ReAct, MapReduce and parallel rounds hand the engine, the length profiles, the
closed loop's slots and timing, the session fields both drivers send, the minimal prefill
replay, and smoke runs of scripts/bench_workflows.py for every policy."""

import asyncio
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import bench_workflows
from forkjax.config import ModelConfig
from forkjax.models.builtin import BUILTIN_CONFIGS
from forkjax.workflows import (PROFILES, LengthDist, MapReduceWorkflow, ParallelWorkflow,
                               ReActWorkflow, RequestRecord, RunResult, TokenSampler, agent_names, fixed_profile,
                               get_profile, longest_request, make_workflows, workflow_source)
from forkjax.workflows.driver import run_in_process
from forkjax.workflows.loop import ClosedLoop
from forkjax.workflows.minimal import prefill_tokens_minimal

TINY = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
TOKENS = TokenSampler.for_model(TINY)


def _fake_output(req):
    return [int(t) for t in np.random.default_rng(req.turn).integers(0, 256, req.max_tokens)]


def _run_fake(w, t=0.0):
    """Run workflow `w` to its end with fake outputs -> its requests in call order."""
    calls = []
    while not w.done:
        ready = w.pop_ready(t)
        calls += ready
        for req in ready:
            w.complete(req, _fake_output(req), t)
        t += 1.0
    return calls


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


def test_parallel_rounds_answer_together_then_read_every_answer_in_agent_order():
    ctx, instr, gen = 40, 3, 4
    agents = ["a0", "a1", "a2"]
    prof = fixed_profile(ctx, gen, 0, instr)
    w = ParallelWorkflow(1, agents, 2, prof, TOKENS, np.random.default_rng(3))
    first = w.pop_ready(0.0)
    assert [r.adapter for r in first] == agents and [r.turn for r in first] == [0, 1, 2]
    assert w.pop_ready(0.0) == [] and w.next_ready_at() is None
    for i, r in enumerate(first):
        assert r.prompt == w.context + w.cues[i] and r.max_tokens == gen and not r.last
        assert set(r.fanout_adapters) == set(agents) - {r.adapter}
    outs = [_fake_output(r) for r in first]
    for r in reversed(first):  # finish out of order: the round waits for every answer
        assert w.pop_ready(0.1) == []
        w.complete(r, outs[r.turn], 0.1)
    second = w.pop_ready(0.2)
    history = [t for i in range(3) for t in w.cues[i] + outs[i]]
    for i, r in enumerate(second):
        assert r.turn == 3 + i and r.prompt == w.context + history + w.cues[i]
        assert r.last and r.fanout_adapters == ()
    assert w.final_tokens == len(second[0].prompt) + gen == longest_request("parallel", prof, agents=3, rounds=2)
    w.complete(second[1], _fake_output(second[1]), 0.3)
    with pytest.raises(ValueError, match="twice"):
        w.complete(second[1], _fake_output(second[1]), 0.3)
    for r in (second[0], second[2]):
        w.complete(r, _fake_output(r), 0.3)
    assert w.done and w.pop_ready(0.4) == []


@pytest.mark.parametrize("pattern", ["react", "mapreduce"])
def test_workflows_know_their_final_length_and_their_last_call(pattern):
    prof = PROFILES["apigen"]  # lengths drawn: every turn's generation and observation differ
    w, again = (make_workflows(pattern, 3, prof, TOKENS, seed=4, rounds=3, mappers=3)[2] for _ in range(2))
    final = w.final_tokens  # known before it runs
    calls = _run_fake(w)
    assert [c.last for c in calls] == [False] * (len(calls) - 1) + [True]
    assert final == max(len(c.prompt) + c.max_tokens for c in calls)
    assert final == len(calls[-1].prompt) + calls[-1].max_tokens
    assert len({c.max_tokens for c in calls}) > 1
    # The same seed and index draw the same shape, however the run went.
    assert again.final_tokens == final
    assert [c.max_tokens for c in _run_fake(again, 5.0)] == [c.max_tokens for c in calls]


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


# ---- steady state and the minimal prefill -------------------------------------------------------

def _record(sid, turn, submit, finish, prompt=(), output=(), adapter="a", order=0, fanout=()):
    return RequestRecord(sid, turn, adapter, len(prompt), len(output), submit, finish, order=order,
                         fanout_adapters=tuple(fanout), prompt_ids=np.asarray(prompt, np.int32),
                         output_ids=np.asarray(output, np.int32))


def test_steady_and_sustained_windows():
    # 2 slots, 6 workflows of 2 calls; workflow i runs [start_i, finish_i], its first call ends halfway.
    spans = [(0, 2), (0, 3), (2, 4), (3, 7), (4, 8), (7, 9)]
    records = tuple(r for i, (s, f) in enumerate(spans)
                    for r in (_record(f"wf{i}", 0, s, (s + f) / 2), _record(f"wf{i}", 1, (s + f) / 2, f)))
    run = RunResult(6, records, slots=2)
    assert run.tasks_per_s == 6 / 9
    # steady: from the 2nd start (0) to the 4th finish (7): finishes 2, 3, 4, 7
    assert run.steady_window == (0, 7) and run.tasks_per_s_steady == 4 / 7
    # sustained: from the 2nd finish (3) to the 4th (7): calls ending in (3, 7] are wf2's second
    # (4), wf3's two (5, 7) and wf4's first (6): 4 calls, 2 workflows' worth
    assert run.sustained_window == (3, 7) and run.tasks_per_s_sustained == 2 / 4
    closed = RunResult(2, records[:4], slots=2)  # every workflow at t=0: no steady state
    assert closed.tasks_per_s_steady is None and closed.tasks_per_s_sustained is None
    assert RunResult(4, records[:8], slots=2).tasks_per_s_sustained is None  # M = 2N: empty
    summary = run.summary()
    assert summary["slots"] == 2 and summary["total"] == 6 and summary["steady_window_s"] == [0, 7]


def test_minimal_prefill_counts_each_position_once_per_pool():
    rng = np.random.default_rng(0)
    p0, out0, tail = rng.integers(0, 256, 40).tolist(), rng.integers(0, 256, 5).tolist(), [7, 8, 9]
    p1 = p0 + out0 + tail  # 48 tokens: the next turn reads the first one's prompt and output
    # The first call's prompt + output[:-1] (44 tokens) leaves 2 whole pages of 16: 32 hit.
    after = lambda adapter, fanout=(): [  # noqa: E731
        _record("wf0", 0, 0, 1, p0, out0, "a", 0, fanout), _record("wf0", 1, 1, 2, p1, [1, 2], adapter, 1)]
    assert prefill_tokens_minimal(after("a"), "prefix", 16) == 40 + 16
    assert prefill_tokens_minimal(after("b"), "prefix", 16) == 40 + 48  # another agent's copy
    assert prefill_tokens_minimal(after("b"), "full_reuse", 16) == 40 + 16
    assert prefill_tokens_minimal(after("b"), "forkkv", 16) == 40 + 48  # b's residual is missing
    assert prefill_tokens_minimal(after("b", ["b"]), "forkkv", 16, fanout=True) == 40 + 16
    assert prefill_tokens_minimal(after("b", ["b"]), "lrshared", 16) == 40 + 16
    # Running together, the second shares the first's prompt pages, not its generated tokens.
    together = [_record("wf0", 0, 0, 2, p0, out0, "a", 0), _record("wf1", 0, 1, 3, p1, [1], "a", 1)]
    assert prefill_tokens_minimal(together, "prefix", 16) == 40 + 48 - 32
    # A prompt cached but for its last token: a decode step computes that one.
    again = [_record("wf0", 0, 0, 1, p1, [1, 2], "a", 0), _record("wf1", 0, 2, 3, p1[:33], [3], "a", 1)]
    assert prefill_tokens_minimal(again, "prefix", 16) == 48
    with pytest.raises(ValueError, match="token ids"):
        prefill_tokens_minimal([RequestRecord("wf0", 0, "a", 4, 1, 0, 1)], "prefix", 16)


# ---- the drivers --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def forkkv_engine():
    """The engine the smoke runs below build for forkkv: they then reuse its compiled programs."""
    bench = bench_workflows()
    args = bench.build_parser().parse_args(SMOKE)
    bench.check_args(args)
    engine, _ = bench.build_engine(args, "forkkv", agent_names("react"), TINY, 1024)
    return engine


def _recording(engine, monkeypatch) -> list[dict]:
    """Record the keywords of every engine.add_request call."""
    calls, add = [], engine.add_request

    def add_request(prompt, adapter, params, **kw):
        calls.append({"prompt": list(prompt), "max_tokens": params.max_new_tokens, **kw})
        return add(prompt, adapter, params, **kw)
    monkeypatch.setattr(engine, "add_request", add_request)
    return calls


def _check_sessions(calls, source_of, hints=True):
    """Each workflow's calls name its session; its last one ends it, with its final length."""
    by = {}
    for c in calls:
        by.setdefault(c["session_id"], []).append(c)
    for sid, cs in by.items():
        w = source_of(int(sid[2:]))
        assert [c["session_end"] for c in cs] == [False] * (len(cs) - 1) + [True]
        assert len(cs[-1]["prompt"]) + cs[-1]["max_tokens"] == w.final_tokens
        assert all(c["session_tokens"] == (w.final_tokens if hints else None) for c in cs)
    return by


def _check_slots(result, slots, total):
    """No more than `slots` workflows run at once, and a finished one's slot starts the next."""
    spans = sorted(result.spans().values())
    assert result.workflows == len(spans) == total and result.slots == slots
    finishes = sorted(f for _, f in spans)
    for i, (s, _) in enumerate(spans):
        assert sum(1 for a, b in spans if a <= s < b) <= slots
        if i >= slots:  # started when the (i - slots + 1)-th workflow finished
            assert 0 <= s - finishes[i - slots] < 1.0


# ---- the in-process driver ----------------------------------------------------------------------

def test_driver_runs_closed_loop_and_waits_out_tool_latencies(forkkv_engine):
    engine, names = forkkv_engine, agent_names("react")
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


def test_react_json_tool_calls_follow_their_schema(forkkv_engine):
    """--tool-format json: each turn's action is constrained to TOOL_CALL_SCHEMA, so every turn's
    output validates (checked with jsonschema), unless it was cut at its max_tokens."""
    import jsonschema

    from forkjax.workflows.react import TOOL_CALL_SCHEMA
    workflows = make_workflows("react", 2, fixed_profile(32, 120, 2, 1), TOKENS, rounds=2, tool_format="json")
    outputs = []
    for w in workflows:
        def complete(request, output, now, done=w.complete):
            outputs.append((request, output))
            done(request, output, now)
        w.complete = complete
    before = forkkv_engine.stats()["guided_steps"]
    result = run_in_process(forkkv_engine, workflows, progress=False)
    assert all(w.done for w in workflows) and len(result.records) == len(outputs) == 12
    valid = 0
    for request, output in outputs:
        assert request.guided_json == TOOL_CALL_SCHEMA
        try:
            call = json.loads(bytes(t for t in output if t < 256).decode())
        except ValueError:
            assert len(output) == request.max_tokens  # cut short
            continue
        jsonschema.validate(call, TOOL_CALL_SCHEMA)
        valid += 1
    assert valid >= 6
    assert forkkv_engine.stats()["guided_steps"] > before


def test_driver_refills_slots_and_ends_sessions(forkkv_engine, monkeypatch):
    calls = _recording(forkkv_engine, monkeypatch)
    shape = dict(rounds=2, seed=1)
    prof = fixed_profile(24, 3, 5, 2)
    source = workflow_source("react", 2, 5, prof, TOKENS, **shape)
    result = run_in_process(forkkv_engine, source, progress=False)
    _check_slots(result, 2, 5)
    assert len(result.records) == 5 * 6 and result.tasks_per_s_steady > 0
    a, b = result.steady_window
    assert b == sorted(f for _, f in result.spans().values())[2]  # the (M - N)-th finish
    make = lambda i: make_workflows("react", i + 1, prof, TOKENS, **shape)[i]  # noqa: E731
    assert len(_check_sessions(calls, make)) == 5
    calls.clear()  # without hints: the end still, the final length not
    run_in_process(forkkv_engine, make_workflows("react", 1, prof, TOKENS, **shape), progress=False,
                   session_hints=False)
    _check_sessions(calls, make, hints=False)


def test_http_driver_sends_the_session_fields(tmp_path, monkeypatch):
    from forkjax.workflows import http_driver
    from forkjax.workflows.agents import agent_adapters
    from forkjax.workflows.http_driver import request_body, run_http, scrape
    from forkjax.workflows.local_server import ServerProcess, lora_flags
    prof = fixed_profile(24, 3, 5, 2)
    for hints in (True, False):
        w = make_workflows("react", 1, prof, TOKENS, rounds=1)[0]
        loop = ClosedLoop([w], session_hints=hints, progress=False)
        bodies = []
        while not w.done:
            (call,) = loop.ready(w, 0.0)
            bodies.append(request_body(loop, call, fanout=True))
            through = request_body(loop, call, True, base_model="tiny-llama")  # a gateway's form
            assert through["model"] == "tiny-llama" and through["extra_body"]["lora_path"] == call.request.adapter
            assert through["prompt"] == "" and through["extra_body"]["prompt_token_ids"] == list(call.request.prompt)
            loop.complete(call, _fake_output(call.request), 0.0)
            assert bodies[-1]["model"] == call.request.adapter and bodies[-1]["prompt"] == call.request.prompt
            assert bodies[-1]["extra_body"]["fanout_adapters"] == list(call.request.fanout_adapters)
        for i, body in enumerate(bodies):
            extra = body["extra_body"]
            assert extra["session_id"] == "wf0" and extra.get("session_end", False) == (i == len(bodies) - 1)
            assert body["extra_headers"] == {"X-SMG-Routing-Key": "wf0"} and "lora_path" not in extra
            assert extra.get("session_tokens") == (w.final_tokens if hints else None)
    calls = []  # what the client sends (the server's own tests check what it does with it)

    def recording(loop, call, fanout, base_model=None):
        body = request_body(loop, call, fanout, base_model)
        extra = body["extra_body"]
        calls.append({"prompt": body["prompt"], "max_tokens": body["max_tokens"], "session_id": extra["session_id"],
                      "session_end": extra.get("session_end", False), "session_tokens": extra.get("session_tokens")})
        return body
    monkeypatch.setattr(http_driver, "request_body", recording)
    # The smoke runs' forkkv engine, served by `python -m forkjax.serve` with the agents as PEFT dirs
    bench = bench_workflows()
    args = bench.build_parser().parse_args(SMOKE)
    bench.check_args(args)
    names = agent_names("react")
    flags = [*bench.server_flags(args, "forkkv", names, 1024),
             *lora_flags(agent_adapters(TINY, names, args.rank, shared_a=False), str(tmp_path / "agents"))]
    source = workflow_source("react", 2, 3, prof, TOKENS, rounds=2)
    with ServerProcess("tiny-llama", flags, log_path=str(tmp_path / "server.log")) as server:
        result = asyncio.run(run_http(server.url, source, progress=False))
        metrics = asyncio.run(scrape(server.url))
    _check_slots(result, 2, 3)
    _check_sessions(calls, lambda i: make_workflows("react", i + 1, prof, TOKENS, rounds=2)[i])
    assert metrics["prompt_tokens_total"] == sum(len(c["prompt"]) for c in calls) and len(calls) == 3 * 6
    assert metrics["sessions_open"] == 0  # every workflow's last call ended its session


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
        "git_commit", "command", "wall_s", "preemptions", "latencies_s", "tasks_per_s_steady",
        "tasks_per_s_sustained", "total", "prefill_tokens_minimal", "recompute_ratio",
        "workflows_running_peak", "max_batch_size", "session_hints"}


@pytest.mark.parametrize("pattern", ["react", "mapreduce"])
def test_bench_smoke_every_policy(tmp_path, pattern):
    rows = bench_workflows().main([*SMOKE, "--pattern", pattern, "--out", str(tmp_path)])
    by = {}
    for policy in ("prefix", "full_reuse", "forkkv", "lrshared", "forkkv+fanout"):
        with open(tmp_path / f"{policy.replace('+', '-')}-2" / "results.json") as f:
            r = by[policy] = json.load(f)
        assert KEYS <= r.keys() and r["policy"] == policy and r["workflows"] == 2 and r["pattern"] == pattern
        assert r["tasks_per_s"] > 0 and r["tokens_per_s"] > 0 and r["per_agent_kv_bytes"] > 0
        assert r["decode_batch_size_mean"] >= 1 and r["prefill_tokens_computed"] > 0
        assert r["max_batch_size"] == 8 and r["total"] == 2 and r["session_hints"] is True
        assert r["tasks_per_s_steady"] is None and r["workflows_running_peak"] == 2
    with open(tmp_path / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [t["policy"] for t in table] == list(by) and len(rows) == 5
    for png in ("throughput.png", "breakdown.png"):
        assert (tmp_path / png).stat().st_size > 1000
    # Sharing the base K/V across agents: less memory per agent, more prompt tokens found cached.
    assert by["forkkv"]["per_agent_kv_bytes"] < by["prefix"]["per_agent_kv_bytes"]
    assert by["forkkv"]["base_hit_rate"] > by["prefix"]["base_hit_rate"]
    assert by["prefix"]["residual_hit_rate"] == 0


@pytest.mark.parametrize("pattern", ["react", "mapreduce", "parallel"])
def test_engine_computes_the_minimal_prefill_in_a_pool_that_never_evicts(tmp_path, pattern):
    # Prompts off page boundaries, slots refilled; the CPU default pool (64 MiB) holds everything.
    # No prompt is 1 past a multiple of the 16-token chunks: a prompt chunked up to its last token
    # leaves that one to a decode step, which prefill_tokens_computed does not count.
    argv = [*SMOKE[:-1], "prefix,forkkv,forkkv+fanout,alora", "--context", "45", "--gen", "5", "--obs", "3",
            "--total", "5", "--pattern", pattern, "--step-log", "--out", str(tmp_path)]
    rows = bench_workflows().main(argv)
    for r in rows:
        assert r["total"] == 5 and r["preemptions"] == 0
        assert r["prefill_tokens_computed"] == r["prefill_tokens_minimal"] > 0 and r["recompute_ratio"] == 1
        # --step-log: every step of the run (not of the one-workflow KV run), timed
        decode = [s for s in r["steps"] if s[0] == 1]
        assert sum(s[1] for s in decode) / len(decode) == pytest.approx(r["decode_batch_size_mean"])
        assert all(s[4] > 0 for s in r["steps"]) and sum(s[4] for s in r["steps"]) < r["wall_s"]
        assert sum(s[2] for s in r["steps"]) >= r["prefill_tokens_computed"]
    by = {r["policy"]: r["prefill_tokens_minimal"] for r in rows}
    assert by["forkkv+fanout"] < by["forkkv"] <= by["prefix"]
    # Activated LoRA agents share the base model's K/V of everything before their cue, exactly
    assert by["alora"] < by["prefix"]
    kv = {r["policy"]: r["per_agent_kv_bytes"] for r in rows}
    assert kv["alora"] < kv["prefix"]


def test_bench_single_run_over_http(tmp_path):
    bench = bench_workflows()
    (row,) = bench.main([*SMOKE[:-2], "--policy", "forkkv", "--pattern", "react", "--http",
                         "--total", "3", "--out", str(tmp_path)])
    with open(tmp_path / "results.json") as f:
        r = json.load(f)
    assert KEYS - {"prefill_tokens_computed"} <= r.keys() and r["http"] is True
    assert r["total"] == 3 and r["requests"] == 3 * 6 and r["tasks_per_s_steady"] > 0
    assert r["tasks_per_s"] > 0 and r["base_hit_rate"] > 0 and r["per_agent_kv_bytes"] > 0
    assert not (tmp_path / "summary.csv").exists()


def test_bench_refuses_bad_flags(tmp_path):
    bench = bench_workflows()
    for argv, match in ((["--policy", "forkkv,nope"], "--policy"),
                        (["--policy", "prefix", "--residual-fanout"], "--residual-fanout"),
                        (["--profile", "loogle", "--context", "100"], "--context"),
                        (["--sweep", "1,x"], "--sweep"),
                        (["--pattern", "mapreduce", "--tool-latency", "1"], "--tool-latency"),
                        (["--pattern", "mapreduce", "--tool-format", "json"], "--tool-format"),
                        (["--replay", "--tool-format", "json"], "--tool-format"),
                        (["--residual-fraction", "1.5"], "--residual-fraction"),
                        (["--sweep", "2,4", "--total", "3"], "--total"),
                        (["--total", "many"], "--total"),
                        (["--replay", "--http"], "--replay"),
                        (["--step-log", "--http"], "--step-log"),
                        (["--model", "no-such-model"], "--model")):
        with pytest.raises(ValueError, match=match):
            bench.main(["--model", "tiny-llama", *argv, "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # not a size: refused as the flags are parsed
        bench.main(["--model", "tiny-llama", "--host-kv-bytes", "-1", "--out", str(tmp_path)])


# The old scheduler at these two points (admission by a workflow's current turn, finished
# workflows' pages held for 30 s): (decode batch, prefill tokens computed) at 6 workflows.
BEFORE_AT_6 = {"full_reuse": (5.5, 8_544), "forkkv": (2.7, 31_472)}


@pytest.mark.parametrize("policy", sorted(BEFORE_AT_6))
def test_twice_the_workflows_in_a_pool_of_eight_keep_the_decode_batch(tmp_path, policy):
    """ReAct on the real engine (tiny-llama) in a pool that holds ~8 final histories (full_reuse;
    4-5 under forkkv, whose agents keep residuals too): at 12 workflows the engine runs as many
    at once as at 6 and computes each workflow's prompts about once, instead of collapsing to
    fewer workflows whose pages evict each other."""
    rows = bench_workflows().main(["--model", "tiny-llama", "--pattern", "react", "--sweep", "6,12",
                          "--policy", policy, "--kv-cache-bytes", "12.2e6", "--context", "1024",
                          "--gen", "16", "--obs", "16", "--no-warmup", "--out", str(tmp_path)])
    at = {r["workflows"]: r for r in rows}
    batch, prefill = BEFORE_AT_6[policy]
    assert at[6]["decode_batch_size_mean"] >= 0.98 * batch and at[6]["prefill_tokens_computed"] <= prefill
    assert at[12]["decode_batch_size_mean"] >= 0.9 * at[6]["decode_batch_size_mean"]
    assert at[12]["prefill_tokens_computed"] <= 1.1 * 2 * at[6]["prefill_tokens_computed"]
    assert all(r["recompute_ratio"] <= 1.10 for r in rows), [r["recompute_ratio"] for r in rows]


def test_bench_host_tier_counters_reach_the_results(tmp_path):
    """--host-kv-bytes gives the engine a host tier: workflows that pause for tool calls keep
    their idle agents' paths there under pressure (stored bytes counted in results.json) and
    nothing is computed twice. The command runs in a process of its own: late in the suite, in a
    worker that has compiled hundreds of other programs, XLA's CPU compiler crashed (SIGSEGV)
    compiling this run's first step, which compiles in a fresh process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "bench_workflows.py"), "--model", "tiny-llama",
         "--workflows", "6", "--policy", "prefix", "--kv-cache-bytes", "3e6", "--host-kv-bytes", "64e6",
         "--context", "256", "--gen", "8", "--obs", "8", "--rounds", "2", "--tool-latency", "0.3",
         "--no-warmup", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    row = json.loads((tmp_path / "results.json").read_text())
    assert row["host_kv_bytes"] == 64_000_000 and row["host_bytes_stored"] > 0
    assert row["host_bytes_used"] <= 64_000_000 and row["recompute_ratio"] == 1.0


def test_distinct_agents_swap_through_fewer_slots(tmp_path):
    """--distinct-agents: 2 workflow slots x 3 agents = 6 adapters on 3 device slots (a turn that
    fans out to its group needs all three). Every
    workflow finishes, adapters swap in as turns need them, and no prompt is computed twice."""
    row, = bench_workflows().main(["--model", "tiny-llama", "--workflows", "2", "--total", "4",
                                   "--distinct-agents", "--max-loras", "4", "--policy", "forkkv+fanout",
                                   "--context", "128", "--gen", "4", "--obs", "4", "--rounds", "2",
                                   "--no-warmup", "--out", str(tmp_path)])
    assert row["groups"] == 2 and row["max_loras"] == 4 and row["lora_swaps"] > 0
    assert row["recompute_ratio"] == 1.0 and row["requests"] == 4 * 3 * 2
    with pytest.raises(ValueError, match="--distinct-agents"):
        bench_workflows().main(["--model", "tiny-llama", "--distinct-agents", "--http", "--out", str(tmp_path)])


def test_stats_between_gives_the_interval_of_counters_and_of_the_decode_batch_mean():
    from forkjax.workflows.http_driver import stats_between
    before = {"prompt_tokens_total": 100.0, "decode_steps_total": 10.0, "decode_batch_size_mean": 2.0,
              "workflows_running_peak": 3.0}
    after = {"prompt_tokens_total": 250.0, "decode_steps_total": 30.0, "decode_batch_size_mean": 4.0,
             "workflows_running_peak": 3.0}
    stats = stats_between(before, after)
    assert stats["prompt_tokens"] == 150
    assert stats["decode_batch_size_mean"] == (4.0 * 30 - 2.0 * 10) / 20  # 5 requests a step since
    assert stats["workflows_running_peak"] is None  # reached before the interval
    assert stats_between({}, after)["workflows_running_peak"] == 3
