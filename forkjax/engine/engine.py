"""The public `Engine` (docs/design.md, Public contracts): paged dual KV cache, continuous
batching, multi-LoRA.

`Engine.from_pretrained` loads a model and its adapters; `load_adapter` / `unload_adapter`
change the adapters while it serves; `generate` and `score` submit requests and step until
theirs finish. The step loop itself, which a server drives through `add_request` / `step` /
`abort`, is `EngineCore`'s (engine_core.py).
"""

from __future__ import annotations

import numpy as np

from forkjax.cache import check_shared_lora_a, residual_copies_for
from forkjax.cache.policy import TOKEN_BITS
from forkjax.config import EngineConfig
from forkjax.engine.engine_core import EngineCore
from forkjax.engine.loading import load_model_and_adapters, read_adapters
from forkjax.engine.sequence import SamplingParams, Sequence
from forkjax.lora.peft import LoraAdapter
from forkjax.lora.slots import check_fits

# `warmup` by the name `python -m forkjax.serve --warmup` gives it
WARMUP_MODES = {"background": "background", "full": True, "none": False}


class Engine(EngineCore):
    """forkjax's public engine: `EngineCore` with loading, adapter management and the blocking
    `generate` / `score` calls."""

    @classmethod
    def from_pretrained(cls, model, adapters=None, cache_policy="forkkv", dtype="bfloat16",
                        page_size=16, kv_cache_bytes=None, max_batch_size=None,
                        max_lora_rank=None, *, max_loras: int = 8, max_cpu_loras: int | None = None,
                        pinned_adapters=(), seed: int = 0,
                        lora_target_modules=None, lora_path: str = "fused", residual_fanout: bool | None = None,
                        max_fanout_adapters: int | None = None, residual_fraction: float | None = None,
                        residual_copies: int | None = None,
                        schedule_policy: str = "lpm",
                        deterministic: bool = False, host_kv_bytes: int | float | str | None = None,
                        tensor_parallel_size: int = 1, **engine_kwargs):
        """`model`: a HF checkpoint dir or a built-in name; `adapters`: {name: PEFT dir or
        LoraAdapter}. The tiny built-in models load their demo adapters when `adapters` is None.
        `kv_cache_bytes` (per device; None: what the device's free memory allows, engine/memory.py)
        and `host_kv_bytes` take any size `forkjax.sizes.parse_size` reads: 16 * 2**30, 60e9,
        "16GB", "16GiB", "16G" (vLLM's letters: upper case binary, lower case decimal).
        `max_loras`: device adapter slots (slot 0 is the bare model): more adapters than
        slots wait on the host and take a slot when a request needs one, least recently used
        first (lora/slots.py); `max_cpu_loras`: adapters loaded at most (None: no bound);
        `pinned_adapters`: names that keep their slots. `lora_target_modules`: projections
        that carry LoRA slots (default: those the start-up adapters target, all seven without
        any; adapters loaded later must fit in them). `lora_path`: "fused" (A as rows of each
        projection's GEMM) or "sgmv" (each token against its own adapter slot: the cost follows
        the adapters in the batch, not max_loras; lora/layers.py). `residual_fanout` (`forkkv` only; None: on
        under `forkkv`): a request also writes the residuals of the other adapters in device
        slots (every other loaded one while they fit) from its own hidden states, unless it names
        its group (`fanout_adapters`), so that another agent's later request on its prefix is a
        full hit; `max_fanout_adapters`: the most a request fans out to (residual rows
        a token writes beside its own, compiled into the step; default max_loras - 2, at most 6).
        `residual_fraction`: share of `kv_cache_bytes` for the residual
        pool, or `residual_copies` (`forkkv`): residual copies of each base token it holds room
        for, the adapters that read one context at once (default: every adapter that fits in a
        slot; with workflows that each bring their own agents, a workflow's agents).
        `schedule_policy`: "lpm" (cache-aware, admission.py) or "fifo". `deterministic`: a
        request's logits are bitwise the same whatever batch it runs in, however its prompt was
        chunked and whether its prefix came from the cache (fixed shapes, buckets.py), unless it
        is preempted (its generated tokens' K/V are then recomputed by an extend step).
        `host_kv_bytes`: host memory for KV pages evicted from the device, loaded back on a hit
        instead of recomputed (cache/host_pool.py; 0: off; None: off on a CPU, on a GPU half
        the available host memory, at most twice the device KV budget, engine/memory.py).
        `tensor_parallel_size`: devices the model and the base KV pool are split over (Megatron
        layout by heads, tensor_parallel.py; the first local devices; no host tier).
        Extra keywords (max_model_len, max_prefill_tokens, use_pallas, progress, overlap,
        max_wait_s, `session_ttl_s`: seconds an idle session keeps its pages, about your longest
        tool call (sessions.py), `warmup`: True compiles every shape before returning, "background" on other
        threads while serving, False when a step first needs it; `compile_workers`: compiles the
        warm-up runs at once) go to the constructor."""
        cfg = EngineConfig(cache_policy=cache_policy, dtype=dtype, page_size=page_size,
                           kv_cache_bytes=kv_cache_bytes, max_batch_size=max_batch_size,
                           max_lora_rank=max_lora_rank, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                           lora_target_modules=None if lora_target_modules is None
                           else tuple(lora_target_modules), lora_path=lora_path,
                           residual_fanout=residual_fanout, max_fanout_adapters=max_fanout_adapters,
                           residual_fraction=residual_fraction, residual_copies=residual_copies,
                           schedule_policy=schedule_policy,
                           deterministic=deterministic, host_kv_bytes=host_kv_bytes,
                           tensor_parallel_size=tensor_parallel_size)
        model_cfg, net, tokenizer, loaded = load_model_and_adapters(model, adapters, cfg, seed)
        if cache_policy == "lrshared":
            _check_lrshared(loaded)
        unknown = sorted(set(pinned_adapters) - {a.name for a in loaded})
        if unknown:
            raise ValueError(f"pinned_adapters: {unknown} are not among the adapters loaded at start")
        copies = residual_copies_for(cache_policy, len(loaded), max_loras, residual_copies)
        alora = any(a.invocation_tokens is not None for a in loaded)  # compile for them from the start
        engine = cls(model_cfg, net, cfg, tokenizer, residual_copies=copies, alora=alora, **engine_kwargs)
        for adapter in loaded:
            engine._install(adapter, adapter.name in pinned_adapters)
        return engine

    # ---- adapters ---------------------------------------------------------------------------

    def load_adapter(self, name: str, path, pinned: bool = False):
        """Add or replace adapter `name` (PEFT dir or `LoraAdapter`); `pinned`: it keeps a
        device slot. Requests already running on a replaced adapter finish first; new ones see
        the new weights and a new cache identity."""
        self._check_open()
        adapter = read_adapters({name: path}, self.model_cfg)[0]
        check_fits(self.model, adapter)  # before draining anything
        if self.config.cache_policy == "lrshared":
            others = [a for n, a in self.slots.by_name.items() if n != name]
            _check_lrshared(others + [adapter])
        self._drain(name)
        self._install(adapter, pinned)

    def unload_adapter(self, name: str):
        """Remove adapter `name` once the requests running on it have finished."""
        self._check_open()
        self.slots.check(name)  # KeyError for an unknown name, before anything changes
        self._drain(name)
        self.slots.remove(name)
        self.writer.forget(name)

    def _drain(self, name: str):
        """Step until no request runs on adapter `name` or writes its residual (fan-out): its
        slot's weights and cache identity are about to change."""
        while any(s.adapter == name or name in s.targets.values()
                  for s in self.scheduler.running + list(self.scheduler.waiting)):
            self.step()

    def _install(self, adapter: LoraAdapter, pinned: bool = False):
        """Register `adapter`; it takes a device slot now if one is free or it is pinned."""
        if adapter.invocation_tokens is not None:
            if self.model_cfg.vocab_size > 1 << TOKEN_BITS:
                raise ValueError(f"adapter {adapter.name!r}: Activated LoRA needs a vocabulary of at "
                                 f"most {1 << TOKEN_BITS} tokens, not {self.model_cfg.vocab_size}")
            self.runner.enable_alora()
        self.slots.add(adapter, pinned)
        self.writer.prepare(adapter)
        if pinned or len(self.slots.slot_by_name) < self.slots.num_slots - 1:
            while (writes := self.slots.acquire([adapter.name], self.scheduler.busy_adapters)) is None:
                self.step()  # every unpinned slot is in use: until one is free
            self._write_slots(writes)

    def generate(self, prompts, adapters=None, max_new_tokens=16, temperature=0.0, top_p=1.0,
                 seed=0, *, top_k: int = 0, stop_token_ids=(), ignore_eos=False,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, min_tokens: int = 0, logit_bias=None,
                 session_id: str | None = None, session_end: bool = False,
                 session_tokens: int | None = None, session_next_s: float | None = None,
                 fanout_adapters=None, cache_salt: str | None = None,
                 guided: str | None = None) -> list[list[int]]:
        """Generate for every prompt at once and return each one's new tokens. The penalties,
        `min_tokens`, `logit_bias` ({token id: bias}) and `guided` (a grammar every output
        follows: `forkjax.structured_output.json_schema_grammar(schema)` for a JSON schema) are
        SamplingParams'. The session keywords apply to every prompt (`session_end`: the session
        ends when the last of them finishes); add_request says what they do."""
        if adapters is None or isinstance(adapters, str):
            adapters = [adapters] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} adapters for {len(prompts)} prompts")
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 top_k=top_k, seed=(seed * 1000003 + i) & 0xFFFFFFFF,
                                 stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                                 presence_penalty=presence_penalty,
                                 frequency_penalty=frequency_penalty,
                                 repetition_penalty=repetition_penalty, min_tokens=min_tokens,
                                 logit_bias=tuple((logit_bias or {}).items()), guided=guided)
                  for i in range(len(prompts))]
        seqs = []
        try:
            for prompt, adapter, p in zip(prompts, adapters, params):
                seq = self.add_request(prompt, adapter, p, session_id=session_id,
                                       session_end=session_end, session_tokens=session_tokens,
                                       session_next_s=session_next_s,
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
        seq = self.add_score_request(prompt_ids, adapter, start=start, cache_salt=cache_salt,
                                     return_hidden_states=return_hidden_states)
        try:
            self._run_until_done([seq])
        except BaseException:
            self.abort(seq)
            raise
        return self.scored(seq)

    def add_score_request(self, prompt_ids, adapter=None, *, start: int = 0,
                          cache_salt: str | None = None, return_hidden_states: bool = False) -> Sequence:
        """Queue what `score` computes as a request that `step` runs chunk by chunk like any
        other (a server keeps serving, and may `abort` it); once it has finished without an
        error, `scored(seq)` is `score`'s result."""
        n = len(prompt_ids)
        if not isinstance(start, int) or not 0 <= start < max(n, 1):
            raise ValueError(f"start={start!r}: expected an int in [0, {n})")
        return self.add_request(prompt_ids, adapter, SamplingParams(max_new_tokens=0), score=True,
                                cache_salt=cache_salt, score_from=start,
                                return_hidden=return_hidden_states)

    @staticmethod
    def scored(seq: Sequence):
        """`score`'s result of a finished score request (`add_score_request`)."""
        n, start = len(seq.prompt), seq.score_from
        # The request computed from start or from where the cache ran out, whichever came first.
        logits = np.concatenate(seq.prompt_logits, axis=0)[-(n - start):].astype(np.float32)
        if not seq.return_hidden:
            return logits
        return logits, np.concatenate(seq.prompt_hidden, axis=1)[:, -(n - start):]


def _check_lrshared(adapters: list[LoraAdapter]):
    """The adapters that keep a residual share one A (Activated LoRA adapters keep none)."""
    check_shared_lora_a({a.name: {f"layers.{layer}.{m}": w[0] for (layer, m), w in a.weights.items()}
                         for a in adapters if a.invocation_tokens is None})
