"""PEFT adapter loading: what is supported loads exactly, everything else is refused by field."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from forkjax.config import ModelConfig
from forkjax.lora.peft import load_peft_adapter, save_peft_adapter


def _copy(src, dst, cfg_edit=None, tensor_edit=None):
    shutil.copytree(src, dst)
    if cfg_edit:
        p = os.path.join(dst, "adapter_config.json")
        with open(p) as f:
            cfg = json.load(f)
        cfg_edit(cfg)
        with open(p, "w") as f:
            json.dump(cfg, f)
    if tensor_edit:
        p = os.path.join(dst, "adapter_model.safetensors")
        t = load_file(p)
        tensor_edit(t)
        save_file(t, p)
    return str(dst)


@pytest.fixture
def llama(hf_suite):
    base, adapters = hf_suite["llama"]
    return ModelConfig.from_hf(base), adapters


def test_scaling_folded_into_b(llama):
    cfg, adapters = llama
    plain = load_peft_adapter("a", adapters["qkvo8"], cfg)
    assert plain.rank == 8 and plain.scaling == 16 / 8
    assert plain.targets == {"q_proj", "k_proj", "v_proj", "o_proj"}
    rs = load_peft_adapter("b", adapters["all4rs"], cfg)
    assert rs.scaling == pytest.approx(4 / np.sqrt(4)) and len(rs.targets) == 7
    raw = load_file(os.path.join(adapters["qkvo8"], "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"]
    np.testing.assert_allclose(plain.weights[(1, "k_proj")][1], b.T * 2.0, rtol=1e-6)


def test_content_hash_tracks_weights_not_name(llama, tmp_path):
    cfg, adapters = llama
    a = load_peft_adapter("x", adapters["qkvo8"], cfg)
    assert load_peft_adapter("y", adapters["qkvo8"], cfg).content_hash == a.content_hash
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    changed = _copy(adapters["qkvo8"], tmp_path / "c", tensor_edit=lambda t: t.__setitem__(key, t[key] * 1.001))
    assert load_peft_adapter("x", changed, cfg).content_hash != a.content_hash


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.__setitem__("use_dora", True), "use_dora"),
    (lambda c: c.__setitem__("modules_to_save", ["lm_head"]), "modules_to_save"),
    (lambda c: c.__setitem__("target_modules", ["embed_tokens", "q_proj"]), "embed_tokens"),
    (lambda c: c.__setitem__("peft_type", "IA3"), "peft_type"),
    (lambda c: c.__setitem__("r", 0), "field r="),
    (lambda c: c.__setitem__("bias", "all"), "bias"),
    (lambda c: c.__setitem__("rank_pattern", {"q_proj": 4}), "rank_pattern"),
    (lambda c: c.__setitem__("alora_invocation_tokens", []), "alora_invocation_tokens"),
    (lambda c: c.__setitem__("alora_invocation_tokens", [5, 10**6]), "alora_invocation_tokens"),
    (lambda c: c.__setitem__("alora_invocation_tokens", "5"), "alora_invocation_tokens"),
])
def test_unsupported_config_fields_are_refused(llama, tmp_path, edit, match):
    cfg, adapters = llama
    d = _copy(adapters["qkvo8"], tmp_path / "a", cfg_edit=edit)
    with pytest.raises(ValueError, match=match):
        load_peft_adapter("a", d, cfg)


def test_embedding_lora_tensor_is_refused(llama, tmp_path):
    cfg, adapters = llama
    d = _copy(adapters["qkvo8"], tmp_path / "a", tensor_edit=lambda t: t.__setitem__(
        "base_model.model.model.embed_tokens.lora_embedding_A", np.zeros((8, 203), np.float32)))
    with pytest.raises(ValueError, match="lora_embedding_A"):
        load_peft_adapter("a", d, cfg)


def test_pickled_weights_are_refused(llama, tmp_path):
    cfg, adapters = llama
    d = _copy(adapters["qkvo8"], tmp_path / "a")
    os.rename(os.path.join(d, "adapter_model.safetensors"), os.path.join(d, "adapter_model.bin"))
    with pytest.raises(ValueError, match="pickle"):
        load_peft_adapter("a", d, cfg)


def test_adapter_for_another_base_is_refused(hf_suite):
    qwen_cfg = ModelConfig.from_hf(hf_suite["qwen2"][0])
    with pytest.raises(ValueError, match="another model"):
        load_peft_adapter("a", hf_suite["llama"][1]["qkvo8"], qwen_cfg)


def test_missing_corrupt_and_malformed_dirs(llama, tmp_path):
    cfg, adapters = llama
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_peft_adapter("a", str(tmp_path / "nope"), cfg)
    corrupt = _copy(adapters["qkvo8"], tmp_path / "corrupt")
    with open(os.path.join(corrupt, "adapter_model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors"):
        load_peft_adapter("a", corrupt, cfg)
    bad_json = _copy(adapters["qkvo8"], tmp_path / "json")
    with open(os.path.join(bad_json, "adapter_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_peft_adapter("a", bad_json, cfg)


def test_saved_adapters_load_back(tmp_path):
    """save_peft_adapter writes what load_peft_adapter reads: the benchmark agents (alpha = 2 ·
    rank, a power-of-two scaling; lrshared's share one A) bitwise, another scaling to a rounding."""
    from forkjax.models.builtin import BUILTIN_CONFIGS, random_adapter
    from forkjax.workflows.agents import agent_adapters
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])
    agents = agent_adapters(cfg, ["planner", "coder"], 4, shared_a=True)
    for name, a in agents.items():
        back = load_peft_adapter(name, save_peft_adapter(a, str(tmp_path / name)), cfg)
        assert (back.rank, back.scaling, back.targets) == (a.rank, a.scaling, a.targets)
        assert back.weights.keys() == a.weights.keys() and back.content_hash == a.content_hash
        for k, (wa, wb) in a.weights.items():
            assert np.array_equal(back.weights[k][0], wa) and np.array_equal(back.weights[k][1], wb)
    odd = random_adapter("odd", cfg, 3, alpha=7, targets=("q_proj", "down_proj"), seed=1)
    back = load_peft_adapter("odd", save_peft_adapter(odd, str(tmp_path / "odd")), cfg)
    assert back.scaling == pytest.approx(7 / 3) and back.targets == {"q_proj", "down_proj"}
    for k, (wa, wb) in odd.weights.items():
        np.testing.assert_allclose(back.weights[k][1], wb, rtol=1e-6)
        assert np.array_equal(back.weights[k][0], wa)


def test_activated_lora_invocation_loads_and_saves(llama, tmp_path):
    cfg, adapters = llama
    d = _copy(adapters["qkvo8"], tmp_path / "a",
              cfg_edit=lambda c: c.__setitem__("alora_invocation_tokens", [5, 6, 7]))
    alora = load_peft_adapter("a", d, cfg)
    assert alora.invocation_tokens == (5, 6, 7)
    assert load_peft_adapter("p", adapters["qkvo8"], cfg).invocation_tokens is None
    back = load_peft_adapter("b", save_peft_adapter(alora, str(tmp_path / "b")), cfg)
    assert back.invocation_tokens == (5, 6, 7) and back.content_hash == alora.content_hash
