"""Tiny random HF checkpoints and PEFT adapters, and the PyTorch reference outputs.

Everything is built here with transformers + PEFT (no files in git). Dimensions are awkward on
purpose: head_dim not a power of two, GQA ratios 3 and 4, vocab sizes not a multiple of 8.
Weights are re-randomised with std 1/sqrt(fan_in) (HF's default 0.02 makes logits nearly flat,
so greedy argmax comparisons would hinge on rounding).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

LLAMA_CFG = dict(vocab_size=203, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=24,  # GQA 3, D=24
                 rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 256},
                 bos_token_id=1, eos_token_id=2)
QWEN2_CFG = dict(vocab_size=157, hidden_size=160, intermediate_size=224, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2,  # GQA 4, D=20
                 rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=1000000.0,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)

# name -> (r, lora_alpha, use_rslora, target_modules)
LLAMA_ADAPTERS = {
    "qkvo8": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all4rs": (4, 4, True, "all-linear"),
    "v16": (16, 8, False, ["v_proj"]),
}
QWEN2_ADAPTERS = {
    "kv6": (6, 12, False, ["k_proj", "v_proj"]),
    "mlp8": (8, 8, True, ["gate_proj", "up_proj", "down_proj", "q_proj"]),
}


def _rerandomise(module: torch.nn.Module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def make_base(kind: str, out_dir: str, seed: int = 0, max_shard_size=None) -> str:
    import transformers
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**LLAMA_CFG), transformers.LlamaForCausalLM
    else:
        cfg, cls = transformers.Qwen2Config(**QWEN2_CFG), transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    _rerandomise(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def make_adapter(base_dir: str, out_dir: str, r, alpha, rslora, targets, seed: int, **config) -> str:
    """A PEFT LoRA directory of random weights (`config`: more LoraConfig fields, e.g.
    alora_invocation_tokens)."""
    import peft
    model = load_hf(base_dir, torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                          init_lora_weights=False, lora_dropout=0.0, **config)
    pm = peft.get_peft_model(model, cfg)
    torch.manual_seed(seed)
    _rerandomise_lora(pm, seed)
    pm.save_pretrained(out_dir)
    return out_dir


def _rerandomise_lora(pm, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            elif "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def load_hf(base_dir: str, dtype=torch.float64, adapter_dir: str | None = None):
    """The PyTorch reference: transformers model (+ PEFT adapter), eager attention, eval mode."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=dtype, attn_implementation="eager")
    if adapter_dir is not None:
        import peft
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def hf_hidden_states(model, ids) -> list[np.ndarray]:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return [h[0].double().numpy() for h in out.hidden_states]


def hf_greedy(model, ids, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def build_suite(root: str) -> dict:
    """Both bases (Llama sharded) with their adapters under `root`; returns the paths."""
    suite = {}
    for kind, adapters, shard in (("llama", LLAMA_ADAPTERS, "40KB"), ("qwen2", QWEN2_ADAPTERS, None)):
        base = make_base(kind, os.path.join(root, kind), seed=1, max_shard_size=shard)
        ads = {name: make_adapter(base, os.path.join(root, f"{kind}-{name}"), *spec, seed=10 + i)
               for i, (name, spec) in enumerate(adapters.items())}
        suite[kind] = (base, ads)
    return suite
