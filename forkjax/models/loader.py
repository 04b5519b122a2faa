"""HF safetensors checkpoints -> `CausalLM`, with a strict name mapping.

Every checkpoint tensor must be used and every model parameter set, or loading fails naming them:
a silently half-loaded model is the worst outcome for parity. Parameters keep HF's `[out, in]`
layout, so loading is a name lookup plus a dtype cast over memory-mapped files (and the row
concatenation of the projections the model stores stacked). There is no
converted form, hence no conversion cache: a second load costs what the first did, the time to
read the file (BENCHMARKS.md, "Checkpoint loading"). LoRA slots start at zero; `forkjax.lora` fills them.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm.auto import tqdm

from forkjax.config import ModelConfig
from forkjax.lora.targets import STACKED, TARGETS
from forkjax.models.transformer import CausalLM
from forkjax.rope import rope_inv_freq
from forkjax.tensor_parallel import (global_shape, local_config, make_mesh, pad_vocab, place,
                                     sharding, spec_of, stacked_layout)

# get(hf_name, shape, dtype) -> array for one base-model parameter.
ParamSource = Callable[[str, tuple, jnp.dtype], jax.Array]


def hf_name(path: tuple) -> str:
    """NNX state path -> HF parameter name (`('layers', 0, 'mlp', ...)` -> `model.layers.0.mlp...`)."""
    name = ".".join(str(p) for p in path)
    if path[0] == "lm_head":
        return "lm_head.weight"
    if path[0] == "embed_tokens":
        return "model.embed_tokens.weight"
    return "model." + name


def _projection(cfg: ModelConfig, get: ParamSource, path: tuple, spec, tp: int) -> jax.Array:
    """A (stacked) projection's weight or bias from its HF parts, the LoRA A rows after them
    (`LoRALinear`) at zero; `spec`: one tensor-parallel shard's, the result global
    (tensor_parallel.stacked_layout)."""
    shapes = cfg.projection_shapes()
    parts = []
    for part in STACKED.get(path[-2], (path[-2],)):
        d_in, d_out = shapes[part]
        shape = (d_out, d_in) if path[-1] == "weight" else (d_out,)
        parts.append(get(hf_name(path[:-2] + (part, path[-1])), shape, spec.dtype))
    column = path[-2] in STACKED  # the stacked projections are the column-parallel ones
    rows = sum(p.shape[0] for p in parts) // (tp if column else 1)  # one shard's base rows
    return stacked_layout(parts, spec.shape[0] - rows, tp, column)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stack, i, value):
    """stack [L, ...] with row `i` replaced by value [...] (donated: in place)."""
    return jax.lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), i, 0)


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """HF tensor name -> shape of every tensor a checkpoint of `cfg` holds (the inverse of the
    mapping `build_model` applies)."""
    shapes = {}

    def note(name, shape, dtype):
        shapes[name] = tuple(shape)
        return jnp.zeros(shape, dtype)

    jax.eval_shape(lambda: nnx.state(build_model(cfg, note, num_slots=1, rank=1,
                                                  dtype=jnp.bfloat16)))
    return shapes


def build_model(cfg: ModelConfig, get: ParamSource, *, num_slots: int, rank: int, dtype,
                progress: bool = False, lora_targets=TARGETS, lora_path: str = "fused",
                tp: int = 1) -> CausalLM:
    """Create a `CausalLM` whose base parameters come from `get`; nothing is allocated twice.
    `tp` > 1: each parameter in its tensor-parallel layout, placed on the mesh
    (tensor_parallel.py)."""
    local_config(cfg, tp)  # ValueErrors before any weight is made: heads that do not split,
    make_mesh(tp)  # and too few devices
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, num_slots=num_slots, rank=rank, dtype=dtype,
                                               lora_targets=lora_targets, lora_path=lora_path, tp=tp))
    graphdef, state = nnx.split(abstract)

    def param(path, spec):  # a parameter's (global) value; path: HF's, the layer's index in it
        if path == ("inv_freq",):
            return jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        if path[-1] in ("weight", "bias") and path[-2].endswith("_proj"):
            return _projection(cfg, get, path, spec, tp)
        if path[0] in ("embed_tokens", "lm_head"):
            return pad_vocab(get(hf_name(path), (cfg.vocab_size, cfg.hidden_size), spec.dtype),
                             spec.shape[0] * tp)
        return get(hf_name(path), spec.shape, spec.dtype)

    flat = []
    for path, var in tqdm(list(nnx.to_flat_state(state)), desc="loading weights",
                          disable=not progress, unit="tensor"):
        spec = var.get_value()  # one shard's shape
        name = ".".join(str(p) for p in path)
        if path[0] != "layers":
            value = param(path, spec)
        else:  # the stacked layers: LoRA slots empty, the rest layer by layer by HF name, in place
            value = jnp.zeros(global_shape(spec.shape, spec_of(name), tp), spec.dtype,
                              device=sharding(tp, spec_of(name)))
            if "lora_a" not in path and "lora_b" not in path:
                layer = jax.ShapeDtypeStruct(spec.shape[1:], spec.dtype)
                for i in range(spec.shape[0]):
                    value = _set_layer(value, i, param(("layers", i, *path[1:]), layer))
        flat.append((path, var.replace(place(value, name, tp))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def checkpoint_files(model_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file, from the shard index or the files themselves."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        pickled = glob.glob(os.path.join(model_dir, "*.bin")) + glob.glob(os.path.join(model_dir, "*.pt"))
        hint = " (pickled .bin/.pt weights are refused: convert them to safetensors)" if pickled else ""
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights{hint}")
    names = {}
    for file in files:
        with safe_open(file, framework="flax") as f:
            names.update({k: file for k in f.keys()})
    return names


def load_checkpoint(model_dir: str, *, num_slots: int, rank: int, dtype,
                    progress: bool = True, lora_targets=TARGETS,
                    lora_path: str = "fused", tp: int = 1) -> tuple[ModelConfig, CausalLM]:
    """Load `model_dir` (config.json + safetensors, single or sharded) strictly."""
    cfg = ModelConfig.from_hf(model_dir)
    where = checkpoint_files(model_dir)
    handles: dict[str, object] = {}

    def read(name):
        file = where[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="flax")
        return handles[file].get_tensor(name)

    return cfg, load_strict(model_dir, cfg, set(where), read, num_slots=num_slots, rank=rank,
                            dtype=dtype, progress=progress, lora_targets=lora_targets,
                            lora_path=lora_path, tp=tp)


def load_strict(source: str, cfg: ModelConfig, names: set[str], read: Callable[[str], object], *,
                num_slots: int, rank: int, dtype, progress: bool = True,
                lora_targets=TARGETS, lora_path: str = "fused", tp: int = 1) -> CausalLM:
    """Build the model from the tensors `names` of a checkpoint (HF names; `read(name)` -> an
    array in HF's layout): every one must be used with the shape `cfg` implies, and every
    parameter set, or loading fails naming them (`source`: the file or directory, for errors)."""
    used: set[str] = set()

    def get(name, shape, dt):
        if name not in names:
            raise KeyError(name)
        t = read(name)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{source}: tensor {name} has shape {tuple(t.shape)}, "
                             f"the config implies {tuple(shape)}")
        used.add(name)
        return jnp.asarray(t, dt)

    missing: list[str] = []

    def get_or_note(name, shape, dt):
        try:
            return get(name, shape, dt)
        except KeyError:
            missing.append(name)
            return jnp.zeros(shape, dt)

    model = build_model(cfg, get_or_note, num_slots=num_slots, rank=rank, dtype=dtype,
                        lora_targets=lora_targets, progress=progress, lora_path=lora_path, tp=tp)
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {len(missing)} parameter(s): "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    unused = sorted(names - used)
    if cfg.tie_word_embeddings and "lm_head.weight" in unused:
        # Some exports write the tied head anyway; it must then equal the embedding.
        if not np.array_equal(np.asarray(read("lm_head.weight"), np.float32),
                              np.asarray(read("model.embed_tokens.weight"), np.float32)):
            raise ValueError(f"{source}: tie_word_embeddings=true but lm_head.weight differs "
                             "from model.embed_tokens.weight")
        unused.remove("lm_head.weight")
    if unused:
        raise ValueError(f"{source}: checkpoint has {len(unused)} tensor(s) the model does not "
                         f"use: {', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}")
    return model
