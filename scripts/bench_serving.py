"""Serving benchmark (vLLM's `vllm bench serve`, SGLang's `bench_serving`): request and token
throughput, TTFT, inter-token and end-to-end latency of a stream of requests, and the run's
roofline time.

    # GPU, offline: 1000 requests of 1024 -> 128 tokens, all at t=0
    PYTHONPATH=. python3 scripts/bench_serving.py --num-prompts 1000 --out $OUT/offline
    # Poisson arrivals at 8 requests/s, ShareGPT-like lengths, over 8 rank-16 adapters
    PYTHONPATH=. python3 scripts/bench_serving.py --request-rate 8 --dataset sharegpt --adapters 8 \\
        --out $OUT/poisson
    # 32 clients in a closed loop over HTTP (a `python -m forkjax.serve` process, the openai
    # client streaming)
    PYTHONPATH=. python3 scripts/bench_serving.py --max-concurrency 32 --http --out $OUT/http
    # CPU smoke run
    PYTHONPATH=. python scripts/bench_serving.py --model tiny-llama --num-prompts 8 --input-len 32 \\
        --output-len 8 --no-warmup --dtype float32 --out /tmp/serving

Load (vLLM's flags): every request arrives at t=0 (offline) unless --request-rate R gives Poisson
arrivals, R requests/s (exponential gaps seeded by --seed, the first at t=0); --max-concurrency C
keeps at most C requests in flight: alone, a closed loop of C clients, each sending its next
request when its last one finishes. A request's clock starts when it is sent: at its arrival,
or under --max-concurrency when a slot frees.

Drivers: in process (default), the Engine's serving API as a server's engine thread drives it
(`add_request`, `step`): a request arriving while a step runs is queued at its arrival time and
added after the step, and its tokens are timed when a step's results reach the host. --http:
what a user of the server gets: a `python -m forkjax.serve` process (workflows/local_server.py;
its log in DIR/server.log) serving the adapters as PEFT directories (`--lora`) with the flags
that build the in-process engine (`server_flags`) and `--warmup full`; each request is a
streaming /v1/completions call of the openai client in this process (prompt as token ids,
`return_token_ids`), its tokens timed as the chunks carrying them arrive. The client and the
server run in processes of their own, as in a deployment, and this one starts no JAX backend (a
child process tells the device for the defaults).

Workload: --num-prompts requests of random token ids (seeded, no special tokens), greedy, EOS
ignored, so each generates exactly its drawn output length. Lengths, --dataset:
  fixed     --input-len and --output-len;
  uniform   integers uniform in [len·(1 − r), len·(1 + r)] for each, r = --range-ratio (vLLM's
            random dataset with --random-range-ratio; --output-range-ratio sets the outputs' own);
  sharegpt  synthetic (no dataset download): lognormal lengths clipped to [4, 1024] each (vLLM's
            ShareGPT filter keeps prompts of at most 1024 tokens and 2048 with the output),
            log-space sigma 1.2 for inputs and 0.8 for outputs, located so that the clipped means
            are ShareGPT's as the vLLM paper reports them (Kwon et al., SOSP 2023, Fig. 11a:
            161.31 input, 337.99 output tokens). Only the means come from the paper: the
            lognormal shape, the sigmas and the independence of the two lengths are assumptions.
--adapters N: N rank-16 adapters on q/k/v/o with seeded random weights (workflows/agents.py),
request i on adapter i mod N; 0: the base model.

Metrics (ms; mean, p50, p90, p99 over requests): ttft, send to first token; itl, the gaps between
a request's consecutive token arrivals (a gap bringing k tokens at once, a stream chunk carrying
k, counts k times as gap/k: SGLang's convention); tpot, (e2el − ttft) / (output − 1); e2el, send to
last token; only requests that generated their whole output count (`completed`). Throughputs
are over `duration_s` (also `wall_s`), t=0 to the last token. `decode_batch_size_mean` and
`preemptions` are the engine's (--http: from the server's /metrics before and after the run).
`roofline_s` (serving_roofline.py says how) is the least time the run's steps could take at the
copy and matmul rates measured first; `efficiency` = roofline_s / wall_s (idle time between
arrivals counts), `efficiency_busy` = roofline_s / `device_s`, the steps' device seconds. The
roofline needs the engine's step log, in process only: with --http it and its inputs (`rates`,
`step_costs`, `step_log`) are null. The engine warm-up compiles every step shape before the run
(`compile_s`; --http: `server_start_s`, launch to ready, weights and the server's compilation
cache included, and `build_s`, `compile_s` null); with --no-warmup the steps compile as the run
first needs them, inside its timings. `config` is the engine's settings as it resolved them;
with --http as the server's flags set them (null: the server's default), `kv_pool_bytes` from
its /metrics.

Output: DIR/results.json (the metrics, every request's lengths and times, the engine's step log,
the rates and cost coefficients of the roofline) and a one-line summary on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from collections import deque

import jax

import forkjax
from forkjax.config import CACHE_POLICIES, ModelConfig
from forkjax.engine import memory
from forkjax.engine.sequence import SamplingParams, Status
from forkjax.engine.loading import describe_model
from forkjax.sizes import size_flag
from forkjax.workflows.agents import ATTENTION, agent_adapters
# scripts/ is on sys.path when a script runs
from serving_metrics import Timing, latency_metrics
from serving_roofline import StepCosts, measure_rates, roofline
from serving_workload import SampleRequest, adapter_names, workload
from provenance import run_info

LORA_RANK = 16
# roofline()'s keys: null over HTTP
ROOFLINE_KEYS = ("roofline_s", "roofline_decode_s", "roofline_extend_s", "device_s", "num_steps",
                 "total_flops", "total_bytes")


def log(msg: str):
    print(msg, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="built-in name or HF checkpoint dir "
                   "(llama3-8b-random on a GPU, tiny-llama on a CPU)")
    p.add_argument("--policy", default="prefix", choices=CACHE_POLICIES, help="KV cache policy")
    p.add_argument("--residual-fanout", action=argparse.BooleanOptionalAction, default=None,
                   help="forkkv: requests write the other adapters' residuals (default: the engine's, on)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--dataset", default="fixed", choices=("fixed", "uniform", "sharegpt"))
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (fixed, uniform: 1024)")
    p.add_argument("--output-len", type=int, default=None, help="generated tokens (fixed, uniform: 128)")
    p.add_argument("--range-ratio", type=float, default=None,
                   help="uniform: lengths in [len·(1-r), len·(1+r)] (0.5)")
    p.add_argument("--output-range-ratio", type=float, default=None,
                   help="uniform: the output lengths' r, if not --range-ratio's (0 for fixed outputs)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals, "
                   "requests/s (default inf: all at t=0)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--adapters", type=int, default=0, help="rank-16 q/k/v/o adapters, round-robin")
    p.add_argument("--http", action="store_true", help="stream over HTTP from a `python -m forkjax.serve` process")
    p.add_argument("--client-procs", type=int, default=4,
                   help="--http: processes the client's requests are spread over (%(default)s)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="requests a step runs at most (the engine's default: engine/memory.py)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens an extend step computes at most (the engine's default, 2048)")
    p.add_argument("--kv-cache-bytes", type=size_flag, default=None,
                   help="KV pool bytes, e.g. 24e9, 24GB, 16GiB (the engine's default: engine/memory.py)")
    p.add_argument("--host-kv-bytes", type=size_flag, default=0,
                   help="host tier bytes (default 0: none, as vLLM's and SGLang's defaults)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--no-warmup", action="store_true", help="compile lazily, inside the run")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, tokens and arrivals")
    p.add_argument("--out", default="bench_serving_out", help="output directory")
    return p


def check_args(args) -> dict | None:
    """Validate flags (ValueError naming the flag) and fill the defaults -> with --http, the
    server's device (local_server.probe_device)."""
    for name in ("num_prompts", "input_len", "output_len", "max_concurrency", "max_batch_size",
                 "client_procs"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v}: expected >= 1")
    if not args.request_rate > 0 or args.adapters < 0:
        raise ValueError("--request-rate must be > 0 and --adapters >= 0")
    for flag in ("range_ratio", "output_range_ratio"):
        if getattr(args, flag) is not None and args.dataset != "uniform":
            raise ValueError(f"--{flag.replace('_', '-')} applies to --dataset uniform, not {args.dataset}")
    if args.dataset == "sharegpt" and (args.input_len or args.output_len):
        raise ValueError("--input-len, --output-len: --dataset sharegpt draws its own lengths")
    if args.dataset != "sharegpt":
        args.input_len, args.output_len = args.input_len or 1024, args.output_len or 128
    if args.dataset == "uniform":
        args.range_ratio = 0.5 if args.range_ratio is None else args.range_ratio
        if args.output_range_ratio is None:
            args.output_range_ratio = args.range_ratio
    for flag in ("range_ratio", "output_range_ratio"):
        if (r := getattr(args, flag)) is not None and not 0 <= r < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={r}: expected a ratio in [0, 1)")
    if args.model is not None:
        try:
            describe_model(args.model)
        except ValueError as e:
            raise ValueError(f"--model: {e}") from None
    device = None
    if args.http:  # the server owns the device: this process starts no JAX backend
        from forkjax.workflows.local_server import probe_device  # the serve extra: httpx
        device = probe_device()
    else:
        memory.reserve_pinned_host(args.host_kv_bytes)  # before jax starts its GPU client, below
    if args.model is None:
        on_gpu = (device["backend"] if device else jax.default_backend()) == "gpu"
        args.model = "llama3-8b-random" if on_gpu else "tiny-llama"
    return device


# ---- the drivers --------------------------------------------------------------------------------

def run_in_process(engine, reqs: list[SampleRequest], arrivals, max_concurrency) -> list[Timing]:
    """Submit `reqs` at their arrivals (at most `max_concurrency` in flight), step the engine
    until every one finishes, timing each request's tokens as steps hand them back."""
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    slots = [0.0] * (max_concurrency or len(reqs))  # when each free slot freed (a heap)
    waiting, live, out = deque(range(len(reqs))), {}, [None] * len(reqs)
    while waiting or live:
        now = clock()
        while waiting and arrivals[waiting[0]] <= now and slots:
            i = waiting.popleft()
            r = reqs[i]
            out[i] = Timing(len(r.prompt), r.output_len, max(arrivals[i], heapq.heappop(slots)))
            params = SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            live[i] = engine.add_request(r.prompt, r.adapter, params)
        if engine.scheduler.has_work:
            engine.step()
            now = clock()
            for i, seq in list(live.items()):
                if (new := len(seq.output) - out[i].generated) > 0:
                    out[i].events.append((now, new))
                if seq.status is Status.FINISHED:
                    out[i].error = None if seq.error is None else repr(seq.error)
                    heapq.heappush(slots, now)
                    del live[i]
        elif live:
            raise RuntimeError(f"{len(live)} requests neither run nor finished")
        elif waiting:
            time.sleep(max(0.0, arrivals[waiting[0]] - clock()))
    return out


async def run_http(url: str, model: str, reqs: list[SampleRequest], arrivals, max_concurrency,
                   start: float) -> list[Timing]:
    """The same over HTTP: one streaming /v1/completions call a request; times from `start`
    (time.perf_counter(), the same clock in every process of the machine)."""
    from openai import AsyncOpenAI  # the serve extra
    # No retries: a retried call would be timed twice and hide a server error.
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=3600.0)
    gate = asyncio.Semaphore(max_concurrency or len(reqs))
    clock = lambda: time.perf_counter() - start  # noqa: E731

    async def one(r: SampleRequest, at: float) -> Timing:
        await asyncio.sleep(max(0.0, at - clock()))
        async with gate:
            t = Timing(len(r.prompt), r.output_len, clock())
            try:
                stream = await client.completions.create(
                    model=r.adapter or model, prompt=r.prompt, max_tokens=r.output_len,
                    temperature=0, stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
                async for chunk in stream:
                    ids = [i for c in chunk.choices for i in (c.model_extra or {}).get("token_ids") or ()]
                    if ids:
                        t.events.append((clock(), len(ids)))
            except Exception as e:  # noqa: BLE001
                t.error = repr(e)  # the request counts as not completed; the others run on
            return t

    async with client:
        return list(await asyncio.gather(*(one(r, a) for r, a in zip(reqs, arrivals))))


def _pid(_) -> int:
    return os.getpid()


def _client_share(*args) -> list[Timing]:
    """run_http over one client process's share of the requests."""
    return asyncio.run(run_http(*args))


def http_clients(url: str, args, reqs: list[SampleRequest], arrivals) -> list[Timing]:
    """run_http in --client-procs processes, request i in process i mod N, all timed from one
    start: one process's client (the openai client parses every chunk into a model) would not
    keep up with a server streaming thousands of tokens a second."""
    procs = min(args.client_procs, args.max_concurrency or len(reqs), len(reqs))
    limits = [None] * procs if args.max_concurrency is None else [
        args.max_concurrency // procs + (i < args.max_concurrency % procs) for i in range(procs)]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        ready = set()  # every worker has imported this script: only then does the clock start
        while len(ready) < procs:
            ready.update(pool.map(_pid, range(procs * 4), chunksize=1))
        start = time.perf_counter() + 0.5
        shares = pool.starmap(_client_share, [
            (url, args.model, reqs[i::procs], arrivals[i::procs], limits[i], start) for i in range(procs)],
            chunksize=1)
    out = [None] * len(reqs)
    for i, share in enumerate(shares):
        out[i::procs] = share
    return out


# ---- the run ------------------------------------------------------------------------------------

def build_engine(args, cfg: ModelConfig, max_model_len: int):
    names = adapter_names(args.adapters)
    extra = {} if args.max_prefill_tokens is None else {"max_prefill_tokens": args.max_prefill_tokens}
    t = time.perf_counter()
    engine = forkjax.Engine.from_pretrained(
        args.model, adapters=agent_adapters(cfg, names, LORA_RANK, shared_a=False),
        cache_policy=args.policy, residual_fanout=args.residual_fanout, dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_bytes, host_kv_bytes=args.host_kv_bytes,
        max_batch_size=args.max_batch_size, max_loras=len(names) + 1, lora_target_modules=ATTENTION,
        max_model_len=max_model_len, warmup=not args.no_warmup, progress=False, **extra)
    return engine, dict(build_s=time.perf_counter() - t, compile_s=engine.warmup_s)


def engine_config(engine, args) -> dict:
    """The engine's settings as it resolved them (defaults filled)."""
    sched = engine.scheduler
    return dict(max_batch_size=sched.max_batch_size, max_prefill_tokens=sched.max_prefill_tokens,
                max_model_len=engine.max_model_len, kv_pool_bytes=engine.runner.layout.nbytes,
                max_loras=engine.config.max_loras, overlap=engine.overlap,
                residual_fanout=engine.config.residual_fanout, host_kv_bytes=args.host_kv_bytes,
                lora_rank=LORA_RANK if args.adapters else None, lora_targets=list(ATTENTION))


def measured_run(engine, args, reqs, arrivals):
    """-> (timings, duration_s, the engine's stats and step log over the run)."""
    engine.reset_stats()
    engine.metrics.record_steps()
    timings = run_in_process(engine, reqs, arrivals, args.max_concurrency)
    stats, steps = engine.stats(), engine.metrics.record_steps(False)
    return timings, duration_of(timings), stats, steps


def duration_of(timings: list[Timing]) -> float:
    """t=0 to the last token."""
    duration = max((t.events[-1][0] for t in timings if t.events), default=0.0)
    if not duration:
        raise RuntimeError(f"no request generated a token: {timings[0].error}")
    return duration


def in_process(args, cfg, reqs, arrivals, max_model_len, device=None) -> dict:
    """The run on an engine in this process, and its roofline."""
    rates = measure_rates(log=log)
    log(f"copy {rates['copy_rate_GBps']:.1f} GB/s, matmul {rates['matmul_rate_TFLOPs']:.2f} TFLOP/s")
    engine, build = build_engine(args, cfg, max_model_len)
    log(f"engine built in {build['build_s']:.1f} s (compile {build['compile_s']:.1f} s); running")
    with engine:
        timings, wall, stats, steps = measured_run(engine, args, reqs, arrivals)
    costs = StepCosts.of(engine, LORA_RANK, ATTENTION, args.adapters)
    roof = roofline(steps, costs, rates)
    return dict(config=engine_config(engine, args), **build, server_start_s=None,
                front_end_cpu_s=None, engine_core_cpu_s=None, front_end_cpu_us_per_token=None,
                **latency_metrics(timings, wall), decode_batch_size_mean=stats["decode_batch_size_mean"],
                preemptions=stats["preemptions"], **roof, wall_s=wall, efficiency=roof["roofline_s"] / wall,
                efficiency_busy=roof["roofline_s"] / roof["device_s"], rates=rates,
                step_costs=dataclasses.asdict(costs), step_log=steps)


def server_flags(args, names: list[str], max_model_len: int, device: dict) -> list[str]:
    """The `python -m forkjax.serve` flags (less --model, --lora and the address) that build the
    engine `build_engine` builds, keyword for keyword; --warmup full compiles every shape before
    the server says it is ready."""
    flags = ["--cache-policy", args.policy, "--dtype", args.dtype, "--host-kv-bytes", str(args.host_kv_bytes),
             "--max-batch-size", str(args.max_batch_size or device["max_batch_size"]),
             "--max-model-len", str(max_model_len), "--max-loras", str(len(names) + 1),
             "--max-lora-rank", str(LORA_RANK), "--lora-target-modules", *ATTENTION,
             "--warmup", "none" if args.no_warmup else "full"]
    if args.residual_fanout is not None:
        flags.append("--residual-fanout" if args.residual_fanout else "--no-residual-fanout")
    for flag, value in (("--kv-cache-bytes", args.kv_cache_bytes), ("--max-prefill-tokens", args.max_prefill_tokens)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def pool_bytes(metrics: dict) -> int | None:
    """Both KV pools' bytes from a /metrics scrape: pages × the bytes of a page in use (None when
    a pool with pages holds none)."""
    total = 0.0
    for pool in ("base", "residual"):
        pages, used, nbytes = (metrics.get(f"{k}{{pool={pool}}}", 0.0)
                               for k in ("kv_pages_total", "kv_pages_used", "kv_bytes_used"))
        if pages and not used:
            return None
        total += pages * nbytes / used if used else 0.0
    return round(total)


def over_http(args, cfg, reqs, arrivals, max_model_len, device) -> dict:
    """The run against a `python -m forkjax.serve` process serving the adapters as PEFT
    directories; the engine's counters from its /metrics, no roofline (no step log over HTTP)."""
    from forkjax.workflows.http_driver import scrape, stats_between  # the serve extra: httpx, openai
    from forkjax.workflows.local_server import ServerProcess, lora_flags
    names = adapter_names(args.adapters)
    # A server given no --lora serves the model's own adapters, if it has any (the tiny models'
    # target other projections): without adapters, one that no request names waits on the host.
    adapters = agent_adapters(cfg, names or ["unused"], LORA_RANK, shared_a=False)
    log_path = os.path.join(args.out, "server.log")
    with tempfile.TemporaryDirectory(prefix="forkjax-adapters-") as root:
        flags = [*server_flags(args, names, max_model_len, device), *lora_flags(adapters, root)]
        with ServerProcess(args.model, flags, log_path=log_path) as server:
            log(f"server ready in {server.start_s:.1f} s ({log_path}); running")
            before, cpu = asyncio.run(scrape(server.url)), server.cpu_s()
            timings = http_clients(server.url, args, reqs, arrivals)
            after, cpu = asyncio.run(scrape(server.url)), {k: v - cpu[k] for k, v in server.cpu_s().items()}
    stats, wall = stats_between(before, after), duration_of(timings)
    tokens = sum(t.generated for t in timings)
    config = dict(max_batch_size=args.max_batch_size or device["max_batch_size"],
                  max_prefill_tokens=args.max_prefill_tokens, max_model_len=max_model_len,
                  kv_pool_bytes=pool_bytes(after), max_loras=len(names) + 1, overlap=True,
                  host_kv_bytes=args.host_kv_bytes, lora_rank=LORA_RANK if args.adapters else None,
                  lora_targets=list(ATTENTION))
    return dict(config=config, build_s=None, compile_s=None, server_start_s=server.start_s,
                front_end_cpu_s=cpu["front_end"], engine_core_cpu_s=cpu["engine_core"],
                front_end_cpu_us_per_token=cpu["front_end"] / max(tokens, 1) * 1e6,
                **latency_metrics(timings, wall), decode_batch_size_mean=stats["decode_batch_size_mean"],
                preemptions=stats["preemptions"], **dict.fromkeys(ROOFLINE_KEYS), wall_s=wall,
                efficiency=None, efficiency_busy=None, rates=None, step_costs=None, step_log=None)


def summary_line(r: dict) -> str:
    def p(key, q, scale=1.0):
        return "n/a" if r[key] is None else f"{r[key][q] * scale:.1f}"
    if r["http"]:  # the server's steps are not logged: no roofline
        tail = (f"server start {r['server_start_s']:.1f} s; front end "
                f"{r['front_end_cpu_us_per_token']:.0f} us CPU a token")
    else:
        tail = (f"roofline {r['roofline_s']:.3f} s / {r['wall_s']:.3f} s = {r['efficiency']:.3f} "
                f"(busy {r['efficiency_busy']:.3f}); compile {r['compile_s']:.1f} s")
    fanout = {None: "", True: " fan-out", False: " no fan-out"}[r["residual_fanout"]]
    return (f"{r['mode']} {'http ' if r['http'] else ''}{r['model']} {r['policy']}{fanout} "
            f"{r['completed']}/{r['num_prompts']} req ({r['dataset']}), {r['adapters']} adapters: "
            f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} out tok/s, "
            f"{r['total_token_throughput']:.1f} tok/s; TTFT p50 {p('ttft_ms', 'p50')} p99 "
            f"{p('ttft_ms', 'p99')} ms, ITL p50 {p('itl_ms', 'p50')} p99 {p('itl_ms', 'p99')} ms, "
            f"E2E p50 {p('e2el_ms', 'p50', 1e-3)} s; decode batch {r['decode_batch_size_mean']:.1f}; {tail}")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    device = check_args(args)
    cfg = describe_model(args.model)[0]
    reqs, arrivals, max_model_len = workload(args, cfg)
    mode = "offline" if math.isinf(args.request_rate) and args.max_concurrency is None else "online"
    log(f"{args.model} {args.policy}: {len(reqs)} requests ({args.dataset}), {mode}, rate "
        f"{args.request_rate}/s, concurrency {args.max_concurrency}, {args.adapters} adapters, "
        f"{'HTTP' if args.http else 'in process'}")
    os.makedirs(args.out, exist_ok=True)
    run = (over_http if args.http else in_process)(args, cfg, reqs, arrivals, max_model_len, device)
    result = dict(**run_info(__file__, argv, device), **vars(args), mode=mode, **run)
    result["request_rate"] = None if math.isinf(args.request_rate) else args.request_rate  # JSON has no inf
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    log(summary_line(result))
    return result


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"bench_serving.py: error: {e}")
