"""`EngineCore`: the step loop over the scheduler and the model runner (vLLM's EngineCore).

    step():  batch = scheduler.schedule(); launch(batch); postprocess(the previous launch)

Overlap scheduling (default, SGLang's overlap scheduler): step n+1 is scheduled and dispatched
while step n still runs on the device; a token step n samples reaches step n+1 on the device (the
host marks it PENDING), and the host learns it one step later. A request that stops is therefore
computed one step too far and that token is dropped. Preemption and `score` steps wait for the
step in flight first.

What a step's outputs do to its requests is output_processor.py's, the counters are stats.py's.
A server drives `add_request` / `step` / `abort` from its own loop; `Engine` (engine.py) adds
loading, adapters, `generate` and `score` on top.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax

from forkjax.cache import DualRadixCache, PoolLayout
from forkjax.config import EngineConfig, ModelConfig
from forkjax.engine import memory
from forkjax.engine.guided import Guide, ll_tokenizer
from forkjax.engine.requests import (InvalidArgument, adapter_key, check_salt, check_session,
                                     fanout_targets, prompt_ids)
from forkjax.engine.scheduler import PreemptionNeeded, Scheduler
from forkjax.engine.sequence import Request, SamplingParams, Sequence, Status
from forkjax.engine.sessions import SESSION_TTL_S
from forkjax.engine.stats import EngineStats
from forkjax.lora.slot_writer import SlotWriter
from forkjax.lora.slots import AdapterSlots, slot_rank
from forkjax.runtime.buckets import MIN_PAGE_WIDTH, REFERENCE_MIN_WIDTH, Buckets
from forkjax.runtime.host_blocks import pin_host_tier
from forkjax.runtime.model_runner import Launched, ModelRunner
from forkjax.runtime.sampler import bitmask_width


class EngineCore:
    """The KV cache, scheduler and model runner of one loaded model, and the step loop over them
    (`Engine.from_pretrained` loads the model)."""

    def __init__(self, model_cfg: ModelConfig, model, cfg: EngineConfig, tokenizer=None, *,
                 max_model_len: int | None = None, max_prefill_tokens: int = 2048,
                 use_pallas: bool | None = None, warmup: bool | str = True, progress: bool = True,
                 overlap: bool = True, residual_copies: int = 1, max_wait_s: float = 60.0,
                 session_ttl_s: float = SESSION_TTL_S, compile_workers: int | None = None,
                 alora: bool = False):
        self.model_cfg, self.config, self.tokenizer = model_cfg, cfg, tokenizer
        self.max_model_len = min(max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)
        on_gpu = jax.default_backend() == "gpu"
        self.slots = AdapterSlots(cfg.max_loras, cfg.max_cpu_loras)
        self.writer = SlotWriter(model)  # the adapters' slot images, in pinned host memory
        rank = self.max_lora_rank = slot_rank(model)
        limit, in_use = memory.device_memory()
        max_batch = cfg.max_batch_size or memory.default_max_batch_size(on_gpu, limit)
        workspace = memory.step_workspace_bytes(model_cfg, max_batch, max_prefill_tokens)
        # kv_cache_bytes is per device, and device_memory() is the first device's: under tensor
        # parallelism each holds its share of the weights and of the base pool (PoolLayout)
        if cfg.kv_cache_bytes:
            memory.check_kv_fits(cfg.kv_cache_bytes, limit, in_use, workspace)
        kv_bytes = cfg.kv_cache_bytes or memory.default_kv_cache_bytes(on_gpu, limit - in_use, workspace)
        layout = PoolLayout.from_budget(
            num_layers=model_cfg.num_layers, num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim, lora_rank=rank, page_size=cfg.page_size,
            kv_cache_bytes=kv_bytes, policy=cfg.cache_policy, dtype=cfg.dtype,
            residual_fraction=cfg.residual_fraction, residual_copies=residual_copies,
            tensor_parallel=cfg.tensor_parallel_size)
        # No host tier under tensor parallelism (EngineConfig refuses one asked for)
        host_bytes = (memory.host_kv_bytes(cfg.host_kv_bytes, on_gpu, kv_bytes)
                      if cfg.tensor_parallel_size == 1 else 0)
        self.cache = DualRadixCache.from_layout(layout, host_bytes)
        # The host tier's pinned memory is taken while the warm-up compiles (host_blocks.pin_host_tier).
        self._pinning = None
        if on_gpu and host_bytes:
            self._pinning = threading.Thread(target=pin_host_tier, name="forkjax-pin-host", daemon=True,
                                             args=(self.cache.host_budget, memory.pinned_host_limit()))
            self._pinning.start()
        use_pallas = on_gpu if use_pallas is None else use_pallas
        buckets = Buckets(max_batch, max_prefill_tokens, -(-self.max_model_len // cfg.page_size),
                          fixed=cfg.deterministic,
                          min_width=MIN_PAGE_WIDTH if use_pallas else REFERENCE_MIN_WIDTH)
        self.scheduler = Scheduler(self.cache, buckets, self.slots, max_batch_size=max_batch,
                                   max_prefill_tokens=max_prefill_tokens, max_model_len=self.max_model_len,
                                   schedule_policy=cfg.schedule_policy, max_wait_s=max_wait_s,
                                   session_ttl_s=_check_ttl(session_ttl_s))
        # Only `forkkv` requests fan out: other policies' warm-ups compile no fan-out programs.
        fanout_width = cfg.fanout_width if cfg.cache_policy == "forkkv" else 0
        self.runner = ModelRunner(model, layout, buckets, num_slots=cfg.max_loras,
                                  use_pallas=use_pallas,
                                  fanout=cfg.residual_fanout or _fixed_fanout(cfg), fanout_width=fanout_width,
                                  host_tier=tuple(h.max_block if h else 0 for h in self.cache.host_pools),
                                  alora=alora)
        self.metrics = EngineStats()
        self._stall_at_reset = 0.0  # host_load_stall_s at the last reset_stats()
        self.overlap = overlap
        self._inflight: Launched | None = None
        self.warmup_s = 0.0  # seconds spent compiling every shape at start
        self.closed = False
        if warmup not in (True, False, "background"):
            raise ValueError(f"warmup={warmup!r}: expected True, False or 'background'")
        if warmup:
            t = time.perf_counter()
            self.runner.warmup(progress, compile_workers, background=warmup == "background")
            self.warmup_s = time.perf_counter() - t

    @property
    def model(self):
        """The nnx model over the parameters the model runner holds (a view)."""
        return self.runner.model

    # ---- lifetime ---------------------------------------------------------------------------

    def close(self):
        """Stop this engine's background warm-up (once the compiles it started finish: they
        stay shared with other engines of the model) and wait for the host tier's pinning; the
        engine then refuses work. A second close does nothing."""
        if self.closed:
            return
        self.closed = True
        self.runner.stop_warmup()
        if self._pinning:
            self._pinning.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self.closed:
            raise RuntimeError("engine is closed")

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt, adapter: str | None = None, params: SamplingParams | None = None,
                    score: bool = False, *, session_id: str | None = None,
                    session_end: bool = False, session_tokens: int | None = None,
                    session_next_s: float | None = None, fanout_adapters=None,
                    cache_salt: str | None = None, score_from: int = 0,
                    return_hidden: bool = False) -> Sequence:
        """Validate and queue one request (ValueError / KeyError and nothing queued if bad; an
        InvalidArgument, a ValueError, names the argument at fault).

        `session_id`: requests of one workflow: the engine admits whole workflows as their
        projected peak working sets fit, and keeps a workflow's pages between its turns
        (sessions.py), until a request with `session_end=True` (its last) finishes or the
        session has been idle for `session_ttl_s`. `session_tokens`: the tokens the workflow
        expects to hold at its end (its final length), a hint for that projection.
        `session_next_s`: seconds from this request's end to the workflow's next request (a
        tool call's expected time): with a host tier, the session's paths that went to the
        host are loaded back shortly before (sessions.py). `fanout_adapters`
        (`forkkv`): the agents whose residuals this request writes too; None follows the
        engine's `residual_fanout` (the adapters in device slots, or none), [] none. `cache_salt`: the
        request shares cached pages (base and residual) only with requests of the same salt
        (one salt per trust domain: under `forkkv` agents of one salt read each other's base)."""
        self._check_open()
        ids = prompt_ids(prompt, self.tokenizer, self.model_cfg.vocab_size, self.max_model_len)
        salt = check_salt(cache_salt)
        key = adapter_key(self.slots, adapter, ids, salt)  # KeyError for an unknown adapter
        check_session(session_id, session_end, session_tokens, session_next_s)
        fanout = fanout_targets(self.slots, self.config, adapter, key, fanout_adapters, salt)
        params = params or SamplingParams()
        bad = [t for t, _ in params.logit_bias if t >= self.model_cfg.vocab_size]
        if bad:
            raise InvalidArgument("logit_bias", f"logit_bias: token id {bad[0]} is not in the "
                                                f"vocabulary ({self.model_cfg.vocab_size} tokens)")
        if not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=tuple(
                set(params.stop_token_ids) | set(self.model_cfg.eos_token_ids)))
        guide = None
        if params.guided is not None:
            if self.tokenizer is None:
                raise InvalidArgument("guided", "constrained decoding needs the model's tokenizer; "
                                                "this model has none")
            try:
                guide = Guide(params.guided, ll_tokenizer(self.tokenizer, self.model_cfg.vocab_size))
            except ValueError as e:
                raise InvalidArgument("guided", f"the grammar does not compile: {e}") from None
        seq = Sequence(Request(
            tuple(ids), adapter, key, params, score=score, score_from=score_from,
            return_hidden=return_hidden, prefill_whole_prompt=self.config.deterministic,
            session_id=session_id, session_end=session_end, session_tokens=session_tokens,
            session_next_s=session_next_s, fanout=tuple(fanout.items())), guide)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence):
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, "abort")

    def step(self) -> list[Sequence]:
        """One engine step; returns the requests whose step's results it took in (finished
        ones included): with overlap, those of the step launched one call earlier."""
        self._check_open()
        t0 = time.perf_counter()
        try:
            batch = self.scheduler.schedule(allow_preempt=self._inflight is None)
        except PreemptionNeeded:  # the victims' tokens in flight must be known first
            done = self._finish_inflight()
            t0 = time.perf_counter()
            return done + self._launch_and_finish(t0, self.scheduler.schedule())
        return self._launch_and_finish(t0, batch)

    def _launch_and_finish(self, t0, batch) -> list[Sequence]:
        writes = self.scheduler.take_slot_writes()
        if writes:
            t = time.perf_counter()
            self._write_slots(writes)
            self.slots.swapped(writes, time.perf_counter() - t)
        t1 = time.perf_counter()
        self.metrics.time("schedule_s", t1 - t0)
        if batch is None:
            return self._finish_inflight()
        all_logits = any(s.score for s in batch.seqs)
        sync = all_logits or not self.overlap
        done = self._finish_inflight() if sync else []
        fwd = self.runner.forward(batch, all_logits, any(s.return_hidden for s in batch.seqs))
        if any(s.guide is not None for s in batch.seqs):
            # A guided request's mask needs its previous token, which the step in flight may
            # still hold: that step's results are taken in while this forward pass runs, and the
            # masks join at sampling.
            done += self._finish_inflight()
            t = time.perf_counter()
            batch.token_masks = self.scheduler.token_masks(batch, bitmask_width(self.model_cfg.vocab_size))
            self.metrics.guided(time.perf_counter() - t)
        launched = self.runner.sample(fwd)
        self.metrics.time("inputs_s", self.runner.last_inputs_s)
        self.metrics.time("dispatch_s", self.runner.last_dispatch_s)
        self.metrics.time("steps", 1)
        self.metrics.launched(batch, t1)
        self.scheduler.on_launched(batch)
        done += self._finish_inflight()  # the previous step, while this one runs
        self._inflight = launched
        return done + (self._finish_inflight() if sync else [])

    def _write_slots(self, writes):
        """Write adapters into device slots: [(slot, LoraAdapter)] (`AdapterSlots.acquire`). A
        step in flight keeps the weights it was launched with (JAX orders the donated update
        after it), and no request in it uses these slots (acquire keeps running ones')."""
        for slot, adapter in writes:
            self.runner.write_adapter(self.writer, slot, adapter)

    def _finish_inflight(self) -> list[Sequence]:
        if self._inflight is None:
            return []
        launched, self._inflight = self._inflight, None
        t0 = time.perf_counter()
        out = self.runner.fetch(launched)
        t1 = time.perf_counter()
        self.scheduler.process_outputs(launched.batch, out)
        self.metrics.fetched(launched.batch, t1)
        self.metrics.time("device_s", t1 - t0)
        self.metrics.time("postprocess_s", time.perf_counter() - t1)
        return list(dict.fromkeys(launched.batch.seqs))  # a request in pieces: once

    def _run_until_done(self, seqs: list[Sequence]):
        while any(s.status is not Status.FINISHED for s in seqs):
            if not self.step() and not self.scheduler.has_work:
                break
        for s in seqs:
            if s.error is not None:
                raise s.error

    @property
    def step_times(self) -> dict:
        """Cumulative seconds per part of `step()` since start-up (stats.STEP_PARTS)."""
        return self.metrics.step_times

    def stats(self) -> dict:
        """The keys of docs/design.md, Public contracts, and more; counters run from start-up or
        the last reset_stats()."""
        return {**self.metrics.snapshot(self.cache, self.scheduler, self.slots),
                "host_load_stall_s": self.runner.host_load_stall_s - self._stall_at_reset}

    def reset_stats(self) -> dict:
        """Set the counters of `stats()` back to zero (the pools are untouched); returns the
        stats of the interval that ends, so a caller reads hit rates and decode batch sizes
        per interval."""
        s = self.stats()
        self.metrics.reset(self.cache, self.scheduler, self.slots)
        self._stall_at_reset = self.runner.host_load_stall_s
        return s

    def flush_cache(self) -> int:
        """Evict every unlocked page of both trees (running requests keep theirs); returns
        the pages freed."""
        self.scheduler.sessions.release_all()
        return self.cache.flush()


def _fixed_fanout(cfg: EngineConfig) -> bool:
    """Deterministic `forkkv` runs only the programs with fan-out inputs: which program a step
    ran would otherwise depend on whether another request in it fans out."""
    return cfg.deterministic and cfg.cache_policy == "forkkv"


def _check_ttl(ttl_s) -> float:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 <= ttl_s < float("inf"):
        raise ValueError(f"session_ttl_s={ttl_s!r}: expected finite seconds >= 0")
    return float(ttl_s)

