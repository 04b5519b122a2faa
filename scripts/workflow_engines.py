"""The engines scripts/bench_workflows.py runs a policy on: a real one, its warm-up's compile
times recorded, or the model-free replay (forkjax/workflows/replay.py), both sized for the run's
agents; with --http the `python -m forkjax.serve` flags that build the same real engine in a
server (`server_flags`).
"""

from __future__ import annotations

import inspect
import time

import forkjax
from forkjax.config import ModelConfig
from forkjax.runtime.compiler import CompileTimes
from forkjax.workflows.agents import ATTENTION, agent_adapters

WITH_RESIDUAL = ("forkkv", "lrshared", "forkkv+fanout")  # policies with a residual pool


def engine_policy(policy: str) -> str:
    """The engine's cache policy of a benchmark policy: `forkkv+fanout` is forkkv's; `alora`
    (Activated LoRA agents, exact under every policy) runs under prefix, all its KV budget in
    the one pool."""
    return {"forkkv+fanout": "forkkv", "alora": "prefix"}.get(policy, policy)


def policy_adapters(args, policy: str, names: list[str], cfg: ModelConfig) -> dict:
    """The agents' adapters under benchmark `policy` (workflows/agents.py)."""
    return agent_adapters(cfg, names, args.rank, shared_a=policy == "lrshared", alora=policy == "alora")
# The in-process engines take Engine.from_pretrained's default page size; a server is told it.
PAGE_SIZE = inspect.signature(forkjax.Engine.from_pretrained).parameters["page_size"].default


COMPILE_TIMES = CompileTimes()


def build_engine(args, policy: str, names: list[str], cfg: ModelConfig, max_model_len: int):
    """-> (engine for `policy` with one adapter per agent, {build_s, compile_s, breakdown})."""
    adapters = policy_adapters(args, policy, names, cfg)
    before = dict(COMPILE_TIMES.totals)
    t = time.perf_counter()
    engine = forkjax.Engine.from_pretrained(
        args.model, adapters=adapters, cache_policy=engine_policy(policy),
        dtype=args.dtype, kv_cache_bytes=args.kv_cache_bytes, max_batch_size=args.max_batch_size,
        max_loras=args.max_loras or len(names) + 1, lora_path=args.lora_path,
        tensor_parallel_size=args.tensor_parallel_size, residual_fanout=policy == "forkkv+fanout",
        **residual_sizing(args, policy), schedule_policy=args.schedule_policy,
        max_model_len=max_model_len,
        max_prefill_tokens=args.max_prefill_tokens, host_kv_bytes=args.host_kv_bytes,
        warmup=not args.no_warmup, progress=True,
        compile_workers=args.compile_workers)
    return engine, dict(build_s=time.perf_counter() - t, compile_s=engine.warmup_s,
                        compile_breakdown=COMPILE_TIMES.since(before))


def server_flags(args, policy: str, names: list[str], max_model_len: int) -> list[str]:
    """The `python -m forkjax.serve` flags (less --model, --lora and the address) that build the
    engine `build_engine` builds, keyword for keyword; the warm-up compiles every shape before
    the server says it is ready (--warmup full)."""
    flags = ["--cache-policy", engine_policy(policy), "--dtype", args.dtype,
             "--kv-cache-bytes", str(args.kv_cache_bytes), "--max-loras", str(args.max_loras or len(names) + 1),
             "--lora-path", args.lora_path, "--tensor-parallel-size", str(args.tensor_parallel_size),
             "--schedule-policy", args.schedule_policy, "--max-model-len", str(max_model_len),
             "--max-prefill-tokens", str(args.max_prefill_tokens), "--host-kv-bytes", str(args.host_kv_bytes),
             "--lora-target-modules", *ATTENTION, "--page-size", str(PAGE_SIZE),
             "--warmup", "none" if args.no_warmup else "full"]
    if args.max_batch_size is not None:
        flags += ["--max-batch-size", str(args.max_batch_size)]
    if policy in ("forkkv", "forkkv+fanout"):  # the server's default for forkkv is fan-out on
        flags.append("--residual-fanout" if policy == "forkkv+fanout" else "--no-residual-fanout")
    for key, value in residual_sizing(args, policy).items():
        if value is not None:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


def residual_sizing(args, policy: str) -> dict:
    """The residual pool's sizing keyword: --residual-fraction, or with --distinct-agents room for
    a workflow's agents' residuals of each base token (the engine's default, every adapter that
    fits a slot, would spend the budget on copies no context has)."""
    if policy not in WITH_RESIDUAL:
        return {}
    if args.residual_fraction is None and args.distinct_agents and policy != "lrshared":
        return dict(residual_copies=args.agents_per_workflow)
    return dict(residual_fraction=args.residual_fraction)


def build_replay(args, policy: str, names: list[str], max_model_len: int):
    """-> (ReplayEngine for `policy` over the agents `names`, or with --replicas a ReplicaSet of
    them behind --route, its build record)."""
    from forkjax.workflows.replay import ReplayEngine
    from forkjax.workflows.replicas import ReplicaSet
    t = time.perf_counter()

    def replica(i: int = 0) -> ReplayEngine:
        return ReplayEngine(args.model, names, cache_policy=engine_policy(policy),
                            residual_fanout=policy == "forkkv+fanout", kv_cache_bytes=args.kv_cache_bytes,
                            max_batch_size=args.max_batch_size, max_prefill_tokens=args.max_prefill_tokens,
                            max_model_len=max_model_len, rank=args.rank, dtype=args.dtype,
                            **residual_sizing(args, policy), schedule_policy=args.schedule_policy,
                            host_kv_bytes=args.host_kv_bytes, max_loras=args.max_loras, seed=args.seed + i,
                            invocations=args.invocations if policy == "alora" else None)
    engine = replica() if args.replicas is None else ReplicaSet(replica, args.replicas, args.route)
    return engine, dict(build_s=time.perf_counter() - t, compile_s=0.0, compile_breakdown={},
                        **engine.describe())
