"""Multi-agent workflow benchmark (ForkKV §7: Figs. 11 and 14): closed-loop ReAct, MapReduce or
parallel-round workflows of LoRA agents on one base model, tasks/s against concurrent workflows,
per policy.

    # GPU headline: ReAct, 3 agents x 4 rounds over a 4k shared context, 64 generated + 64
    # observed tokens a turn, 4/16/32 concurrent workflows, every policy
    PYTHONPATH=. python3 scripts/bench_workflows.py --pattern react --sweep 4,16,32 \\
        --policy prefix,full_reuse,forkkv,lrshared,forkkv+fanout --context 4096 --gen 64 --obs 64 \\
        --out $OUT/react
    # MapReduce: 4 mappers + 1 reducer over a 4k document, 64 tokens each, 16 workflows
    PYTHONPATH=. python3 scripts/bench_workflows.py --pattern mapreduce --workflows 16 \\
        --policy prefix,full_reuse,forkkv,lrshared,forkkv+fanout --context 4096 --gen 64 \\
        --out $OUT/mapreduce
    # Parallel rounds (debate): 3 agents answer the same growing history at once, 4 rounds
    PYTHONPATH=. python3 scripts/bench_workflows.py --pattern parallel --sweep 16,32 --total 3x \\
        --policy prefix,forkkv+fanout --context 4096 --gen 64 --out $OUT/parallel
    # Steady state: 16 and 32 slots, each running 3x as many workflows in all (a finished
    # workflow's slot starts the next one)
    PYTHONPATH=. python3 scripts/bench_workflows.py --pattern react --sweep 16,32 --total 3x \\
        --policy prefix,forkkv,forkkv+fanout --context 4096 --gen 64 --obs 64 --out $OUT/steady
    # The same without the workflows' final lengths (the engine projects them itself)
    PYTHONPATH=. python3 scripts/bench_workflows.py --pattern react --workflows 32 --total 96 \\
        --policy forkkv --no-session-hints --out $OUT/nohints
    # Workflows with agents of their own: 32 slots x 3 agents = 96 adapters in 8 device slots
    # (swapped in as turns need them; fan-out names the workflow's group)
    PYTHONPATH=. python3 scripts/bench_workflows.py --pattern react --workflows 32 --total 3x \
        --distinct-agents --policy prefix,forkkv+fanout --context 4096 --gen 64 --obs 64 --out $OUT/distinct
    # Model-free replay on a CPU: the real scheduler and cache at the 8B geometry, a virtual
    # clock and H200 step costs (forkjax/workflows/replay.py); GPU defaults (16e9 KV bytes,
    # max batch 64, 2,048 prefill tokens a step)
    PYTHONPATH=. python scripts/bench_workflows.py --replay --pattern react --sweep 16,32 \\
        --total 3x --policy prefix,full_reuse,forkkv,lrshared,forkkv+fanout --context 4096 \\
        --gen 64 --obs 64 --out /tmp/replay
    # The same at 4 replicas (32 workflows each) behind SMG's cache_aware
    PYTHONPATH=. python scripts/bench_workflows.py --replay --pattern react --workflows 128 \\
        --total 3x --policy forkkv+fanout --replicas 4 --route cache_aware --context 4096 \\
        --gen 64 --obs 64 --out /tmp/replay-4
    # ReAct actions as JSON tool calls under constrained decoding (a model with a tokenizer):
    # the results' guided_steps counts the steps that held a constrained request
    PYTHONPATH=. python3 scripts/bench_workflows.py --model smollm2-135m --pattern react \\
        --sweep 16,64 --policy forkkv --context 1024 --gen 64 --obs 64 --tool-format json \\
        --out $OUT/react-json
    # CPU smoke run
    PYTHONPATH=. python scripts/bench_workflows.py --model tiny-llama --workflows 2 --context 64 \\
        --gen 4 --obs 4 --rounds 2 --no-warmup --out /tmp/wf

Policies: `prefix` (exact; SGLang/vLLM's prefix caching: merged K/V per adapter), `full_reuse`
(the merged K/V of whichever agent came first, shared by all: cheap and wrong), `forkkv` (shared
base K/V + per-agent residual), `lrshared` (base and residual shared; the agents share their LoRA
A, as LRAgent requires), `forkkv+fanout` (forkkv whose requests also write the residuals of their
workflow's other agents), `alora` (Activated LoRA agents under prefix: each agent's cue opens
with its invocation, before which every agent reads the base model's K/V, exactly; `--alora`
adds it to --policy). `lrshared` agents share one random A per layer and module; the other
policies' agents are independent rank-`--rank` adapters on q/k/v/o, one per agent.

Closed loop: --workflows N (or each count of --sweep) slots start their workflows at t=0, and
with --total M a finished workflow's slot starts the next one (workflow i's lengths and tokens
come from seed (--seed, i)) until M have started; M defaults to N, `--total Kx` is K·N.
`tasks_per_s` is the makespan figure (M workflows over the first submit to the last finish),
`tasks_per_s_steady` the workflows finished per second between the N-th start and the (M−N)-th
finish (null unless M > N), `tasks_per_s_sustained` the workflows' worth of calls finished per
second between the N-th and the (M−N)-th finish (null unless M > 2N; less moved by workflows
finishing in bursts): forkjax/workflows/results.py defines them. Every call carries its
workflow's session: `session_end` on its last call and, unless --no-session-hints,
`session_tokens`, the workflow's final length.

Each run also reports `prefill_tokens_minimal`, the prompt positions the policy must compute at
least (the run's requests replayed through a cache that never evicts:
forkjax/workflows/minimal.py), `recompute_ratio` = prefill_tokens_computed / that,
`workflows_running_peak` (the most workflows with a request in the running batch at once) and
`max_batch_size` (the engine's).

--replay runs the same drivers on `ReplayEngine` (forkjax/workflows/replay.py): the real
scheduler and cache at the model's full geometry with no weights, on a virtual clock whose steps
cost what H200 measurements say (with --host-kv-bytes, the host tier's copies too); its results
say `"replay": true` and carry the cost model's constants (`step_cost`). Its times (tasks/s, latencies) are modelled seconds; `wall_s` is real.
With --replicas N the replay runs N such engines, each with the pools of one, behind a router
(--route: the workflow's id hashed as SMG's consistent_hashing does, SMG's cache_aware over token
ids, or round robin; forkjax/workflows/routing.py) on one virtual clock, the replicas' steps in
parallel (forkjax/workflows/replicas.py). --workflows counts the slots of all replicas; counters
add up the replicas', and `per_replica` holds each one's (prompt and hit tokens, prefill,
requests, busy seconds).

One engine per policy, reused for every workflow count (`flush_cache()` and `reset_stats()`
before each run); its warm-up compiles every shape: `compile_s` is that warm-up's time, split in
`compile_breakdown` by JAX's monitoring events (tracing, lowering to MLIR, XLA's compile), and
`build_s` the whole engine build, weights included (JAX_COMPILATION_CACHE_DIR=DIR keeps the
programs across engines and runs; `compile_s` then counts loading them). Lengths of the fixed profile: --context (shared, read first),
--instruction (each agent's cue or instruction, read last), --gen and --obs (ReAct's tool
observation) tokens; --profile loogle|narrativeqa|apigen draws them instead. The KV budget
defaults to 16e9 bytes on a GPU and with --replay: what a 40-80 GB GPU keeps for K/V beside a larger model's
weights, i.e. the memory contention ForkKV is about (an H200 would otherwise give ~100 GB, where no
policy runs out of room); 64 MiB on a CPU. `per_agent_kv_bytes` is measured once per policy,
before its runs, in a budget that evicts nothing: the cache flushed, ONE workflow of the same
shape (no tool latency) runs alone, and the bytes both pools hold at its end are divided by its
agents.

--http measures what a user of the server gets: each workflow count runs against a `python -m
forkjax.serve` process of its own (forkjax/workflows/local_server.py; its log in
DIR/server-logs/), serving the agents as PEFT directories (`--lora`) with the flags that build
the in-process engine (workflow_engines.server_flags) and `--warmup full`, driven by the openai
client in this process (forkjax/workflows/http_driver.py), which starts no JAX backend (a child
process tells the device for the defaults). A run's counters are differences of the server's
/metrics around it and a fresh cache is POST /flush_cache; the decode batch mean and the
workflows' peak run from the server's start, which nothing resets, hence a server per count.
`per_agent_kv_bytes` is measured on the first count's server, after its run, as above.
--router URL drives a running `python -m forkjax.cluster` instead (several servers behind SMG,
started with the cache policy of --policy and flags of the user's choice, e.g. those
workflow_engines.server_flags gives): the agents are loaded into every worker, each workflow's
calls carry its id as the routing key, and a run's counters add up every worker's. A cluster
started with --api-key K wants OPENAI_API_KEY=K in the environment (the openai client's
variable; not a flag, which results.json's `command` would record).
`server_start_s` is launch to ready (weights and warm-up, the server's compilation cache
included); `build_s`, `compile_s` and `compile_breakdown` are null (in-process runs: null
`server_start_s`). Not with --replay, --step-log, --compile-workers nor --distinct-agents.

Output: a single run writes DIR/results.json; several (a sweep, or policies) write
DIR/<policy>-<N>/results.json each (`forkkv+fanout` as `forkkv-fanout`), DIR/summary.csv, DIR/throughput.png (Fig. 11 style) and
DIR/breakdown.png (Fig. 14 style), all rewritten after every run.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import jax

from forkjax.engine import memory
from forkjax.engine.loading import describe_model
from forkjax.models.builtin import BUILTIN_CONFIGS
from forkjax.models.gguf import PACKAGED
from forkjax.sizes import size_flag
from forkjax.workflows import (PATTERNS, PROFILES, TokenSampler, agent_names, get_profile,
                               longest_request, make_workflows, workflow_source)
from forkjax.workflows.agents import agent_invocations
from forkjax.workflows.minimal import prefill_tokens_minimal
from forkjax.workflows.react import TOOL_FORMATS
from forkjax.workflows.report import summary_line, write_json, write_summary
from forkjax.workflows.routing import ROUTES
from forkjax.workflows.runners import InProcess, OverHttp, OverRouter
from provenance import run_info  # scripts/ is on sys.path when this script runs
from workflow_engines import PAGE_SIZE, build_engine, build_replay, engine_policy, policy_adapters, server_flags

POLICIES = ("prefix", "full_reuse", "forkkv", "lrshared", "forkkv+fanout", "alora")
GPU_KV_BYTES, CPU_KV_BYTES = int(16e9), 64 << 20
# The GPU's and the replay's max batch: the H200 tables and the replay's step costs were measured
# at 64; the running batch of these workflows stays below it.
GPU_MAX_BATCH = 64
FIXED_DEFAULTS = dict(context=4096, gen=64, obs=64, instruction=8)
# The host tier's counters (engine stats; zero without --host-kv-bytes)
HOST_KEYS = ("host_hit_tokens", "host_bytes_loaded", "host_bytes_stored", "host_bytes_used",
             "host_load_stall_s")
# Adapter swapping's (engine stats; zero while every adapter has a device slot)
LORA_KEYS = ("lora_swaps", "lora_swap_bytes", "lora_swap_wait_s")



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.1-8b-random", help="built-in name or HF checkpoint dir "
                   "(%(default)s; tiny-llama on a CPU)")
    p.add_argument("--pattern", default="react", choices=PATTERNS)
    n = p.add_mutually_exclusive_group()
    n.add_argument("--workflows", type=int, default=None, help="concurrent workflows (4)")
    n.add_argument("--sweep", default=None, help="comma list of workflow counts, e.g. 1,2,4,8,16,32")
    p.add_argument("--total", default=None, help="workflows in all, M >= N, or Kx for K times N: a "
                   "finished workflow's slot starts the next one (default: N)")
    p.add_argument("--no-session-hints", dest="session_hints", action="store_false",
                   help="calls do not tell the engine their workflow's final length (session_tokens)")
    p.add_argument("--replay", action="store_true", help="model-free: the real scheduler and cache "
                   "at the model's geometry, a virtual clock and H200 step costs (replay.py)")
    p.add_argument("--replicas", type=int, default=None, help="with --replay: N replicas, each with "
                   "the pools of one, behind a router on one virtual clock (workflows/replicas.py)")
    p.add_argument("--route", default=None, choices=ROUTES, help="with --replicas: the router's "
                   "policy, SMG's (workflows/routing.py): the workflow id hashed (default), cache_aware, "
                   "round_robin")
    p.add_argument("--policy", default="forkkv", help=f"one or a comma list of {', '.join(POLICIES)}")
    p.add_argument("--residual-fanout", action="store_true", help="run every forkkv as forkkv+fanout")
    p.add_argument("--alora", action="store_true", help="run the alora policy too: Activated LoRA agents")
    p.add_argument("--residual-fraction", type=float, default=None,
                   help="share of the KV budget for the residual pool (engine default)")
    p.add_argument("--schedule-policy", default="lpm", choices=("lpm", "fifo"))
    p.add_argument("--kv-cache-bytes", type=size_flag, default=None,
                   help="KV budget in bytes (16e9 on a GPU and with --replay, 64 MiB on a CPU)")
    p.add_argument("--host-kv-bytes", type=size_flag, default=0,
                   help="host memory for KV pages evicted from the device (the host tier; 0: off)")
    p.add_argument("--profile", default="fixed", choices=("fixed", *PROFILES),
                   help="lengths: fixed (the flags below) or a dataset's (forkjax/workflows/profiles.py)")
    for name, default in FIXED_DEFAULTS.items():
        p.add_argument(f"--{name}", type=int, default=None, help=f"{name} tokens, fixed profile ({default})")
    p.add_argument("--rounds", type=int, default=4,
                   help="ReAct and parallel rounds (a turn of every agent each)")
    p.add_argument("--agents", type=int, default=3, help="ReAct and parallel agents")
    p.add_argument("--mappers", type=int, default=4, help="MapReduce mappers (plus one reducer)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of every agent")
    p.add_argument("--distinct-agents", action="store_true",
                   help="every workflow slot brings agents of its own (N slots x agents adapters: "
                        "workflow i runs group i %% N, the largest N of the sweep); fan-out names the group, "
                        "the residual pool has room for a workflow's agents")
    p.add_argument("--max-loras", type=int, default=None,
                   help="device adapter slots, the base model's included (default: one per agent, at "
                        "most 8 with --distinct-agents; more adapters swap in)")
    p.add_argument("--lora-path", choices=("fused", "sgmv"), default="fused",
                   help="the LoRA matmuls (Engine.from_pretrained lora_path)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices the model is split over (--kv-cache-bytes is per device; not "
                        "with --replay, whose step costs are one device's)")
    p.add_argument("--tool-latency", type=float, default=0.0, help="seconds a ReAct tool call takes")
    p.add_argument("--tool-format", default="text", choices=TOOL_FORMATS,
                   help="ReAct actions as free text (random tokens) or as JSON tool calls that constrained "
                        "decoding enforces (needs a model with a tokenizer: tiny-llama, smollm2-135m, ...)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="(64 on a GPU and with --replay; the engine's default, 16, on a CPU)")
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--compile-workers", type=int, default=None,
                   help="threads compiling the warm-up's shapes (default: the host's cores)")
    p.add_argument("--no-warmup", action="store_true", help="compile lazily (tests; compile_s then "
                   "excludes most compiles)")
    p.add_argument("--http", action="store_true", help="drive a `python -m forkjax.serve` process over "
                   "HTTP with the openai client instead of the engine API")
    p.add_argument("--router", metavar="URL", help="drive a running `python -m forkjax.cluster` gateway "
                   "at URL over HTTP (each workflow's calls carry its routing key); its workers' "
                   "--cache-policy must be --policy's one policy")
    p.add_argument("--step-log", action="store_true", help="results.json gets `steps`: every step's kind, "
                   "requests, tokens computed and attended, and device seconds (EngineStats.step_log)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workflows' lengths and tokens")
    p.add_argument("--out", default="bench_workflows_out", help="output directory")
    return p


def check_args(args) -> tuple[list[str], list[int], dict | None]:
    """Validate flags (ValueError naming the flag) and fill defaults -> (policies, counts, the
    server's device with --http: local_server.probe_device); `args.totals` becomes {N: M}."""
    policies = [s.strip() for s in args.policy.split(",")]
    bad = [s for s in policies if s not in POLICIES]
    if bad or len(set(policies)) != len(policies):
        raise ValueError(f"--policy {args.policy!r}: expected distinct names among {', '.join(POLICIES)}")
    if args.residual_fanout:
        if "forkkv" not in policies:
            raise ValueError("--residual-fanout applies to the forkkv policy, which --policy lacks")
        policies = list(dict.fromkeys("forkkv+fanout" if s == "forkkv" else s for s in policies))
    if args.alora:
        policies = list(dict.fromkeys(policies + ["alora"]))
    try:
        counts = [int(s) for s in args.sweep.split(",")] if args.sweep else [args.workflows or 4]
    except ValueError:
        raise ValueError(f"--sweep {args.sweep!r}: expected a comma list of ints") from None
    for name in ("rounds", "agents", "mappers", "rank", "max_prefill_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if min(counts) < 1:
        raise ValueError(f"workflow counts {counts}: expected >= 1")
    args.totals = {n: total_of(args.total, n) for n in counts}
    if args.http and args.router:
        raise ValueError("--http starts a server of its own; --router drives a running cluster: one of them")
    if args.router and len(policies) != 1:
        raise ValueError(f"--router: the cluster runs one cache policy; --policy {args.policy!r} names several")
    remote = "--http" if args.http else "--router" if args.router else None
    if remote and (args.replay or args.step_log):
        raise ValueError(f"--{'replay' if args.replay else 'step-log'} drives the engine in process: "
                         f"not with {remote}")
    if args.tool_latency < 0 or (args.tool_latency and args.pattern != "react"):
        raise ValueError(f"--tool-latency={args.tool_latency}: seconds >= 0, for --pattern react only")
    if args.tool_format != "text" and (args.pattern != "react" or args.replay):
        raise ValueError(f"--tool-format {args.tool_format}: for --pattern react, in an engine "
                         "(not with --replay)")
    if args.replicas is not None and (not args.replay or args.step_log or args.replicas < 1):
        raise ValueError(f"--replicas={args.replicas}: expected >= 1, with --replay and without "
                         "--step-log")
    if args.route and args.replicas is None:
        raise ValueError(f"--route {args.route}: routes requests over --replicas, which is not given")
    args.route = args.route or ("hash" if args.replicas else None)
    if args.replay and args.tensor_parallel_size != 1:
        raise ValueError("--replay prices one device's steps: leave --tensor-parallel-size at 1")
    if remote and args.compile_workers is not None:
        raise ValueError(f"--compile-workers: the server compiles on its own threads; not with {remote}")
    if args.distinct_agents and remote:
        raise ValueError(f"--distinct-agents: in process only, not with {remote}")
    if args.residual_fraction is not None and not 0 < args.residual_fraction < 1:
        raise ValueError(f"--residual-fraction={args.residual_fraction}: expected a fraction in (0, 1)")
    if args.model not in (*BUILTIN_CONFIGS, *PACKAGED) and not os.path.isdir(args.model):
        raise ValueError(f"--model {args.model!r}: not a built-in model "
                         f"({', '.join([*BUILTIN_CONFIGS, *PACKAGED])}) nor a checkpoint directory")
    given = [k for k in FIXED_DEFAULTS if getattr(args, k) is not None]
    if args.profile != "fixed" and given:
        raise ValueError(f"--{', --'.join(given)}: lengths of the fixed profile; --profile "
                         f"{args.profile} draws its own")
    for k, v in FIXED_DEFAULTS.items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    device = None
    if remote:  # the server owns the device: this process starts no JAX backend
        from forkjax.workflows.local_server import probe_device  # the serve extra: httpx
        device = probe_device()
    else:
        memory.reserve_pinned_host(args.host_kv_bytes)  # before jax starts its GPU client, below
    on_gpu = args.replay or (device["backend"] if device else jax.default_backend()) == "gpu"
    if args.kv_cache_bytes is None:
        args.kv_cache_bytes = GPU_KV_BYTES if on_gpu else CPU_KV_BYTES
    if args.max_batch_size is None and on_gpu:
        args.max_batch_size = GPU_MAX_BATCH
    if args.kv_cache_bytes < 1:
        raise ValueError(f"--kv-cache-bytes={args.kv_cache_bytes}: expected > 0")
    if args.max_loras is not None and args.max_loras < 1:
        raise ValueError(f"--max-loras={args.max_loras}: expected >= 1")
    args.agents_per_workflow = len(agent_names(args.pattern, agents=args.agents, mappers=args.mappers))
    args.groups = max(counts) if args.distinct_agents else 0
    if args.distinct_agents and args.max_loras is None:
        args.max_loras = min(8, args.groups * args.agents_per_workflow + 1)
    return policies, counts, device


def total_of(total: str | None, n: int) -> int:
    """--total's M for N slots: an int, or Kx for K·N; N without the flag."""
    if total is None:
        return n
    try:
        m = int(total[:-1]) * n if total.endswith("x") else int(total)
    except ValueError:
        raise ValueError(f"--total {total!r}: expected an int or Kx (K times the workflows)") from None
    if m < n:
        raise ValueError(f"--total {total!r}: {m} workflows in all for {n} slots; expected >= {n}")
    return m


def workflow_shape(args, policy: str) -> dict:
    """The shape keywords of `make_workflows` and `workflow_source` under `policy`."""
    return dict(seed=args.seed, agents=args.agents, rounds=args.rounds, mappers=args.mappers,
                groups=args.groups, **({"tool_format": args.tool_format} if args.pattern == "react" else {}),
                **({"invocations": args.invocations} if policy == "alora" else {}))


def all_agent_names(args) -> list[str]:
    """The adapters the engine loads: one workflow's agents, or every group's (--distinct-agents)."""
    shape = dict(agents=args.agents, mappers=args.mappers)
    if not args.groups:
        return agent_names(args.pattern, **shape)
    return [n for g in range(args.groups) for n in agent_names(args.pattern, **shape, group=g)]


def per_agent_kv(runner, args, policy: str, names: list[str], profile, tokens) -> float:
    """Bytes both pools hold after one workflow ran alone in an empty cache whose budget evicts
    nothing (tool latency changes no KV), divided by its agents."""
    runner.fresh()
    shape = workflow_shape(args, policy)
    _, one = runner.run(make_workflows(args.pattern, 1, profile, tokens, **shape), desc=f"{policy} x1 KV")
    return (one["base_bytes_used"] + one["residual_bytes_used"]) / args.agents_per_workflow


def run_point(runner, args, policy: str, n: int, profile, tokens, *, page_size: int,
              max_batch_size: int) -> dict:
    """One timed run of `n` slots over `args.totals[n]` workflows on an engine of `page_size`
    and `max_batch_size` (as it resolved them)."""
    shape = workflow_shape(args, policy)
    total = args.totals[n]
    runner.fresh()
    if args.step_log:
        runner.engine.metrics.record_steps()
    t = time.perf_counter()
    source = workflow_source(args.pattern, n, total, profile, tokens, tool_latency=args.tool_latency,
                             **shape)
    result, stats = runner.run(source, desc=f"{policy} x{n}" + (f" ({total} in all)" if total > n else ""))
    wall_s = time.perf_counter() - t
    steps = {"steps": runner.engine.metrics.record_steps(False)} if args.step_log else {}
    minimal = prefill_tokens_minimal(result.records, engine_policy(policy), page_size,
                                     fanout=policy == "forkkv+fanout",
                                     invocations=args.invocations if policy == "alora" else None)
    prompt = stats["prompt_tokens"]
    computed = stats.get("prefill_tokens_computed")
    per_replica = {"per_replica": stats["per_replica"]} if "per_replica" in stats else {}
    return {**result.summary(), "policy": policy, "workflows": n, "total": total, "wall_s": wall_s,
            "session_hints": args.session_hints,
            "max_batch_size": max_batch_size,
            "base_hit_rate": stats["base_hit_tokens"] / prompt,
            "residual_hit_rate": stats["residual_hit_tokens"] / prompt,
            "prefill_tokens_minimal": minimal,
            "recompute_ratio": None if computed is None or not minimal else computed / minimal,
            "workflows_running_peak": stats.get("workflows_running_peak"),
            **{k: stats.get(k) for k in ("decode_batch_size_mean", "prefill_tokens_computed",
                                         "prompt_tokens", "base_hit_tokens", "residual_hit_tokens",
                                         "preemptions", "workflows_suspended", "guided_steps", *HOST_KEYS,
                                         *LORA_KEYS)}, **steps, **per_replica}


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    policies, counts, device = check_args(args)
    fixed = {k: getattr(args, k) for k in FIXED_DEFAULTS} if args.profile == "fixed" else {}
    profile = get_profile(args.profile, **fixed)
    cfg = describe_model(args.model)[0]
    tokens = TokenSampler.for_model(cfg)
    names = all_agent_names(args)
    args.invocations = agent_invocations(cfg, names)  # the alora policy's agents'
    longest = longest_request(args.pattern, profile, agents=args.agents, rounds=args.rounds,
                              mappers=args.mappers)
    max_model_len = -(-longest // 1024) * 1024
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"the longest request ({longest} tokens) exceeds {args.model}'s context of "
                         f"{cfg.max_position_embeddings}")
    meta = {**{k: v for k, v in vars(args).items() if k != "totals"},
            "max_model_len": max_model_len, **run_info(__file__, argv, device)}
    single = len(policies) == 1 and len(counts) == 1
    shown = ("context", "gen", "obs") if args.pattern == "react" else ("context", "gen")
    lengths = ", ".join(f"{k} {fixed[k]}" for k in shown) if fixed else f"{args.profile} lengths"
    title = (f"{'replay: ' if args.replay else ''}{args.model} {args.pattern}, {args.agents_per_workflow} agents"
             f"{f' x {args.groups} groups' if args.groups else ''}, {lengths}")
    rows = []
    for policy in policies:
        runs = over_http if args.http else over_router if args.router else in_process
        for point in runs(args, policy, counts, names, cfg, max_model_len, profile, tokens, device):
            row = {**meta, **point}
            rows.append(row)
            run_dir = f"{policy.replace('+', '-')}-{row['workflows']}"  # names a device's file transfer keeps
            write_json(os.path.join(args.out, "results.json" if single else f"{run_dir}/results.json"), row)
            if not single:
                write_summary(args.out, rows, title)
            print(summary_line(row), flush=True)
        gc.collect()  # the next policy's pools need this one's memory
    return rows


def in_process(args, policy: str, counts, names, cfg, max_model_len, profile, tokens, device=None):
    """Yield each count's point of `policy` on one engine (or replay), reused for every count:
    flushed and its counters reset before each run; the KV per agent measured first."""
    if args.replay:
        engine, build = build_replay(args, policy, names, max_model_len)
        runner = InProcess(engine, policy == "forkkv+fanout", args.session_hints, clock=engine.clock,
                           sleep=engine.sleep)
    else:
        engine, build = build_engine(args, policy, names, cfg, max_model_len)
        runner = InProcess(engine, policy == "forkkv+fanout", args.session_hints)
    kv = per_agent_kv(runner, args, policy, names, profile, tokens)  # the same at every n
    for n in counts:
        one = engine.replicas[0] if args.replicas else engine
        point = run_point(runner, args, policy, n, profile, tokens, page_size=one.cache.page_size,
                          max_batch_size=engine.scheduler.max_batch_size)
        yield {**point, "per_agent_kv_bytes": kv, **build, "server_start_s": None}


def over_http(args, policy: str, counts, names, cfg, max_model_len, profile, tokens, device):
    """Yield each count's point of `policy` on a `python -m forkjax.serve` process of its own
    serving the agents as PEFT directories: the server's decode batch mean and workflows peak run
    from its start, so each count gets a fresh one. The KV per agent is measured on the first,
    after its run."""
    from forkjax.workflows.local_server import ServerProcess, lora_flags  # the serve extra: httpx
    adapters = policy_adapters(args, policy, names, cfg)
    kv = None
    with tempfile.TemporaryDirectory(prefix="forkjax-agents-") as root:
        flags = [*server_flags(args, policy, names, max_model_len), *lora_flags(adapters, root)]
        for n in counts:
            log = os.path.join(args.out, "server-logs", f"{policy.replace('+', '-')}-{n}.log")
            with ServerProcess(args.model, flags, log_path=log) as server:
                print(f"{policy}: server ready in {server.start_s:.1f} s ({log})", flush=True)
                runner = OverHttp(server, policy == "forkkv+fanout", args.session_hints)
                point = run_point(runner, args, policy, n, profile, tokens, page_size=PAGE_SIZE,
                                  max_batch_size=args.max_batch_size or device["max_batch_size"])
                if kv is None:
                    kv = per_agent_kv(runner, args, policy, names, profile, tokens)
            yield {**point, "per_agent_kv_bytes": kv, "build_s": None, "compile_s": None,
                   "compile_breakdown": None, "server_start_s": server.start_s}


def over_router(args, policy: str, counts, names, cfg, max_model_len, profile, tokens, device):
    """Yield each count's point of `policy` on the running cluster behind `args.router`: the
    agents are loaded into every worker as PEFT directories (POST /v1/load_lora_adapter, kept
    in place if a previous run loaded them); the KV per agent is measured after the first run."""
    import httpx

    from forkjax.lora.peft import save_peft_adapter
    runner = OverRouter(args.router, policy == "forkkv+fanout", args.session_hints,
                        os.environ.get("OPENAI_API_KEY"))
    root = os.path.join(os.path.abspath(args.out), "agents")
    for name, adapter in policy_adapters(args, policy, names, cfg).items():
        path = save_peft_adapter(adapter, os.path.join(root, name))
        for w in runner.workers:
            httpx.post(f"{w}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path,
                                                          "load_inplace": True},
                       headers=runner.headers, timeout=600).raise_for_status()
    kv = None
    for n in counts:
        point = run_point(runner, args, policy, n, profile, tokens, page_size=PAGE_SIZE,
                          max_batch_size=args.max_batch_size or device["max_batch_size"])
        if kv is None:
            kv = per_agent_kv(runner, args, policy, names, profile, tokens)
        yield {**point, "per_agent_kv_bytes": kv, "replicas": len(runner.workers), "build_s": None,
               "compile_s": None, "compile_breakdown": None, "server_start_s": None}


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"bench_workflows.py: error: {e}")
