"""Resolve `Engine.from_pretrained`'s model and adapters: a built-in name or a checkpoint dir."""

from __future__ import annotations

import os

import jax.numpy as jnp

from forkjax.config import EngineConfig, ModelConfig
from forkjax.lora.peft import LoraAdapter, load_peft_adapter
from forkjax.lora.targets import ALWAYS_LORA, TARGETS
from forkjax.models.builtin import (BUILTIN_CONFIGS, TINY_MODELS, demo_adapters, load_builtin,
                                    trained_adapters)
from forkjax.models.gguf import PACKAGED, GGUFCheckpoint, is_gguf, packaged_path
from forkjax.models.loader import load_checkpoint, load_strict
from forkjax.tokenizer import ByteTokenizer, load_tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def describe_model(model):
    """-> (ModelConfig, tokenizer | None, source) of a built-in name, a packaged model, a .gguf
    file or a checkpoint directory, without reading its weights; source: ("builtin", name),
    ("gguf", GGUFCheckpoint) or ("dir", path)."""
    if isinstance(model, str) and model in BUILTIN_CONFIGS:
        tokenizer = ByteTokenizer() if model in TINY_MODELS else None
        return ModelConfig.from_hf(BUILTIN_CONFIGS[model]), tokenizer, ("builtin", model)
    if isinstance(model, str) and model in PACKAGED:
        model = packaged_path(model)
    if is_gguf(model):
        ckpt = GGUFCheckpoint(os.fspath(model))
        return ModelConfig.from_hf(ckpt.config), ckpt.tokenizer(), ("gguf", ckpt)
    if isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        path = os.fspath(model)
        return ModelConfig.from_hf(path), load_tokenizer(path), ("dir", path)
    raise ValueError(f"model={model!r}: not a checkpoint directory, a .gguf file nor a built-in "
                     f"model ({', '.join([*BUILTIN_CONFIGS, *PACKAGED])})")


def tokenizer_source(model, tokenizer) -> tuple[str, str] | None:
    """How another process builds `model`'s `tokenizer` without loading the model: ("byte",
    ""), ("gguf", file) or ("dir", checkpoint dir); None where the model has none."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, ByteTokenizer):
        return ("byte", "")
    if isinstance(model, str) and model in PACKAGED:
        return ("gguf", packaged_path(model))
    return ("gguf" if is_gguf(model) else "dir", os.fspath(model))


def load_model_and_adapters(model, adapters, cfg: EngineConfig, seed: int = 0):
    """-> (ModelConfig, CausalLM with empty LoRA slots, tokenizer | None, [LoraAdapter]); the
    tiny built-in models bring their demo adapters, packaged ones their trained agents, where
    `adapters` is None."""
    model_cfg, tokenizer, (kind, source) = describe_model(model)
    if adapters is None and kind == "builtin" and model in TINY_MODELS:
        adapters = demo_adapters(model_cfg)
    elif adapters is None and isinstance(model, str) and model in PACKAGED:
        adapters = trained_adapters(model)
    loaded = read_adapters(adapters or {}, model_cfg)
    options = _model_options(loaded, cfg)
    if kind == "builtin":
        _, net = load_builtin(source, seed=seed, **options)
    elif kind == "gguf":
        net = load_strict(source.path, model_cfg, source.names, source.read, **options)
    else:
        _, net = load_checkpoint(source, **options)
    return model_cfg, net, tokenizer, loaded


def _model_options(loaded: list[LoraAdapter], cfg: EngineConfig) -> dict:
    """The model's construction options: slots, dtype, LoRA targets and path, tensor parallelism."""
    return dict(num_slots=cfg.max_loras, rank=_rank_cap(loaded, cfg.max_lora_rank, cfg.lora_path),
                dtype=DTYPES[cfg.dtype], lora_targets=lora_targets(loaded, cfg.lora_target_modules),
                lora_path=cfg.lora_path, tp=cfg.tensor_parallel_size)


def read_adapters(adapters, model_cfg: ModelConfig) -> list[LoraAdapter]:
    """{name: PEFT dir | LoraAdapter} -> validated adapters named by their key."""
    out = []
    for name, src in adapters.items():
        if isinstance(src, LoraAdapter):
            out.append(src if src.name == name else LoraAdapter(name, src.rank, src.scaling, src.weights, src.source))
        else:
            out.append(load_peft_adapter(name, os.fspath(src), model_cfg))
    return out


def lora_targets(adapters: list[LoraAdapter], requested) -> tuple[str, ...]:
    """Projections that get LoRA slots: `requested`, else what the start-up adapters target (as
    SGLang infers --lora-target-modules), else all; k_proj and v_proj always (the residual)."""
    if requested is not None:
        bad = sorted(set(requested) - set(TARGETS))
        if bad:
            raise ValueError(f"lora_target_modules: {bad} not supported "
                             f"(supported: {', '.join(TARGETS)})")
        want = set(requested)
    elif adapters:
        want = {module for a in adapters for (_, module) in a.weights}
    else:
        want = set(TARGETS)
    for a in adapters:
        missing = sorted({module for (_, module) in a.weights} - want - set(ALWAYS_LORA))
        if missing:
            raise ValueError(f"adapter {a.name!r} targets {missing}, not in "
                             f"lora_target_modules={sorted(want)}")
    return tuple(t for t in TARGETS if t in want or t in ALWAYS_LORA)


def _rank_cap(adapters: list[LoraAdapter], max_lora_rank, lora_path: str = "fused") -> int:
    """R of the stacked slots: max_lora_rank, else the largest initial rank and at least 16
    (vLLM's default), so adapters loaded later fit; on the sgmv path a power of two (its
    kernels' blocks)."""
    need = max((a.rank for a in adapters), default=1)
    if max_lora_rank is not None and need > max_lora_rank:
        raise ValueError(f"adapter rank {need} exceeds max_lora_rank={max_lora_rank}")
    rank = max_lora_rank or max(need, 16)
    return rank if lora_path == "fused" else max(16, 1 << (rank - 1).bit_length())
