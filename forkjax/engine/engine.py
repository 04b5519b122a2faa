"""The public `Engine` (DESIGN.md §3).

First version: a dense forward over whole sequences with no KV cache (every step recomputes the
batch), exact for greedy decoding and scoring. The paged cache, scheduler and kernels replace the
insides behind the same contract.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forkjax.config import EngineConfig
from forkjax.engine.sampler import sample, validate_sampling
from forkjax.lora.peft import LoraAdapter, load_peft_adapter
from forkjax.lora.slots import AdapterSlots, write_slot
from forkjax.models.attention import DenseMeta, dense_attention
from forkjax.models.builtin import BUILTIN_CONFIGS, TINY_MODELS, demo_adapters, load_builtin
from forkjax.models.loader import load_checkpoint
from forkjax.models.transformer import ForwardBatch
from forkjax.tokenizer import ByteTokenizer, load_tokenizer

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _bucket(n: int, minimum: int = 16) -> int:
    """Pad token counts to powers of two so a few shapes cover every batch."""
    return max(minimum, 1 << (n - 1).bit_length())


def _forward(graphdef, state, tokens, positions, segment_ids, group_sizes, rows):
    """One dense forward -> float32 logits of `rows` [K] of the flat batch."""
    model = nnx.merge(graphdef, state)
    batch = ForwardBatch(positions=positions, group_sizes=group_sizes,
                         attn=DenseMeta(segment_ids=segment_ids))
    attn = lambda *a: dense_attention(*a, precision=model.precision)  # noqa: E731
    h, _, _ = model(tokens, batch, attn)
    return model.logits(h[rows])


class Engine:
    def __init__(self, model_cfg, model, engine_cfg: EngineConfig, tokenizer=None):
        self.model_cfg = model_cfg
        self.model = model
        self.config = engine_cfg
        self.tokenizer = tokenizer
        self.slots = AdapterSlots(engine_cfg.max_loras)
        self._forward = jax.jit(_forward, static_argnums=0)
        self._split()
        self._stats = {"prompt_tokens": 0, "decode_steps": 0, "decode_seqs": 0}

    @classmethod
    def from_pretrained(cls, model, adapters=None, cache_policy="forkkv", dtype="bfloat16",
                        page_size=16, kv_cache_bytes=None, max_batch_size=None,
                        max_lora_rank=None, *, max_loras: int = 8, seed: int = 0):
        """`model`: a HF checkpoint dir or a built-in name; `adapters`: {name: PEFT dir or
        LoraAdapter}. The tiny built-in models load their demo adapters when `adapters` is None."""
        cfg = EngineConfig(cache_policy=cache_policy, dtype=dtype, page_size=page_size,
                           kv_cache_bytes=kv_cache_bytes, max_batch_size=max_batch_size,
                           max_lora_rank=max_lora_rank, max_loras=max_loras)
        jdtype = _DTYPES[dtype]
        if isinstance(model, str) and model in BUILTIN_CONFIGS:
            from forkjax.config import ModelConfig
            model_cfg = ModelConfig.from_hf(BUILTIN_CONFIGS[model])
            tokenizer = ByteTokenizer() if model in TINY_MODELS else None
            if adapters is None and model in TINY_MODELS:
                adapters = demo_adapters(model_cfg)
            loaded = _read_adapters(adapters or {}, model_cfg)
            rank = _rank_cap(loaded, max_lora_rank)
            model_cfg, net = load_builtin(model, num_slots=max_loras, rank=rank, dtype=jdtype, seed=seed)
        elif isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
            from forkjax.config import ModelConfig
            model_cfg = ModelConfig.from_hf(model)
            loaded = _read_adapters(adapters or {}, model_cfg)
            rank = _rank_cap(loaded, max_lora_rank)
            model_cfg, net = load_checkpoint(os.fspath(model), num_slots=max_loras, rank=rank, dtype=jdtype)
            tokenizer = load_tokenizer(os.fspath(model))
        else:
            raise ValueError(f"model={model!r}: not a checkpoint directory nor a built-in model "
                             f"({', '.join(BUILTIN_CONFIGS)})")
        engine = cls(model_cfg, net, cfg, tokenizer)
        for adapter in loaded:
            engine._install(adapter)
        return engine

    # ---- adapters ---------------------------------------------------------------------------

    def load_adapter(self, name: str, path):
        """Add or replace adapter `name` from a PEFT directory (or a `LoraAdapter`)."""
        adapter = _read_adapters({name: path}, self.model_cfg)[0]
        self._install(adapter)

    def unload_adapter(self, name: str):
        slot = self.slots.remove(name)
        write_slot(self.model, slot, None)
        self._split()

    def _install(self, adapter: LoraAdapter):
        slot = self.slots.assign(adapter)
        write_slot(self.model, slot, adapter)
        self.slots.put(slot, adapter)
        self._split()

    def _split(self):
        self._graphdef, self._state = nnx.split(self.model)

    # ---- requests ---------------------------------------------------------------------------

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; this model has none: pass token ids")
            prompt = self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.model_cfg.vocab_size})")
        if len(ids) > self.model_cfg.max_position_embeddings:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the context of "
                             f"{self.model_cfg.max_position_embeddings}")
        return ids

    def _run(self, seqs: list[list[int]], slots: list[int], all_rows: bool) -> list[np.ndarray]:
        """Dense forward of whole sequences -> logits per sequence (all rows or the last)."""
        order = sorted(range(len(seqs)), key=lambda i: slots[i])  # tokens grouped by slot
        total = sum(len(s) for s in seqs)
        t = _bucket(total)
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        segments = np.full(t, -1, np.int32)
        group_sizes = np.zeros(self.config.max_loras, np.int32)
        spans, off = {}, 0
        for i in order:
            n = len(seqs[i])
            tokens[off:off + n] = seqs[i]
            positions[off:off + n] = np.arange(n)
            segments[off:off + n] = i
            group_sizes[slots[i]] += n
            spans[i] = (off, n)
            off += n
        rows = (np.arange(t) if all_rows
                else np.array([spans[i][0] + spans[i][1] - 1 for i in range(len(seqs))]
                              + [0] * (_bucket(len(seqs), 1) - len(seqs))))
        logits = np.asarray(self._forward(self._graphdef, self._state, tokens, positions, segments,
                                          group_sizes, rows.astype(np.int32)))
        if all_rows:
            return [logits[spans[i][0]:spans[i][0] + spans[i][1]] for i in range(len(seqs))]
        return [logits[i] for i in range(len(seqs))]

    def generate(self, prompts, adapters=None, max_new_tokens=16, temperature=0.0, top_p=1.0,
                 seed=0) -> list[list[int]]:
        validate_sampling(temperature, top_p)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 0")
        seqs = [self._prompt_ids(p) for p in prompts]
        if adapters is None or isinstance(adapters, str):
            adapters = [adapters] * len(seqs)
        if len(adapters) != len(seqs):
            raise ValueError(f"{len(adapters)} adapters for {len(seqs)} prompts")
        slots = [self.slots.slot_of(a) for a in adapters]
        self._stats["prompt_tokens"] += sum(len(s) for s in seqs)
        eos = set(self.model_cfg.eos_token_ids)
        rngs = [np.random.default_rng([seed, i]) for i in range(len(seqs))]
        out: list[list[int]] = [[] for _ in seqs]
        live = [i for i in range(len(seqs)) if max_new_tokens > 0]
        while live:
            logits = self._run([seqs[i] + out[i] for i in live], [slots[i] for i in live], False)
            self._stats["decode_steps"] += 1
            self._stats["decode_seqs"] += len(live)
            for i, row in zip(live, logits):
                out[i].append(sample(row, temperature, top_p, rngs[i]))
            live = [i for i in live if len(out[i]) < max_new_tokens and out[i][-1] not in eos
                    and len(seqs[i]) + len(out[i]) < self.model_cfg.max_position_embeddings]
        return out

    def score(self, prompt_ids, adapter=None) -> np.ndarray:
        """[len(prompt), vocab] float32 logits of every prompt position."""
        ids = self._prompt_ids(prompt_ids)
        self._stats["prompt_tokens"] += len(ids)
        return self._run([ids], [self.slots.slot_of(adapter)], True)[0]

    def stats(self) -> dict:
        s = self._stats
        return {
            "base_pages_total": 0, "base_pages_used": 0,
            "residual_pages_total": 0, "residual_pages_used": 0,
            "base_bytes_used": 0, "residual_bytes_used": 0,
            "prompt_tokens": s["prompt_tokens"], "base_hit_tokens": 0, "residual_hit_tokens": 0,
            "decode_batch_size_mean": s["decode_seqs"] / s["decode_steps"] if s["decode_steps"] else 0.0,
        }


def _read_adapters(adapters, model_cfg) -> list[LoraAdapter]:
    out = []
    for name, src in adapters.items():
        if isinstance(src, LoraAdapter):
            out.append(src if src.name == name else LoraAdapter(name, src.rank, src.scaling, src.weights, src.source))
        else:
            out.append(load_peft_adapter(name, os.fspath(src), model_cfg))
    return out


def _rank_cap(adapters: list[LoraAdapter], max_lora_rank):
    """R of the stacked slots: max_lora_rank, else the largest initial rank (at least 1)."""
    need = max((a.rank for a in adapters), default=1)
    if max_lora_rank is not None and need > max_lora_rank:
        raise ValueError(f"adapter rank {need} exceeds max_lora_rank={max_lora_rank}")
    return max_lora_rank or need
