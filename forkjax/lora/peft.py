"""PEFT LoRA adapter directories -> `LoraAdapter` (host numpy), refusing what we do not run, and
`LoraAdapter` -> a PEFT directory (`save_peft_adapter`).

Supported: `peft_type: LORA` on the decoder projections q/k/v/o/gate/up/down, any rank, `lora_alpha`,
`use_rslora`, `target_modules` as a list of names, one name, "all-linear" or a regex, weights in
`adapter_model.safetensors`, and Activated LoRA's `alora_invocation_tokens` (lora/activated.py). Everything else is refused with an error naming the field, because
running it without its effect would silently change the model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from forkjax.cache.adapters import adapter_fingerprint
from forkjax.config import ModelConfig
from forkjax.lora.targets import BLOCK, TARGETS

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    # (layer, module) -> (A [d_in, r], B [r, d_out] with `scaling` folded in), float32.
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    source: str = "<memory>"
    # Activated LoRA: the token ids whose last occurrence in a prompt switches it on (None: a
    # plain adapter, on everywhere)
    invocation_tokens: tuple[int, ...] | None = None

    def __post_init__(self):
        """ValueError naming the first tensor with a NaN or inf (B with its scale folded in: a
        finite B times a large alpha may not be), however the adapter was made. Such a slot
        would reach only its own tokens (slots are selected, never mixed), but those would
        compute NaN."""
        for (layer, module), pair in sorted(self.weights.items()):
            for ab, w in zip("AB", pair):
                bad = np.size(w) - np.count_nonzero(np.isfinite(w))
                if bad:
                    raise ValueError(
                        f"adapter {self.name!r}: tensor base_model.model.model.layers.{layer}."
                        f"{BLOCK[module]}.{module}.lora_{ab}.weight has {bad} non-finite values "
                        "(NaN or inf); refusing to load it")

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of its A and B (float32, on the host)."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def scaled(self, factor: float) -> LoraAdapter:
        """This adapter with B times `factor`: the same directions, `factor` times its update
        x·A·B (the adapter-strength axis of a fidelity sweep)."""
        return dataclasses.replace(self, scaling=self.scaling * factor,
                                   weights={k: (a, b * np.float32(factor)) for k, (a, b) in self.weights.items()})

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(m for _, m in self.weights)

    @functools.cached_property
    def content_hash(self) -> str:
        """Identity of the adapter's function: same weights -> same hash, whatever its name."""
        return adapter_fingerprint({f"{layer}.{module}.{ab}": w
                                    for (layer, module), pair in self.weights.items()
                                    for ab, w in zip("AB", pair)})


def _config_error(path, field, value, why):
    return ValueError(f"{path}: adapter_config.json field {field}={value!r}: {why}")


def _targets_of(cfg: dict, path: str) -> set[str]:
    tm = cfg.get("target_modules")
    if tm is None:
        raise _config_error(path, "target_modules", tm, "must name the projections LoRA applies to")
    if isinstance(tm, str):
        if tm == "all-linear":
            return set(TARGETS)
        if tm in TARGETS:
            return {tm}
        # PEFT treats a string as a regex over full module names.
        pattern = re.compile(tm)
        names = {t for t in TARGETS if pattern.fullmatch(f"model.layers.0.{BLOCK[t]}.{t}")}
        if not names:
            raise _config_error(path, "target_modules", tm, "matches no supported projection")
        return names
    # PEFT matches a list entry as a module-name suffix ("all-linear" is saved as full names).
    names = {str(t).rsplit(".", 1)[-1] for t in tm}
    bad = sorted(names - set(TARGETS))
    if bad:
        raise _config_error(path, "target_modules", tm,
                            f"{bad} not supported (supported: {', '.join(TARGETS)}; "
                            "embedding and lm_head LoRA are not)")
    return names


def load_peft_adapter(name: str, path: str, model_cfg: ModelConfig) -> LoraAdapter:
    """Read and validate a PEFT LoRA directory against the base model's shapes."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"adapter {name!r}: {path} is not a directory")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"adapter {name!r}: {path} has no adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"adapter {name!r}: {cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"adapter {name!r}: {cfg_path} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _config_error(path, "peft_type", cfg.get("peft_type"), "only LORA is supported")
    for field, why in (("use_dora", "DoRA is not supported"),
                       ("modules_to_save", "fully trained extra modules are not supported"),
                       ("rank_pattern", "per-module ranks are not supported"),
                       ("alpha_pattern", "per-module alphas are not supported"),
                       ("trainable_token_indices", "trainable tokens are not supported"),
                       ("fan_in_fan_out", "Conv1D-style weights are not supported")):
        if cfg.get(field):
            raise _config_error(path, field, cfg[field], why)
    if cfg.get("bias", "none") != "none":
        raise _config_error(path, "bias", cfg["bias"], "LoRA bias training is not supported")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise _config_error(path, "r", r, "must be a positive int")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _config_error(path, "lora_alpha", alpha, "must be a number")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    targets = _targets_of(cfg, path)
    invocation = cfg.get("alora_invocation_tokens")
    if invocation is not None:
        if (not isinstance(invocation, list) or not invocation
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < model_cfg.vocab_size
                           for t in invocation)):
            raise _config_error(path, "alora_invocation_tokens", invocation,
                                f"must be a non-empty list of token ids below {model_cfg.vocab_size}")
        invocation = tuple(invocation)

    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(weights_file):
        pickled = [f for f in ("adapter_model.bin", "adapter_model.pt") if os.path.exists(os.path.join(path, f))]
        why = (f"{pickled[0]} is a pickle and pickles are never loaded; save with safetensors"
               if pickled else "adapter_model.safetensors is missing")
        raise ValueError(f"adapter {name!r}: {path}: {why}")
    try:
        # "flax" rather than "numpy": numpy has no bfloat16, which PEFT writes for bf16 models.
        with safe_open(weights_file, framework="flax") as f:
            tensors = {k: np.asarray(f.get_tensor(k).astype("float32")) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"adapter {name!r}: {weights_file} is not a readable safetensors file: {e}") from None
    return adapter_from_tensors(name, tensors, r, scaling, targets, model_cfg, source=path,
                                invocation_tokens=invocation)


def adapter_from_tensors(name, tensors: dict[str, np.ndarray], r: int, scaling: float,
                         targets: set[str], model_cfg: ModelConfig, source="<memory>",
                         invocation_tokens: tuple[int, ...] | None = None) -> LoraAdapter:
    shapes = model_cfg.projection_shapes()
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"adapter {name!r}: tensor {key} is not a supported LoRA weight "
                             "(only lora_A/lora_B of decoder projections)")
        layer, block, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in TARGETS or BLOCK[module] != block:
            raise ValueError(f"adapter {name!r}: tensor {key}: module {block}.{module} is not supported")
        if module not in targets:
            raise ValueError(f"adapter {name!r}: tensor {key} targets {module}, which "
                             f"target_modules={sorted(targets)} does not list")
        if layer >= model_cfg.num_layers:
            raise ValueError(f"adapter {name!r}: tensor {key}: layer {layer} does not exist in a "
                             f"{model_cfg.num_layers}-layer base model")
        d_in, d_out = shapes[module]
        want = (r, d_in) if ab == "A" else (d_out, r)
        if tuple(t.shape) != want:
            raise ValueError(f"adapter {name!r}: tensor {key} has shape {tuple(t.shape)}, expected "
                             f"{want} for r={r} on this base model (an adapter for another model?)")
        parts.setdefault((layer, module), {})[ab] = np.asarray(t, np.float32)
    weights = {}
    for key, p in sorted(parts.items()):
        if set(p) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {key[0]} {key[1]} has lora_{set(p).pop()} only")
        weights[key] = (np.ascontiguousarray(p["A"].T), np.ascontiguousarray(p["B"].T) * np.float32(scaling))
    if not weights:
        raise ValueError(f"adapter {name!r}: no LoRA weights found")
    return LoraAdapter(name=name, rank=r, scaling=float(scaling), weights=weights, source=source,
                       invocation_tokens=invocation_tokens)


def save_peft_adapter(adapter: LoraAdapter, path: str) -> str:
    """Write `adapter` as the PEFT LoRA directory `path` that `load_peft_adapter` reads back
    (float32 safetensors, `lora_alpha` = scaling · rank, B without the scaling). The weights come
    back bitwise when the scaling is a power of two (alpha = 2 · rank, as the benchmark agents'),
    else to a float32 rounding. -> `path`."""
    if not adapter.scaling:
        raise ValueError(f"adapter {adapter.name!r}: scaling 0 has no PEFT lora_alpha to unfold B by")
    scaling = np.float32(adapter.scaling)
    tensors = {}
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        key = f"base_model.model.model.layers.{layer}.{BLOCK[module]}.{module}"
        tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(a.T, np.float32)
        tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray((b / scaling).T, np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    alpha = adapter.scaling * adapter.rank
    config = {"peft_type": "LORA", "r": adapter.rank, "lora_alpha": int(alpha) if alpha == int(alpha) else alpha,
              "target_modules": sorted(adapter.targets), "bias": "none"}
    if adapter.invocation_tokens is not None:
        config["alora_invocation_tokens"] = list(adapter.invocation_tokens)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path
