"""Model and engine configuration.

`ModelConfig.from_hf` reads a HF `config.json` (Llama or Qwen2) and refuses, by field name, anything
the models here do not implement, so a checkpoint never loads into a silently different network.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from forkjax.sizes import parse_size

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
CACHE_POLICIES = ("forkkv", "prefix", "full_reuse", "lrshared")
DTYPES = ("float32", "bfloat16")
SCHEDULE_POLICIES = ("lpm", "fifo")
# Adapters a fan-out request writes residuals for by default: every token's K/V write stores
# one residual row per target, so the width is compiled into the step (`max_fanout_adapters`)
DEFAULT_MAX_FANOUT = 6


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None or the HF llama3 scaling dict (factor, low/high_freq_factor, original_max_position_embeddings).
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2: True)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of every LoRA-targetable projection of a decoder layer."""
        d, f = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (d, self.q_size), "k_proj": (d, self.kv_size), "v_proj": (d, self.kv_size),
            "o_proj": (self.q_size, d), "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d),
        }

    @classmethod
    def from_hf(cls, config: str | os.PathLike | dict) -> "ModelConfig":
        """From a HF config dict, a `config.json` path, or a checkpoint directory."""
        if not isinstance(config, dict):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                config = json.load(f)
        c = config
        model_type = c.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: model_type={model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
        if c.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
        if c.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported")
        if model_type == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(c.get("attention_bias", False))
        rope_theta, rope_scaling = _rope_from_hf(c)
        num_heads = c["num_attention_heads"]
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=c.get("num_key_value_heads") or num_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_from_hf(c: dict) -> tuple[float, dict | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or None
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"config.json: rope scaling type {kind!r} is not supported "
                         "(supported: default, llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ValueError(f"config.json: llama3 rope scaling lacks {missing}")
    return float(theta), {k: scaling[k] for k in keys}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    cache_policy: str = "forkkv"
    dtype: str = "bfloat16"
    page_size: int = 16
    # KV budget per device; given as any size `forkjax.sizes.parse_size` takes ("16G", 60e9), held as
    # an int. None: the platform's default (engine/memory.py)
    kv_cache_bytes: int | None = None
    max_batch_size: int | None = None
    max_lora_rank: int | None = None
    max_loras: int = 8  # adapter slots held on the device at once (slot 0 is the bare base model)
    max_cpu_loras: int | None = None  # adapters loaded (on the host) at most; None: no bound
    # Projections that carry LoRA slots (k_proj and v_proj always). None: the modules the
    # adapters given at start target, or all seven when none are given.
    lora_target_modules: tuple[str, ...] | None = None
    # "fused" (A as extra rows of each projection's GEMM: every token through every slot) or
    # "sgmv" (each token against its own slot: cost follows the adapters in the batch), lora/layers.py
    lora_path: str = "fused"
    # forkkv: requests write the residuals of the adapters in slots, so that a second agent on a
    # context another computed is a full hit; None: on under forkkv
    residual_fanout: bool | None = None
    # forkkv: adapters one request fans out to at most (residual rows a token writes beside its
    # own, a width of the compiled step); None: max_loras - 2, at most DEFAULT_MAX_FANOUT
    max_fanout_adapters: int | None = None
    residual_fraction: float | None = None  # share of kv_cache_bytes for the residual pool
    # forkkv: residual token slots per base token slot, the adapters that read one context at
    # once (a workflow's agents); None: every adapter that fits in a device slot
    residual_copies: int | None = None
    schedule_policy: str = "lpm"  # "lpm" (cache-aware admission) | "fifo"
    # Logits bitwise independent of the batch, the chunking and prefix hits (buckets.py: fixed)
    deterministic: bool = False
    # Host memory for pages evicted from the device (cache/host_pool.py); 0: evicted pages are
    # dropped and recomputed; None: the platform's default (engine/memory.py: off on a CPU). Any
    # size form, as kv_cache_bytes
    host_kv_bytes: int | None = None
    # Devices the model is split over (tensor_parallel.py): a 1-D mesh of the first local ones
    tensor_parallel_size: int = 1

    def __post_init__(self):
        self._parse_sizes()
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"cache_policy={self.cache_policy!r}: expected one of {CACHE_POLICIES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {DTYPES}")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size={self.page_size!r}: expected a positive int")
        for name in ("kv_cache_bytes", "max_batch_size", "max_lora_rank", "max_cpu_loras", "residual_copies"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}={v!r}: expected a positive int or None")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size={tp!r}: expected a positive int")
        if tp > 1 and self.host_kv_bytes:
            raise ValueError(f"host_kv_bytes={self.host_kv_bytes}: the host tier does not run under "
                             f"tensor parallelism (tensor_parallel_size={tp}); leave it unset or 0")
        if self.lora_path not in ("fused", "sgmv"):
            raise ValueError(f"lora_path={self.lora_path!r}: expected 'fused' or 'sgmv'")
        if self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras!r}: expected >= 1")
        if self.residual_fanout is None:
            object.__setattr__(self, "residual_fanout", self.cache_policy == "forkkv")
        if self.residual_fanout and self.cache_policy != "forkkv":
            raise ValueError(f"residual_fanout=True needs cache_policy='forkkv', not {self.cache_policy!r}")
        most = fanout_room(self.max_loras)
        f = self.max_fanout_adapters
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or not 0 <= f <= most):
            raise ValueError(f"max_fanout_adapters={f!r}: expected an int in [0, {most}] "
                             f"(max_loras={self.max_loras} slots: the base model's, the request's own "
                             f"and its fan-out targets)")
        if self.residual_fraction is not None and not (
                isinstance(self.residual_fraction, (int, float)) and 0 < self.residual_fraction < 1):
            raise ValueError(f"residual_fraction={self.residual_fraction!r}: expected a number in (0, 1)")
        if self.residual_copies is not None and self.residual_fraction is not None:
            raise ValueError("residual_copies and residual_fraction both size the residual pool: give one")
        if self.residual_copies is not None and self.cache_policy != "forkkv":
            raise ValueError(f"residual_copies={self.residual_copies}: only cache_policy='forkkv' keeps "
                             f"a residual per adapter, not {self.cache_policy!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy={self.schedule_policy!r}: expected one of {SCHEDULE_POLICIES}")

    def _parse_sizes(self):
        """Hold the byte sizes as ints, whatever form they were given in ("16G", 60e9, ...), so
        that the engine reads one type and a bad size fails here, naming its keyword."""
        for name in ("kv_cache_bytes", "host_kv_bytes"):
            v = getattr(self, name)
            if v is not None:
                try:
                    object.__setattr__(self, name, parse_size(v))  # frozen: set before anyone reads it
                except ValueError as e:
                    raise ValueError(f"{name}={v!r}: {e}") from None

    @property
    def fanout_width(self) -> int:
        """Residual fan-out targets a request may have (`max_fanout_adapters` resolved)."""
        if self.max_fanout_adapters is not None:
            return self.max_fanout_adapters
        return default_fanout_width(self.max_loras)


def fanout_room(max_loras: int) -> int:
    """Adapter slots beside the base model's and a request's own: its fan-out targets at most."""
    return max(max_loras - 2, 0)


def default_fanout_width(max_loras: int) -> int:
    return min(fanout_room(max_loras), DEFAULT_MAX_FANOUT)
