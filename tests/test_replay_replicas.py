"""Several replicas in the model-free replay (forkjax/workflows/replicas.py, routing.py): one
replica is the plain replay, step for step; with the workflow's id hashed every request of a
workflow reaches one replica, so the replicas compute the prefill one engine computes; round
robin scatters a workflow's agents and computes more; replicas run in parallel in virtual time."""

import pytest

from conftest import bench_workflows
from forkjax.config import ModelConfig
from forkjax.models.builtin import BUILTIN_CONFIGS
from forkjax.workflows import TokenSampler, agent_names, fixed_profile, make_workflows
from forkjax.workflows.driver import run_in_process
from forkjax.workflows.replay import ReplayEngine
from forkjax.workflows.replicas import ReplicaSet
from forkjax.workflows.routing import BALANCE_ABS, CacheAwareRouter, HashRouter

MODEL = "tiny-llama"
TOKENS = TokenSampler.for_model(ModelConfig.from_hf(BUILTIN_CONFIGS[MODEL]))
WORKFLOWS = 8


def _run(engine):
    flows = make_workflows("react", WORKFLOWS, fixed_profile(256, 8, 8, 4), TOKENS, rounds=2)
    result = run_in_process(engine, flows, progress=False, clock=engine.clock, sleep=engine.sleep)
    return result, engine.stats()


def _replica(i: int = 0) -> ReplayEngine:
    return ReplayEngine(MODEL, agent_names("react"), max_model_len=1024, seed=i)


@pytest.fixture(scope="module")
def one():
    return _run(_replica())


def test_one_replica_is_the_plain_replay(one):
    result, stats = _run(ReplicaSet(_replica, 1))
    assert result.last_finish_s == one[0].last_finish_s
    for key in ("prompt_tokens", "prefill_tokens_computed", "base_hit_tokens", "residual_hit_tokens",
                "decode_steps", "decode_batch_size_mean"):
        assert stats[key] == one[1][key], key


def test_hashing_keeps_a_workflow_on_one_replica(one):
    result, stats = _run(ReplicaSet(_replica, 2, "hash"))
    # Each replica read exactly the prompts of the workflows whose id hashes to it.
    ring = HashRouter(2)
    wanted = [0, 0]
    for r in result.records:
        wanted[ring.route(r.session_id, (), [0, 0])] += r.prompt_tokens
    assert [p["prompt_tokens"] for p in stats["per_replica"]] == wanted and min(wanted) > 0
    # So every prefix is computed once, where its workflow's other agents read it: the replicas
    # compute together what one engine computes, and hit as much.
    assert stats["prefill_tokens_computed"] == one[1]["prefill_tokens_computed"]
    assert stats["base_hit_tokens"] + stats["residual_hit_tokens"] == \
        one[1]["base_hit_tokens"] + one[1]["residual_hit_tokens"]


def test_round_robin_scatters_a_workflows_agents(one):
    result, stats = _run(ReplicaSet(_replica, 2, "round_robin"))
    requests = [p["requests"] for p in stats["per_replica"]]
    assert abs(requests[0] - requests[1]) <= 1 and sum(requests) == len(result.records)
    # An agent on the other replica than its workflow's context computes that context again.
    assert stats["prefill_tokens_computed"] > 1.2 * one[1]["prefill_tokens_computed"]
    assert stats["base_hit_tokens"] < one[1]["base_hit_tokens"]


def test_cache_aware_follows_the_prefix_and_replicas_run_in_parallel(one):
    result, stats = _run(ReplicaSet(_replica, 2, "cache_aware"))
    # New workflows go to the least loaded replica (4 each), their later calls to the replica
    # holding their context: the prefill of one engine, in half its time.
    assert [p["requests"] for p in stats["per_replica"]] == [len(result.records) // 2] * 2
    assert stats["prefill_tokens_computed"] == one[1]["prefill_tokens_computed"]
    assert result.tasks_per_s > 1.9 * one[0].tasks_per_s


def test_cache_aware_routes_to_the_least_loaded_when_load_is_imbalanced():
    router, prompt = CacheAwareRouter(2), list(range(64))
    assert router.route("a", prompt, [0, 0]) == 0
    assert router.route("b", prompt, [BALANCE_ABS, 0]) == 0  # balanced enough: the prefix wins
    assert router.route("c", prompt, [BALANCE_ABS + 1, 0]) == 1
    assert router.route("d", list(range(100, 164)), [1, 0]) == 1  # no match: the least loaded


def test_bench_replicas_flags(tmp_path):
    flags = ["--replay", "--model", MODEL, "--pattern", "react", "--workflows", "4", "--context", "128",
             "--gen", "4", "--obs", "4", "--rounds", "2"]
    rows = bench_workflows().main([*flags, "--replicas", "2", "--route", "round_robin",
                                   "--out", str(tmp_path)])
    row = rows[0]
    assert row["replicas"] == 2 and row["route"] == "round_robin" and len(row["per_replica"]) == 2
    assert sum(p["prompt_tokens"] for p in row["per_replica"]) == row["prompt_tokens"]
    with pytest.raises(ValueError, match="--replicas"):
        bench_workflows().main([*flags[1:], "--replicas", "2", "--out", str(tmp_path)])
