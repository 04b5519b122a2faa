"""Engine benchmark on the GPU: decode step time against the roofline, host share, prefill rate.

    PYTHONPATH=. python3 scripts/bench_engine.py --kv-cache-bytes 24e9 --out $OUT/bench_engine.json

`llama3-8b-random` (exact Llama-3-8B shapes, seeded random bf16 weights) with one rank-16 adapter
on q/k/v/o, `forkkv`. Decode: B requests with distinct 2k-token prompts, timed over steady
decode steps. Roofline per step = (weight bytes + KV bytes read) / copy bandwidth measured here.
Host share = (scheduling + input building + postprocessing) / step wall; dispatch share (the jit
call: argument transfers and kernel launches) is reported beside it, and the largest batch's
`trace_4_steps` says where four more steps' host and device time goes (JAX's profiler).
Prefill: one 8k-token prompt (4 chunks of 2048; 16 of 512 with --deterministic) to its first
token.

`--active 0,1,8,32,64`: the same decode (B = the largest of --batches) and prefill (--prefill-tokens
cut into one prompt per adapter) with requests spread over K distinct adapters in device slots
(K = 0: every request on the base model, the baseline), in one engine of max(K) + 1 slots (or
--max-loras). `--swap`: the visible cost of writing an adapter into a slot: decode steps of B - 2
long requests, each step joined by a 16-token request whose adapter is on the host (a swap every step)
against the same with the new requests' adapter resident; then those steps alone, where nothing
hides a swap's cost; `trace_4_swap_steps`: the longest host spans and kernels of four swap steps
under JAX's profiler.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import numpy as np

import forkjax
import timing  # scripts/ is on sys.path when this script runs
from forkjax.config import ModelConfig
from forkjax.engine.memory import step_workspace_bytes
from forkjax.engine.sequence import SamplingParams
from forkjax.models.builtin import BUILTIN_CONFIGS, random_adapter
from forkjax.pallas_kernels.paged_attention import triton as triton_attention
from forkjax.sizes import size_flag
from provenance import run_info  # scripts/ is on sys.path when this script runs


def device_bytes(x) -> int:
    """Bytes of array `x` on one device (its shard under tensor parallelism)."""
    return x.addressable_shards[0].data.nbytes


def param_bytes(engine) -> int:
    """Parameter bytes a decode step reads on one device: all of them but the input embedding
    table, of which a step reads one row a token (tied, the table is also the LM head and is
    counted). Counting the whole table would add bytes no step reads (1.05 GB for Llama-3-8B)."""
    from flax import nnx
    model = engine.model
    total = sum(device_bytes(x) for x in jax.tree.leaves(nnx.state(model)))
    if model.lm_head is not None:
        total -= device_bytes(model.embed_tokens[...])
    return total


def decode_bench(engine, batch: int, context: int, steps: int, cfg: ModelConfig, bw: float,
                 adapters=("agent",), trace: bool = False):
    """Decode steps of `batch` requests, request i on adapters[i % len(adapters)]; `trace`: then
    four more under JAX's profiler, where their host and device time goes."""
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, cfg.vocab_size, context).tolist() for _ in range(batch)]
    names = [adapters[i % len(adapters)] for i in range(batch)]
    # Prefill once and keep the prompts cached; resubmitted, they all hit the cache and start
    # decoding together (otherwise the scheduler interleaves early decodes with later prefills
    # and every decode bucket below `batch` would be compiled and timed on the way).
    engine.generate(prompts, adapters=names, max_new_tokens=1)
    params = SamplingParams(max_new_tokens=steps + 12, ignore_eos=True)
    seqs = [engine.add_request(p, name, params) for p, name in zip(prompts, names)]
    while any(s.in_prefill or s.cache is None for s in seqs):
        engine.step()
    for _ in range(3):  # warm-up decode steps (compile)
        engine.step()
    t0 = dict(engine.step_times)
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    spent = {k: engine.step_times[k] - t0[k] for k in t0}
    host = spent["schedule_s"] + spent["inputs_s"] + spent["postprocess_s"]
    traced = {"trace_4_steps": timing.trace_summary(lambda: [engine.step() for _ in range(4)], top=25)
              } if trace else {}
    for s in seqs:
        engine.abort(s)
    # bf16 K and V, a device's heads
    kv_bytes = batch * (context + steps) * cfg.num_layers * 2 * cfg.kv_size * 2 // engine.model.tp
    res_bytes = batch * (context + steps) * cfg.num_layers * 2 * 16 * 2
    roof = (param_bytes(engine) + kv_bytes + res_bytes) / bw
    step = float(np.median(walls))
    return dict(batch=batch, context=context, step_ms=step * 1e3, roofline_ms=roof * 1e3,
                ratio=step / roof, host_share=host / sum(walls),
                dispatch_share=spent["dispatch_s"] / sum(walls),
                per_step_ms={k[:-2]: v / steps * 1e3 for k, v in spent.items() if k != "steps"},
                tokens_per_s=batch / step, **traced)


_SEEDS = itertools.count()


def prefill_bench(engine, cfg: ModelConfig, n: int = 8192, adapters=("agent",)):
    """n prompt tokens to their first tokens: one prompt per adapter, n / len(adapters) each."""
    n = min(n, engine.max_model_len - 1)  # room for the one generated token
    each = n // len(adapters)
    rng = np.random.default_rng(next(_SEEDS))  # prompts no earlier call cached
    for timed in (False, True):  # the first pass compiles the shapes (other tokens: no hits)
        prompts = [rng.integers(0, cfg.vocab_size, each).tolist() for _ in adapters]
        t = time.perf_counter()
        engine.generate(prompts, adapters=list(adapters), max_new_tokens=1)
    dt = time.perf_counter() - t
    return dict(prompt_tokens=each * len(adapters), seconds=dt, tokens_per_s=each * len(adapters) / dt)


def swap_bench(engine, batch: int, context: int, steps: int, cfg: ModelConfig, host_adapters, resident):
    """Decode steps that each admit a 16-token request on a host-only adapter (host_adapters
    rotate through two free slots: a swap a step) against the same steps with the new requests
    on `resident` (no swap): median step walls, the wall a swap adds, the swaps' counters; then
    the same steps with nothing else running (`alone`): a swap's whole cost, host dispatch, the
    image's copy and the slot write, with no step in flight to hide it."""
    rng = np.random.default_rng(1)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def timed(names):  # -> the steps' wall times, swaps and swap host s, the first 4 (compiles) left out
        walls, before = [], engine.stats()
        for i, name in enumerate(names):
            if i == 4:  # the swaps counted are those of the steps timed
                before = engine.stats()
            engine.add_request(rng.integers(0, cfg.vocab_size, 16).tolist(), name, one)
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
        after = engine.stats()
        return (np.array(walls[4:]), after["lora_swaps"] - before["lora_swaps"],
                after["lora_swap_wait_s"] - before["lora_swap_wait_s"])

    def compare(n):  # -> swap walls, resident walls, the wall a swap adds (ms), swaps, host s
        swap, swaps, host_s = timed([host_adapters[i % len(host_adapters)] for i in range(n + 4)])
        resident_walls, _, _ = timed([resident] * (n + 4))
        added_ms = float(swap.sum() - resident_walls.sum()) / max(swaps, 1) * 1e3
        return swap, resident_walls, added_ms, swaps, host_s

    # B - 2 long requests: with the request admitted this step and the one that finished last
    # step (its result is taken in after this step launches), every step holds B rows, and no
    # new request waits for a batch row instead of its slot.
    prompts = [rng.integers(0, cfg.vocab_size, context).tolist() for _ in range(batch - 2)]
    engine.generate(prompts, adapters="agent", max_new_tokens=1)
    params = SamplingParams(max_new_tokens=3 * steps + 24, ignore_eos=True)
    seqs = [engine.add_request(p, "agent", params) for p in prompts]
    while any(s.in_prefill or s.cache is None for s in seqs):
        engine.step()
    timed([resident] * 4)
    swap, resident_walls, visible_ms, swaps, host_s = compare(steps)
    # where a swap step's time goes: host spans (the write's dispatch among them) and kernels
    trace = timing.trace_summary(lambda: timed(host_adapters[:4]), top=25)
    for s in seqs:
        engine.abort(s)
    _, _, alone_ms, alone_swaps, _ = compare(steps)
    return dict(batch=batch, step_ms_swap=float(np.median(swap)) * 1e3,
                step_ms_resident=float(np.median(resident_walls)) * 1e3, visible_ms=visible_ms, swaps=swaps,
                image_MB=engine.writer.image_bytes(host_adapters[0]) / 1e6,
                host_ms_per_swap=host_s / max(swaps, 1) * 1e3, alone_ms=alone_ms, alone_swaps=alone_swaps,
                trace_4_swap_steps=trace)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_engine.json")
    ap.add_argument("--model", default="llama3-8b-random")
    ap.add_argument("--policy", default="forkkv")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--no-overlap", action="store_true", help="synchronous steps (no overlap scheduling)")
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic mode: one decode and one extend program (buckets.py)")
    ap.add_argument("--target-programs", type=int,
                    help="programs the decode kernels' split-K heuristic aims for (default 1024)")
    ap.add_argument("--kv-cache-bytes", type=size_flag, default=int(24e9),
                    help="KV pool budget (a smaller pool than the engine's default compiles faster)")
    ap.add_argument("--active", help="comma list of distinct adapters active at once, e.g. 0,1,8,32,64: "
                    "decode and prefill per count (0: the base model) instead of the default sections")
    ap.add_argument("--max-loras", type=int, help="device adapter slots (default: max(--active) + 1, 8)")
    ap.add_argument("--lora-path", choices=("fused", "sgmv"), default="fused")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="devices the model is split over (kv-cache-bytes is per device)")
    ap.add_argument("--swap", action="store_true", help="the adapter swap section instead (4 slots, "
                    "8 adapters on the host)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS[args.model])
    active = [int(k) for k in args.active.split(",")] if args.active else []
    qkvo = ("q_proj", "k_proj", "v_proj", "o_proj")
    adapters = {f"a{i}": random_adapter(f"a{i}", cfg, 16, 32, qkvo, seed=2 + i)
                for i in range(max(active, default=0) + (9 if args.swap else 0))}
    adapters["agent"] = random_adapter("agent", cfg, 16, 32, qkvo, seed=1)
    max_loras = args.max_loras or (4 if args.swap else max(8, max(active, default=0) + 1))
    if args.target_programs:  # read when the steps are traced, i.e. after this
        triton_attention.TARGET_PROGRAMS = args.target_programs
    # Bytes read + written per second, timed with CUPTI as the kernels are (a wall-clock pass
    # reads lower, which would flatter the roofline ratio); first: its 4 GiB buffers fit beside
    # nothing else.
    bw = timing.copy_bandwidth()[0]
    t = time.perf_counter()
    engine = forkjax.Engine.from_pretrained(args.model, adapters=adapters, max_loras=max_loras,
                                            lora_path=args.lora_path,
                                            tensor_parallel_size=args.tensor_parallel_size,
                                            cache_policy=args.policy,
                                            max_batch_size=max(64, *batches),
                                            kv_cache_bytes=args.kv_cache_bytes, warmup=False,
                                            overlap=not args.no_overlap,
                                            deterministic=args.deterministic)
    load_s = time.perf_counter() - t
    result = dict(**run_info(__file__), model=args.model,
                  policy=args.policy, lora_path=args.lora_path,
                  tensor_parallel_size=args.tensor_parallel_size, overlap=engine.overlap, deterministic=args.deterministic,
                  target_programs=triton_attention.TARGET_PROGRAMS,
                  load_s=load_s, copy_bandwidth_GBps=bw / 1e9,
                  param_GB=param_bytes(engine) / 1e9, kv_pool_GB=engine.runner.layout.nbytes / 1e9,
                  decode=[])

    def save(what):  # after every section: a run cut short still leaves its numbers
        print(what, json.dumps(result[what] if what in result else result, indent=1), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    save("load_s")
    if args.swap:
        result["swap"] = swap_bench(engine, max(batches), args.context, args.steps, cfg,
                                    [f"a{i}" for i in range(1, 9)], "a0")
        return save("swap")
    if active:
        result["active"] = []
        for k in active:
            names = [f"a{i}" for i in range(k)] or [None]
            row = dict(active=k, max_loras=max_loras,
                       decode=decode_bench(engine, max(batches), args.context, args.steps, cfg, bw, names),
                       prefill=prefill_bench(engine, cfg, args.prefill_tokens, names))
            # over the same steps with every request on the base model (the same prompts' split)
            row["prefill_base"] = prefill_bench(engine, cfg, args.prefill_tokens, [None] * len(names))
            row["prefill_ratio"] = row["prefill"]["seconds"] / row["prefill_base"]["seconds"]
            base = result["active"][0] if result["active"] and result["active"][0]["active"] == 0 else None
            if base:
                row["decode_ratio"] = row["decode"]["step_ms"] / base["decode"]["step_ms"]
            result["active"].append(row)
            save("active")
        return
    for b in batches:
        t = time.perf_counter()
        result["decode"].append(decode_bench(engine, b, args.context, args.steps, cfg, bw,
                                             trace=b == max(batches)))
        result["decode"][-1]["section_s"] = time.perf_counter() - t
        save("decode")
    result["prefill"] = prefill_bench(engine, cfg, args.prefill_tokens)
    save("prefill")
    # The largest temporaries XLA allocated for a program this run used, beside the bound the
    # engine sets aside for them when it sizes a default KV pool (engine/memory.py).
    temps = [exe.memory_analysis().temp_size_in_bytes for exe in engine.runner._exes.values()]
    result["workspace"] = dict(compiled_max_bytes=max(temps), estimate_bytes=step_workspace_bytes(
        cfg, engine.scheduler.max_batch_size, engine.scheduler.max_prefill_tokens))
    save("workspace")


if __name__ == "__main__":
    main()
