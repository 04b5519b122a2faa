"""Strict checkpoint loading and config validation."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from forkjax.config import EngineConfig, ModelConfig
from forkjax.models.loader import load_checkpoint


def _single_file_copy(src_dir, dst_dir, edit):
    """Copy a (possibly sharded) checkpoint into one model.safetensors, edited by `edit(tensors)`."""
    os.makedirs(dst_dir)
    shutil.copy(os.path.join(src_dir, "config.json"), dst_dir)
    tensors = {}
    for f in os.listdir(src_dir):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src_dir, f)))
    edit(tensors)
    save_file(tensors, os.path.join(dst_dir, "model.safetensors"))
    return dst_dir


def test_sharded_and_single_file_load_identically(hf_suite, tmp_path):
    base = hf_suite["llama"][0]
    assert os.path.exists(os.path.join(base, "model.safetensors.index.json"))
    single = _single_file_copy(base, tmp_path / "single", lambda t: None)
    _, m1 = load_checkpoint(base, num_slots=2, rank=4, dtype=jnp.float32, progress=False)
    _, m2 = load_checkpoint(str(single), num_slots=2, rank=4, dtype=jnp.float32, progress=False)
    np.testing.assert_array_equal(m1.layers.mlp.down_proj.weight[1], m2.layers.mlp.down_proj.weight[1])


def test_unused_tensor_is_refused_by_name(hf_suite, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.rotary_extra"] = np.zeros(3, np.float32)
    d = _single_file_copy(hf_suite["llama"][0], tmp_path / "extra", edit)
    with pytest.raises(ValueError, match="rotary_extra"):
        load_checkpoint(str(d), num_slots=2, rank=4, dtype=jnp.float32, progress=False)


def test_missing_tensor_is_refused_by_name(hf_suite, tmp_path):
    d = _single_file_copy(hf_suite["llama"][0], tmp_path / "missing",
                          lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 parameter.*layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(str(d), num_slots=2, rank=4, dtype=jnp.float32, progress=False)


def test_wrong_shape_is_refused(hf_suite, tmp_path):
    def edit(t):
        t["model.norm.weight"] = np.ones(7, np.float32)
    d = _single_file_copy(hf_suite["llama"][0], tmp_path / "shape", edit)
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(7,\)"):
        load_checkpoint(str(d), num_slots=2, rank=4, dtype=jnp.float32, progress=False)


def test_tied_head_written_anyway_must_equal_embedding(hf_suite, tmp_path):
    base = hf_suite["qwen2"][0]  # tied
    ok = _single_file_copy(base, tmp_path / "ok", lambda t: t.__setitem__(
        "lm_head.weight", t["model.embed_tokens.weight"].copy()))
    load_checkpoint(str(ok), num_slots=2, rank=4, dtype=jnp.float32, progress=False)
    bad = _single_file_copy(base, tmp_path / "bad", lambda t: t.__setitem__(
        "lm_head.weight", t["model.embed_tokens.weight"] + 1))
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_checkpoint(str(bad), num_slots=2, rank=4, dtype=jnp.float32, progress=False)


def test_pickled_weights_are_refused(tmp_path, hf_suite):
    shutil.copy(os.path.join(hf_suite["qwen2"][0], "config.json"), tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="pickled"):
        load_checkpoint(str(tmp_path), num_slots=2, rank=4, dtype=jnp.float32, progress=False)


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "mistral", "model_type"),
    ("hidden_act", "gelu", "hidden_act"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}, "yarn"),
])
def test_unsupported_config_is_refused(hf_suite, field, value, match):
    with open(os.path.join(hf_suite["qwen2"][0], "config.json")) as f:
        cfg = json.load(f)
    cfg[field] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(cfg)


def test_config_reads_legacy_and_v5_rope_fields():
    legacy = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8,
                  num_hidden_layers=1, num_attention_heads=2, rope_theta=5e5,
                  rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    c = ModelConfig.from_hf(legacy)
    assert c.rope_theta == 5e5 and c.rope_scaling["factor"] == 8.0 and c.num_kv_heads == 2
    assert c.head_dim == 4 and not c.attention_bias


@pytest.mark.parametrize("kwargs,match", [
    (dict(cache_policy="lru"), "cache_policy"), (dict(dtype="float16"), "dtype"),
    (dict(page_size=0), "page_size"), (dict(kv_cache_bytes=-5), "kv_cache_bytes"),
])
def test_engine_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)
