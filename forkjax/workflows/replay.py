"""A model-free engine for studying scheduling at full model scale on a CPU: the real `Scheduler`
(admission, sessions, in-flight sharing, preemption) over the real `DualRadixCache` at a model's
geometry, on a virtual clock, with a step-cost model in place of the model.

`ReplayEngine` has the part of `Engine`'s API the workflow drivers and bench_workflows use
(`add_request`, `step`, `scheduler`, `stats`, `reset_stats`, `flush_cache`, `agents`) and steps
as `EngineCore` does without overlap: schedule a batch, mark it launched, advance the clock by
the batch's modelled time, take in its outputs (random tokens, all finite) through the
scheduler's output processing (output_processor.py). The pools are sized as
`Engine.from_pretrained` sizes them (`PoolLayout.from_budget` from the model's config, one
residual copy per adapter slot under `forkkv`). Adapters beyond `max_loras - 1` device slots wait
on the host as the engine's do (lora/slots.py): the scheduler swaps them in, each swap costing its
step SWAP_S, the visible wall of one on the H200.

Step costs (`StepCost.h200`) come from BENCHMARKS.md, "Engine decode and prefill", H200,
llama3-8b-random, rank-16 `forkkv`, commit 8c83309 (first run of 20 steps):

* decode: the rows batch 1 / 16 / 64 (5.29 / 6.04 / 10.48 ms a step, every request at ~2k
  tokens). A step costs fixed + per_seq · B + (K/V bytes read) / kv_read_bytes_per_s, the K/V of
  every position of every request in the batch; the read rate is attention's, 545 MB of a
  layer's K/V in 161 µs at B=64 (the same section's per-layer breakdown, "What bounds it",
  measured at commit 0e48d65). fixed and per_seq are the least-squares fit of the three rows
  less their K/V reads (4.98 ms + 4.3 µs a request);
* extend: the prefill row, 8,191 tokens to the first token in 0.267 s as four 2,048-token steps.
  A step costs decode's fixed + per_token · tokens + the K/V it reads (each chunk's positions up
  to its end); per_token is what the row leaves after four fixed parts and its reads (30.1 µs).

K/V bytes a token are the replayed layout's (base and residual pages over the page size); the
fixed and per-token parts scale with the model's projection and LM-head parameters against
Llama-3-8B's (weight reads at decode, FLOPs at prefill). Adapter slots beyond the eight those
rows had cost each step SLOT_S a slot (scaled by a slot's parameters; BENCHMARKS.md, "Many
adapters": the fused LoRA path reads every slot's A and B and multiplies every token with them),
and each extend token its share of FLOPs, a slot's parameters over the model's.

Host tier copies (`host_kv_bytes`): a step first moves what the cache queued (host_pool.py:
stores inside the gather program, loads of whole blocks, both in the step's stream), so their
time adds to the step's: per direction fixed + bytes / rate, the line fitted (to relative error)
to the copies of 1-256 pages in BENCHMARKS.md, "Host tier" (H200, llama3.1-8b-random, 2 MiB
pages: HOST_COPY_ROWS).

Host time: each request adds HOST_S_PER_REQUEST to the clock, the time per request that
overlap does not hide on the H200. It is (wall − the sum of the steps' device seconds) /
requests over seven `bench_workflows.py --step-log` runs at eae05af (ReAct, llama3.1-8b-random,
the four policies at 16 workflows and `lrshared` at 4 / 16 / 32): 6.3-9.0 ms, median 7.2. The
HTTP stack is not modelled.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from forkjax.cache import DualRadixCache, PoolLayout, residual_copies_for
from forkjax.config import ModelConfig, default_fanout_width
from forkjax.engine.requests import check_session, slot_fanout
from forkjax.engine.scheduler import Scheduler
from forkjax.engine.sequence import Request, SamplingParams, Sequence
from forkjax.engine.sessions import SESSION_TTL_S
from forkjax.engine.stats import EngineStats
from forkjax.lora.activated import named_key
from forkjax.lora.peft import LoraAdapter
from forkjax.lora.slots import AdapterSlots
from forkjax.models.builtin import BUILTIN_CONFIGS
from forkjax.runtime.buckets import Buckets
from forkjax.runtime.model_runner import Fetched
from forkjax.workflows.agents import ATTENTION
from forkjax.workflows.base import MAX_RANDOM_ID

# BENCHMARKS.md, Engine decode and prefill (H200, llama3-8b-random, forkkv rank 16, 8c83309).
DECODE_ROWS = ((1, 5.29e-3), (16, 6.04e-3), (64, 10.48e-3))  # (batch, seconds a step)
DECODE_TOKENS = 2048  # each request's tokens in those rows
ATTENTION_BYTES_PER_S = 545e6 / 161e-6  # one layer's K/V at B=64 over its attention time
PREFILL = (8191, 0.267, 2048)  # prompt tokens, seconds to the first token, tokens a step
MEASURED_MODEL = "llama3-8b-random"
# BENCHMARKS.md, Host tier: (bytes, store seconds, load seconds) of copies of 1-256 2 MiB pages.
HOST_COPY_ROWS = ((1 << 21, 0.616e-3, 1.121e-3), (1 << 23, 0.597e-3, 0.923e-3),
                  (1 << 26, 1.954e-3, 2.077e-3), (1 << 29, 11.09e-3, 12.76e-3))
# BENCHMARKS.md, Many adapters: the wall a swap adds to its step (rank-16 q/k/v/o, Llama-3-8B;
# the median step with a swap less the median without).
SWAP_S = 2.84e-3
# The same section: decode B=64 at 2k in an engine of 65 rank-16 q/k/v/o adapter slots against
# one without slots (10.35 against 9.48 ms): a slot's A rows and B, read and multiplied in every
# step's GEMMs, add SLOT_S to a step. The rows above had MEASURED_SLOTS (bench_engine.py's default).
SLOT_S = (10.35e-3 - 9.48e-3) / 64
MEASURED_SLOTS = 8
HOST_S_PER_REQUEST = 7.2e-3  # host time a request costs beyond overlap (module docstring)
IDLE_S = 1e-3  # a step with nothing to run (requests wait for admission): the loop polls again
MAX_IDLE_S = 3600.0  # that long with work and nothing to run: the scheduler is stuck


def _weights(cfg: ModelConfig) -> int:
    """Parameters a decode step reads: every projection of every layer and the LM head."""
    return cfg.num_layers * sum(i * o for i, o in cfg.projection_shapes().values()) \
        + cfg.vocab_size * cfg.hidden_size


def _slot_params(cfg: ModelConfig, rank: int) -> int:
    """Parameters of one adapter slot on q/k/v/o (the workflows' agents' targets), A and B."""
    shapes = cfg.projection_shapes()
    return cfg.num_layers * rank * sum(sum(shapes[m]) for m in ATTENTION)


def _kv_bytes_per_token(layout: PoolLayout) -> float:
    res = layout.res_page_bytes if layout.policy.uses_residual else 0
    return (layout.base_page_bytes + res) / layout.page_size


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Seconds a step takes: see the module docstring."""
    decode_fixed_s: float
    decode_per_seq_s: float
    extend_per_token_s: float
    kv_read_bytes_per_s: float
    kv_bytes_per_token: float  # of the replayed layout
    host_copy: tuple  # ((fixed s, s a byte) of a store, the same of a load)

    @classmethod
    def h200(cls, cfg: ModelConfig, layout: PoolLayout, slots: int = MEASURED_SLOTS,
             rank: int = 16) -> "StepCost":
        ref = ModelConfig.from_hf(BUILTIN_CONFIGS[MEASURED_MODEL])
        ref_kv = _kv_bytes_per_token(PoolLayout.from_budget(
            num_layers=ref.num_layers, num_kv_heads=ref.num_kv_heads, head_dim=ref.head_dim,
            lora_rank=16, page_size=16, kv_cache_bytes=1 << 30, policy="forkkv"))
        read = lambda tokens: tokens * ref_kv / ATTENTION_BYTES_PER_S  # noqa: E731
        b = np.array([n for n, _ in DECODE_ROWS], float)
        y = np.array([t - read(n * DECODE_TOKENS) for n, t in DECODE_ROWS])
        per_seq, fixed = np.polyfit(b, y, 1)
        tokens, seconds, chunk = PREFILL
        ends = list(range(chunk, tokens, chunk)) + [tokens]
        per_token = (seconds - len(ends) * fixed - read(sum(ends))) / tokens
        scale = _weights(cfg) / _weights(ref)
        extra = max(0, slots - MEASURED_SLOTS)
        slots_s = SLOT_S * extra * _slot_params(cfg, rank) / _slot_params(ref, 16)
        slots_share = extra * _slot_params(cfg, rank) / _weights(cfg)
        rows = np.array(HOST_COPY_ROWS)
        # fixed + bytes · slope per direction, fitted to relative error (small copies matter)
        copy = tuple(tuple(np.polyfit(rows[:, 0], t, 1, w=1 / t)[::-1].tolist()) for t in rows.T[1:])
        return cls(float(fixed * scale + slots_s), float(per_seq * scale),
                   float(per_token * scale * (1 + slots_share)),
                   ATTENTION_BYTES_PER_S, _kv_bytes_per_token(layout), copy)

    def copy_s(self, copies) -> float:
        """Modelled seconds of host tier copies [(op, bytes)], "store" or "load"."""
        (store_fixed, store_byte), (load_fixed, load_byte) = self.host_copy
        return sum(store_fixed + n * store_byte if op == "store" else load_fixed + n * load_byte
                   for op, n in copies)

    def step_s(self, batch) -> float:
        """Modelled seconds of one step of `batch` (a ScheduledBatch)."""
        if batch.kind == "decode":
            read = sum(len(s) for s in batch.seqs)
            compute = self.decode_per_seq_s * len(batch.seqs)
        else:
            read = sum(end for _, end in batch.chunks)
            compute = self.extend_per_token_s * sum(end - start for start, end in batch.chunks)
        return self.decode_fixed_s + compute + read * self.kv_bytes_per_token / self.kv_read_bytes_per_s


class VirtualClock:
    """Seconds of modelled time: steps and sleeps advance it."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        # A positive sleep moves the clock by at least one ulp: a waiter that sleeps until a time
        # a rounding error short of it (t - t0 + d < wake) would otherwise sleep 0 forever.
        if seconds > 0:
            self.t = max(self.t + seconds, float(np.nextafter(self.t, np.inf)))


class ReplayEngine:
    """The scheduler and cache of an `Engine` over `agents` at `model`'s geometry, without
    weights (keywords as `Engine.from_pretrained`'s, `host_kv_bytes` 0 unless given; `rank`:
    the LoRA rank of the slots; `max_loras`: device slots, default one per agent and the base)."""

    def __init__(self, model: str | ModelConfig, agents, *, cache_policy: str = "forkkv",
                 residual_fanout: bool = False, kv_cache_bytes: int = int(16e9),
                 max_batch_size: int = 64, max_prefill_tokens: int = 2048,
                 max_model_len: int | None = None, page_size: int = 16, rank: int = 16,
                 dtype: str = "bfloat16", residual_fraction: float | None = None,
                 residual_copies: int | None = None,
                 schedule_policy: str = "lpm", max_wait_s: float = 60.0,
                 session_ttl_s: float = SESSION_TTL_S, host_kv_bytes: int = 0,
                 max_loras: int | None = None, cost: StepCost | None = None, seed: int = 0,
                 invocations: dict | None = None):
        cfg = (model if isinstance(model, ModelConfig)
               else ModelConfig.from_hf(BUILTIN_CONFIGS.get(model, model)))
        self.model_cfg, self.agents = cfg, tuple(agents)
        # The first agents in device slots of their own (slot 0: the base model), the rest on
        # the host; no weights to write
        self.slots = AdapterSlots(max_loras or len(self.agents) + 1)
        for name in self.agents:
            self.slots.add(LoraAdapter(name, rank, 1.0, {}))
        self.invocations = invocations or {}  # Activated LoRA agents: {name: invocation}
        self.slots.acquire(self.agents[:self.slots.num_slots - 1])
        self.policy, self.residual_fanout = cache_policy, residual_fanout
        layout = PoolLayout.from_budget(
            num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            lora_rank=rank, page_size=page_size, kv_cache_bytes=int(kv_cache_bytes),
            policy=cache_policy, dtype=dtype, residual_fraction=residual_fraction,
            residual_copies=residual_copies_for(cache_policy, len(self.agents), self.slots.num_slots,
                                                residual_copies))
        self.cache = DualRadixCache.from_layout(layout, host_kv_bytes)
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.clock = VirtualClock()
        self.sleep = self.clock.sleep
        buckets = Buckets(max_batch_size, max_prefill_tokens, -(-self.max_model_len // page_size))
        self.scheduler = Scheduler(self.cache, buckets, self.slots, max_batch_size=max_batch_size,
                                   max_prefill_tokens=max_prefill_tokens,
                                   max_model_len=self.max_model_len, schedule_policy=schedule_policy,
                                   max_wait_s=max_wait_s, session_ttl_s=session_ttl_s,
                                   clock=self.clock)
        self.cost = cost or StepCost.h200(cfg, layout, self.slots.num_slots, rank)
        self.metrics = EngineStats()
        self.rng = np.random.default_rng(seed)
        self.warmup_s, self.max_lora_rank = 0.0, rank
        self._idle_since: float | None = None

    def add_request(self, prompt, adapter: str, params: SamplingParams | None = None, *,
                    session_id: str | None = None, session_end: bool = False,
                    session_tokens: int | None = None, session_next_s: float | None = None,
                    fanout_adapters=None) -> Sequence:
        """Queue a request (as `Engine.add_request`; KeyError for an unknown adapter)."""
        check_session(session_id, session_end, session_tokens, session_next_s)
        self.slots.check(adapter)
        if fanout_adapters is None:  # as the engine: the other adapters in device slots now
            fanout_adapters = (slot_fanout(self.slots, adapter, default_fanout_width(self.slots.num_slots))
                               if self.residual_fanout else ())
        fanout = {a: a for a in fanout_adapters if a != adapter}  # the agents' keys: their names
        for a in fanout:
            self.slots.check(a)
        if fanout and self.policy != "forkkv":
            raise ValueError(f"residual fan-out needs cache_policy='forkkv', not {self.policy!r}")
        seq = Sequence(Request(tuple(prompt), adapter, named_key(adapter, prompt, self.invocations),
                               params or SamplingParams(),
                               session_id=session_id, session_end=session_end,
                               session_tokens=session_tokens, session_next_s=session_next_s,
                               fanout=tuple(fanout.items())))
        self.scheduler.add(seq)
        self.clock.t += HOST_S_PER_REQUEST
        return seq

    def step(self) -> list[Sequence]:
        """One synchronous step: the requests it ran (finished ones included)."""
        launched = self.launch()
        if launched is None:
            return []
        batch, dt = launched
        self.clock.t += dt
        return self.finish(batch)

    def launch(self):
        """Schedule a batch at the clock's time and launch it -> (batch, its modelled seconds),
        the clock left at its start; None when nothing can run (the clock moves IDLE_S, the
        loop's poll)."""
        batch = self.scheduler.schedule(allow_preempt=True)
        if batch is None:
            if self._idle_since is None:
                self._idle_since = self.clock.t
            elif self.clock.t - self._idle_since > MAX_IDLE_S:
                raise RuntimeError(f"{len(self.scheduler.waiting)} requests waited "
                                   f"{MAX_IDLE_S:.0f} s with nothing running")
            self.clock.t += IDLE_S
            return None
        self._idle_since = None
        self.metrics.launched(batch, self.clock.t)
        self.metrics.time("steps", 1)
        self.scheduler.on_launched(batch)
        writes = self.scheduler.take_slot_writes()
        self.slots.swapped(writes, SWAP_S * len(writes))
        dt = self.cost.step_s(batch) + SWAP_S * len(writes) + self.cost.copy_s(
            [c for host in self.cache.host_pools if host is not None for c in host.drop_queue()])
        self.metrics.time("device_s", dt)
        return batch, dt

    def finish(self, batch) -> list[Sequence]:
        """Take in the outputs of `launch`'s `batch` at the clock's time (its end): the requests
        it ran."""
        self.metrics.fetched(batch, self.clock.t)
        n = len(batch.seqs)
        out = Fetched(tokens=self.rng.integers(0, MAX_RANDOM_ID, n).astype(np.int32),
                      finite=np.ones(n, bool), fan_finite=np.ones((n, self.slots.num_slots), bool),
                      logits=None, hidden=None)
        self.scheduler.process_outputs(batch, out)
        return list(dict.fromkeys(batch.seqs))

    def stats(self) -> dict:
        """`Engine.stats()`'s keys (agents named by adapter; no load stalls on a virtual clock)."""
        return {**self.metrics.snapshot(self.cache, self.scheduler, self.slots), "host_load_stall_s": 0.0}

    def reset_stats(self) -> dict:
        s = self.stats()
        self.metrics.reset(self.cache, self.scheduler, self.slots)
        return s

    def flush_cache(self) -> int:
        self.scheduler.sessions.release_all()
        return self.cache.flush()

    def describe(self) -> dict:
        """What a result records about the replay: the step-cost constants and the pools."""
        return {"replay": True, "step_cost": dataclasses.asdict(self.cost),
                "base_pages": self.cache.base_tree.allocator.num_usable,
                "residual_pages": self.cache.res_tree.allocator.num_usable if self.cache.res_tree else 0}

