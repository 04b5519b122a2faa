"""The projections LoRA may target, by their HF names, and where the model stores them.

One table for PEFT loading (lora/peft.py), the slot writer (lora/slots.py), the model
(models/transformer.py), the checkpoint loader (models/loader.py) and the engine's choice of
`lora_target_modules` (engine/loading.py).
"""

# Every decoder projection, in HF's order: what PEFT's "all-linear" means here.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The decoder-layer block that holds each projection (`layers.3.self_attn.q_proj`).
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
         "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Stacked projections (`LoRALinear` over several parts, vLLM's packed modules) -> the HF
# projections they hold, in row order; the others are stored alone under their own name.
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def holder_of(module: str) -> str:
    """The attribute of its block that stores HF projection `module` (`qkv_proj` for q_proj)."""
    return next((name for name, parts in STACKED.items() if module in parts), module)


# The cache stores xA of k and v as the residual: those two always carry LoRA slots.
ALWAYS_LORA = ("k_proj", "v_proj")
