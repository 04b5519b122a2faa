"""The public `Engine` (docs/design.md, Public contracts): paged dual KV cache, continuous
batching, multi-LoRA.

    step():  batch = scheduler.schedule(); launch(batch); postprocess(the previous launch)

Overlap scheduling (default, SGLang's overlap scheduler): step n+1 is scheduled and dispatched
while step n still runs on the device; a token step n samples reaches step n+1 on the device (the
host marks it PENDING), and the host learns it one step later. A request that stops is therefore
computed one step too far and that token is dropped. Preemption and `score` steps wait for the
step in flight first.

`generate` and `score` submit requests and step until theirs finish; a server drives the same
`add_request` / `step` / `abort` API from its own loop.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from forkjax.cache import DualRadixCache, PoolLayout, check_shared_lora_a
from forkjax.cache.policy import salted
from forkjax.config import EngineConfig, ModelConfig
from forkjax.engine.buckets import Buckets
from forkjax.engine.loading import load_model_and_adapters, read_adapters
from forkjax.engine.model_runner import Fetched, Launched, ModelRunner
from forkjax.engine.scheduler import PreemptionNeeded, Scheduler
from forkjax.engine.requests import check_salt, fanout_targets, prompt_ids
from forkjax.engine.sequence import NonFiniteError, SamplingParams, Sequence, Status
from forkjax.lora.peft import LoraAdapter
from forkjax.lora.slots import AdapterSlots, check_fits, slot_rank, write_slot

DEFAULT_CPU_KV_BYTES = 256 << 20
# `warmup` by the name `python -m forkjax.serve --warmup` gives it
WARMUP_MODES = {"background": "background", "full": True, "none": False}


class Engine:
    def __init__(self, model_cfg: ModelConfig, model, cfg: EngineConfig, tokenizer=None, *,
                 max_model_len: int | None = None, max_prefill_tokens: int = 2048,
                 use_pallas: bool | None = None, warmup: bool | str = True, progress: bool = True,
                 overlap: bool = True, residual_copies: int = 1, max_wait_s: float = 60.0,
                 compile_workers: int | None = None):
        self.model_cfg, self.model, self.config, self.tokenizer = model_cfg, model, cfg, tokenizer
        self.max_model_len = min(max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)
        on_gpu = jax.default_backend() == "gpu"
        self.slots = AdapterSlots(cfg.max_loras)
        rank = self.max_lora_rank = slot_rank(model)
        layout = PoolLayout.from_budget(
            num_layers=model_cfg.num_layers, num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim, lora_rank=rank, page_size=cfg.page_size,
            kv_cache_bytes=cfg.kv_cache_bytes or _default_kv_bytes(on_gpu),
            policy=cfg.cache_policy, dtype=cfg.dtype, residual_fraction=cfg.residual_fraction,
            residual_copies=residual_copies)
        self.cache = DualRadixCache.from_layout(layout)
        max_batch = cfg.max_batch_size or (64 if on_gpu else 16)
        buckets = Buckets(max_batch, max_prefill_tokens, -(-self.max_model_len // cfg.page_size),
                          fixed=cfg.deterministic)
        self.scheduler = Scheduler(self.cache, buckets, max_batch_size=max_batch,
                                   max_prefill_tokens=max_prefill_tokens, max_model_len=self.max_model_len,
                                   schedule_policy=cfg.schedule_policy, max_wait_s=max_wait_s)
        self.runner = ModelRunner(model, layout, buckets, num_slots=cfg.max_loras,
                                  use_pallas=on_gpu if use_pallas is None else use_pallas,
                                  fanout=cfg.residual_fanout or _fixed_fanout(cfg))
        self._decode_steps = self._decode_seqs = 0
        self.overlap = overlap
        self._inflight: Launched | None = None
        # Cumulative seconds per part of step(): host bookkeeping (schedule, inputs, postprocess),
        # dispatch (the jit call: argument transfer and kernel launches), waiting for the device.
        self.step_times = dict.fromkeys(("schedule_s", "inputs_s", "dispatch_s", "device_s",
                                         "postprocess_s", "steps"), 0)
        self.warmup_s = 0.0  # seconds spent compiling every shape at start
        if warmup not in (True, False, "background"):
            raise ValueError(f"warmup={warmup!r}: expected True, False or 'background'")
        if warmup:
            t = time.perf_counter()
            self.runner.warmup(progress, compile_workers, background=warmup == "background")
            self.warmup_s = time.perf_counter() - t

    @classmethod
    def from_pretrained(cls, model, adapters=None, cache_policy="forkkv", dtype="bfloat16",
                        page_size=16, kv_cache_bytes=None, max_batch_size=None,
                        max_lora_rank=None, *, max_loras: int = 8, seed: int = 0,
                        lora_target_modules=None, residual_fanout: bool = False,
                        residual_fraction: float | None = None, schedule_policy: str = "lpm",
                        deterministic: bool = False, **engine_kwargs):
        """`model`: a HF checkpoint dir or a built-in name; `adapters`: {name: PEFT dir or
        LoraAdapter}. The tiny built-in models load their demo adapters when `adapters` is None.
        `lora_target_modules`: projections that carry LoRA slots (default: those the start-up
        adapters target, all seven without any; adapters loaded later must fit in them).
        `residual_fanout` (`forkkv` only): a request also writes the residuals of every other
        loaded adapter from its own hidden states, unless it names its group
        (`fanout_adapters`). `residual_fraction`: share of `kv_cache_bytes` for the residual
        pool (default: one residual copy per base token per adapter loaded here, at least one).
        `schedule_policy`: "lpm" (cache-aware, admission.py) or "fifo". `deterministic`: a
        request's logits are bitwise the same whatever batch it runs in, however its prompt was
        chunked and whether its prefix came from the cache (fixed shapes, buckets.py), unless it
        is preempted (its generated tokens' K/V are then recomputed by an extend step).
        Extra keywords (max_model_len, max_prefill_tokens, use_pallas, progress, overlap,
        max_wait_s, `warmup`: True compiles every shape before returning, "background" on other
        threads while serving, False when a step first needs it; `compile_workers`: threads of
        the warm-up's compiles) go to the constructor."""
        cfg = EngineConfig(cache_policy=cache_policy, dtype=dtype, page_size=page_size,
                           kv_cache_bytes=kv_cache_bytes, max_batch_size=max_batch_size,
                           max_lora_rank=max_lora_rank, max_loras=max_loras,
                           lora_target_modules=None if lora_target_modules is None
                           else tuple(lora_target_modules), residual_fanout=residual_fanout,
                           residual_fraction=residual_fraction, schedule_policy=schedule_policy,
                           deterministic=deterministic)
        model_cfg, net, tokenizer, loaded = load_model_and_adapters(model, adapters, cfg, seed)
        if cache_policy == "lrshared":
            _check_lrshared(loaded)
        copies = max(1, len(loaded)) if cache_policy == "forkkv" else 1
        engine = cls(model_cfg, net, cfg, tokenizer, residual_copies=copies, **engine_kwargs)
        for adapter in loaded:
            engine._install(adapter)
        return engine

    # ---- adapters ---------------------------------------------------------------------------

    def load_adapter(self, name: str, path):
        """Add or replace adapter `name` (PEFT dir or `LoraAdapter`). Requests already running on
        a replaced adapter finish first; new ones see the new weights and a new cache identity."""
        adapter = read_adapters({name: path}, self.model_cfg)[0]
        check_fits(self.model, adapter)  # before draining anything
        if self.config.cache_policy == "lrshared":
            others = [a for n, (_, a) in self.slots.by_name.items() if n != name]
            _check_lrshared(others + [adapter])
        self._drain(name)
        self._install(adapter)

    def unload_adapter(self, name: str):
        """Remove adapter `name` once the requests running on it have finished."""
        self.slots.slot_of(name)  # KeyError for an unknown name, before anything changes
        self._drain(name)
        write_slot(self.model, self.slots.remove(name), None)
        self.runner.set_model(self.model)

    def _drain(self, name: str):
        """Step until no request runs on adapter `name` or writes its residual (fan-out): its
        slot's weights and cache identity are about to change."""
        slot = self.slots.by_name[name][0] if name in self.slots.by_name else None
        while any(s.adapter == name or slot in s.fanout
                  for s in self.scheduler.running + list(self.scheduler.waiting)):
            self.step()

    def _install(self, adapter: LoraAdapter):
        slot = self.slots.assign(adapter)
        write_slot(self.model, slot, adapter)
        self.slots.put(slot, adapter)
        self.runner.set_model(self.model)

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt, adapter: str | None = None, params: SamplingParams | None = None,
                    score: bool = False, *, session_id: str | None = None,
                    fanout_adapters=None, cache_salt: str | None = None,
                    score_from: int = 0) -> Sequence:
        """Validate and queue one request (ValueError / KeyError and nothing queued if bad).

        `session_id`: requests of one workflow; its pages are evicted after others' for a
        while after each of its requests ends, so the next turn finds them. `fanout_adapters`
        (`forkkv`): the agents whose residuals this request writes too; None follows the
        engine's `residual_fanout` (every loaded adapter, or none), [] none. `cache_salt`: the
        request shares cached pages (base and residual) only with requests of the same salt
        (one salt per trust domain: under `forkkv` agents of one salt read each other's base)."""
        ids = prompt_ids(prompt, self.tokenizer, self.model_cfg.vocab_size, self.max_model_len)
        slot = self.slots.slot_of(adapter)
        salt = check_salt(cache_salt)
        key = salted(self.slots.key_of(adapter), salt)
        if session_id is not None and not isinstance(session_id, str):
            raise ValueError(f"session_id={session_id!r}: expected a string")
        fanout = fanout_targets(self.slots, self.config, key, fanout_adapters, salt)
        params = params or SamplingParams()
        if not params.ignore_eos:
            params = SamplingParams(**{**params.__dict__, "stop_token_ids": tuple(
                set(params.stop_token_ids) | set(self.model_cfg.eos_token_ids))})
        seq = Sequence(ids, adapter, slot, key, params, score=score, session_id=session_id,
                       fanout=fanout, prefill_whole_prompt=self.config.deterministic,
                       score_from=score_from)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence):
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, "abort")

    def step(self) -> list[Sequence]:
        """One engine step; returns the requests whose step's results it took in (finished
        ones included): with overlap, those of the step launched one call earlier."""
        t0 = time.perf_counter()
        try:
            batch = self.scheduler.schedule(allow_preempt=self._inflight is None)
        except PreemptionNeeded:  # the victims' tokens in flight must be known first
            done = self._finish_inflight()
            t0 = time.perf_counter()
            return done + self._launch_and_finish(t0, self.scheduler.schedule())
        return self._launch_and_finish(t0, batch)

    def _launch_and_finish(self, t0, batch) -> list[Sequence]:
        t1 = time.perf_counter()
        self._time("schedule_s", t1 - t0)
        if batch is None:
            return self._finish_inflight()
        all_logits = any(s.score for s in batch.seqs)
        sync = all_logits or not self.overlap
        done = self._finish_inflight() if sync else []
        launched = self.runner.launch(batch, all_logits, any(s.return_hidden for s in batch.seqs))
        self._time("inputs_s", self.runner.last_inputs_s)
        self._time("dispatch_s", self.runner.last_dispatch_s)
        self._time("steps", 1)
        self._mark_launched(batch)
        done += self._finish_inflight()  # the previous step, while this one runs
        self._inflight = launched
        return done + (self._finish_inflight() if sync else [])

    def _time(self, key, dt):
        self.step_times[key] += dt

    def _mark_launched(self, batch):
        """Advance the host state as if the launched step had finished: its positions are
        computed and each request that samples has one more (PENDING) token."""
        if batch.kind == "decode":
            self._decode_steps += 1
            self._decode_seqs += len(batch.seqs)
        batch.samples = []
        for i, (seq, (_, end)) in enumerate(zip(batch.seqs, batch.chunks)):
            seq.num_computed = end
            if seq.score or end < len(seq):
                continue  # a score request, or a prefill chunk short of the prompt's end
            seq.pending += 1
            seq.sample_row = i
            batch.samples.append(i)

    def _finish_inflight(self) -> list[Sequence]:
        if self._inflight is None:
            return []
        launched, self._inflight = self._inflight, None
        t0 = time.perf_counter()
        out = self.runner.fetch(launched)
        t1 = time.perf_counter()
        self._postprocess(launched.batch, out)
        self._time("device_s", t1 - t0)
        self._time("postprocess_s", time.perf_counter() - t1)
        return list(dict.fromkeys(launched.batch.seqs))  # a request in pieces: once

    def _postprocess(self, batch, out: Fetched):
        for i, (seq, (start, end)) in enumerate(zip(batch.seqs, batch.chunks)):
            if seq.status is not Status.RUNNING:
                continue
            if not out.finite[i]:  # before anything of this step enters the trees
                self.scheduler.finish(seq, "error", NonFiniteError(
                    f"the model computed NaN or inf for positions {start}-{end - 1} of this request"
                    f" (adapter {seq.adapter!r}); from {start} on, nothing of it was cached"))
                continue
            bad = [slot for slot in seq.cache.fanout if not out.fan_finite[i, slot]]
            if bad:  # another agent's residuals of this request: never cached, it goes on
                self.scheduler.drop_fanout(seq, bad)
            seq.num_verified = end
            if seq.score:
                seq.prompt_logits.append(out.logits[i])
                if seq.return_hidden:
                    seq.prompt_hidden.append(out.hidden[i])
                if end == len(seq):
                    self.scheduler.finish(seq, "length")
        if batch.kind == "extend":  # share each chunk's whole pages with the requests in flight
            for seq, (_, end) in zip(batch.seqs, batch.chunks):
                self.scheduler.chunk_done(seq, end)
        for i in batch.samples:
            seq = batch.seqs[i]
            if seq.status is not Status.RUNNING:
                continue  # aborted, or stopped one step earlier: this token is dropped
            seq.pending -= 1
            token = int(out.tokens[i])
            seq.output.append(token)
            p = seq.params
            if token in p.stop_token_ids:
                self.scheduler.finish(seq, "stop")
            elif (len(seq.output) >= p.max_new_tokens
                  or len(seq) - seq.pending >= self.max_model_len):
                self.scheduler.finish(seq, "length")

    def _run_until_done(self, seqs: list[Sequence]):
        while any(s.status is not Status.FINISHED for s in seqs):
            if not self.step() and not self.scheduler.has_work:
                break
        for s in seqs:
            if s.error is not None:
                raise s.error

    def generate(self, prompts, adapters=None, max_new_tokens=16, temperature=0.0, top_p=1.0,
                 seed=0, *, top_k: int = 0, stop_token_ids=(), ignore_eos=False,
                 session_id: str | None = None, fanout_adapters=None,
                 cache_salt: str | None = None) -> list[list[int]]:
        if adapters is None or isinstance(adapters, str):
            adapters = [adapters] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} adapters for {len(prompts)} prompts")
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 top_k=top_k, seed=(seed * 1000003 + i) & 0xFFFFFFFF,
                                 stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos)
                  for i in range(len(prompts))]
        seqs = []
        try:
            for prompt, adapter, p in zip(prompts, adapters, params):
                seq = self.add_request(prompt, adapter, p, session_id=session_id,
                                       fanout_adapters=fanout_adapters, cache_salt=cache_salt)
                if p.max_new_tokens == 0:
                    self.scheduler.finish(seq, "length")
                seqs.append(seq)
            self._run_until_done(seqs)
        except BaseException:
            for s in seqs:
                self.abort(s)
            raise
        return [list(s.output) for s in seqs]

    def score(self, prompt_ids, adapter=None, *, start: int = 0, cache_salt: str | None = None,
              return_hidden_states: bool = False):
        """[len(prompt) - start, vocab] float32 logits of prompt positions start.., computed
        through the cache: positions the cache holds are read from it (another agent's shared
        base under `forkkv`), only misses are written; positions below `start` that the cache
        holds are not recomputed (a long shared context is then read, not run again).
        `return_hidden_states`: also [L + 1, len(prompt) - start, d] float32 hidden states of the
        same positions, as HF's `output_hidden_states` (the embeddings, every layer's output but
        the last, the final normed state) -> (logits, hidden)."""
        n = len(prompt_ids)
        if not isinstance(start, int) or not 0 <= start < max(n, 1):
            raise ValueError(f"start={start!r}: expected an int in [0, {n})")
        seq = self.add_request(prompt_ids, adapter, SamplingParams(max_new_tokens=0), score=True,
                               cache_salt=cache_salt, score_from=start)
        seq.return_hidden = return_hidden_states
        try:
            self._run_until_done([seq])
        except BaseException:
            self.abort(seq)
            raise
        # The request computed from start or from where the cache ran out, whichever came first.
        logits = np.concatenate(seq.prompt_logits, axis=0)[-(n - start):].astype(np.float32)
        if not return_hidden_states:
            return logits
        return logits, np.concatenate(seq.prompt_hidden, axis=1)[:, -(n - start):]

    def stats(self) -> dict:
        """The keys of docs/design.md, Public contracts, and more; counters run from start-up
        or the last reset_stats()."""
        s = self.cache.stats()
        names = {a.content_hash: n for n, (_, a) in self.slots.by_name.items()}
        s["agent_bytes"] = {names.get(k, k): v for k, v in s["agent_bytes"].items()}
        s["decode_batch_size_mean"] = self._decode_seqs / self._decode_steps if self._decode_steps else 0.0
        s["decode_steps"] = self._decode_steps
        s["prefill_tokens_computed"] = self.scheduler.prefill_tokens_computed
        prompt = s["prompt_tokens"]
        s["base_hit_rate"] = s["base_hit_tokens"] / prompt if prompt else 0.0
        s["residual_hit_rate"] = s["residual_hit_tokens"] / prompt if prompt else 0.0
        s["running"] = len(self.scheduler.running)
        s["waiting"] = len(self.scheduler.waiting)
        s["preemptions"] = self.scheduler.num_preemptions
        return s

    def reset_stats(self) -> dict:
        """Set the counters of `stats()` back to zero (the pools are untouched); returns the
        stats of the interval that ends, so a caller reads hit rates and decode batch sizes
        per interval."""
        s = self.stats()
        self.cache.reset_stats()
        self._decode_steps = self._decode_seqs = 0
        self.scheduler.prefill_tokens_computed = self.scheduler.num_preemptions = 0
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


def _default_kv_bytes(on_gpu: bool) -> int:
    if not on_gpu:
        return DEFAULT_CPU_KV_BYTES
    mem = jax.devices()[0].memory_stats() or {}
    free = mem.get("bytes_limit", 0) - mem.get("bytes_in_use", 0)
    return max(int(free * 0.8), DEFAULT_CPU_KV_BYTES)


def _check_lrshared(adapters: list[LoraAdapter]):
    check_shared_lora_a({a.name: {f"layers.{layer}.{m}": w[0] for (layer, m), w in a.weights.items()}
                         for a in adapters})
