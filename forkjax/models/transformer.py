"""Llama and Qwen2 decoder-only models (Flax NNX) with stacked multi-LoRA projections.

One module serves both families: Qwen2 is Llama with q/k/v biases (and usually tied embeddings).
Attribute names follow HF's parameter names (`layers.3.self_attn.o_proj.weight`), except that
projections reading the same input are stored stacked as vLLM does (`qkv_proj` = q|k|v,
`gate_up_proj` = gate|up: one GEMM each, see `forkjax.lora.layers.LoRALinear` and
`forkjax.lora.targets.STACKED`); the loader maps a checkpoint by name.

The forward works on a flat batch of T tokens ordered by adapter slot (see `forkjax.lora.batched`)
and delegates attention to `attn_fn`, which receives the q|k|v projection (`QKV`) and builds q
and the (base, residual) K and V pairs from it: the engine's paged attention
(engine/paged_attention.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from forkjax.config import ModelConfig
from forkjax.linear import linear
from forkjax.lora.layers import LoRALinear
from forkjax.lora.targets import ALWAYS_LORA, TARGETS
from forkjax.models.attention import QKV
from forkjax.models.layers import RMSNorm
from forkjax.rope import rope_cos_sin, rope_inv_freq


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardBatch:
    positions: jax.Array    # [T] int32 position of every token in its sequence
    group_sizes: jax.Array  # [N] int32 tokens per adapter slot (tokens are ordered by slot)
    attn: Any = None        # attention backend metadata (a pytree)


# attn_fn(layer, qkv: QKV (models/attention.py), batch, kv_state) -> (out [T, Hq, D], kv_state)
AttnFn = Callable[..., tuple[jax.Array, Any]]


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, targets=TARGETS, **lora):
        d, kv = cfg.hidden_size, cfg.kv_size
        self.qkv_proj = LoRALinear(d, {"q_proj": cfg.q_size, "k_proj": kv, "v_proj": kv},
                                   bias=cfg.attention_bias, lora=targets, **lora)
        self.o_proj = LoRALinear(cfg.q_size, {"o_proj": d}, bias=False, lora=targets, **lora)
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def __call__(self, layer, x, rope, batch: ForwardBatch, attn_fn: AttnFn, state):
        qkv = QKV(self.qkv_proj.project(x, batch.group_sizes), self.qkv_proj, self.heads, rope,
                  batch.group_sizes, x)
        out, state = attn_fn(layer, qkv, batch, state)
        return self.o_proj.merged(out.reshape(x.shape[0], -1), batch.group_sizes)[0], state


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, targets=TARGETS, **lora):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = LoRALinear(d, {"gate_proj": f, "up_proj": f}, bias=False,
                                       lora=targets, **lora)
        self.down_proj = LoRALinear(f, {"down_proj": d}, bias=False, lora=targets, **lora)

    def __call__(self, x, gs):
        gate, up = self.gate_up_proj.merged(x, gs)
        return self.down_proj.merged(jax.nn.silu(gate) * up, gs)[0]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, **lora):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype=dtype, **lora)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype=dtype, **lora)

    def __call__(self, layer, x, rope, batch, attn_fn, state):
        h, state = self.self_attn(layer, self.input_layernorm(x), rope, batch, attn_fn, state)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), batch.group_sizes), state


class CausalLM(nnx.Module):
    """HF `LlamaForCausalLM` / `Qwen2ForCausalLM` with N LoRA slots of rank R on the projections
    named in `lora_targets` (k_proj and v_proj always), run on `lora_path` (lora/layers.py)."""

    def __init__(self, cfg: ModelConfig, *, num_slots: int, rank: int, dtype=jnp.float32,
                 lora_targets=TARGETS, lora_path: str = "fused"):
        self.dtype = dtype
        # float32 means "exact": no TF32 on the GPU.
        precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
        self.precision = precision
        lora = dict(num_slots=num_slots, rank=rank, precision=precision,
                    targets=tuple(lora_targets) + ALWAYS_LORA, lora_path=lora_path)
        self.embed_tokens = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, dtype, **lora) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype)))
        self.inv_freq = nnx.Variable(jnp.asarray(
            rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)))

    def __call__(self, tokens, batch: ForwardBatch, attn_fn: AttnFn, kv_state=None,
                 output_hidden_states: bool = False):
        """tokens [T] int32 -> (final normed hidden [T, d], kv_state, per-layer hidden list).

        `kv_state` (the paged pools, or None) is threaded through `attn_fn` layer after layer, so
        the caller can donate it at the jit boundary and every write stays in place.
        """
        x = self.embed_tokens[...][tokens]
        rope = rope_cos_sin(batch.positions, self.inv_freq[...], self.dtype, exact=False, full=True)
        hidden = [x] if output_hidden_states else []
        for i, layer in enumerate(self.layers):
            x, kv_state = layer(i, x, rope, batch, attn_fn, kv_state)
            if output_hidden_states:
                hidden.append(x)
        return self.norm(x), kv_state, hidden

    def logits(self, h):
        """h [T, d] -> [T, vocab] float32."""
        w = self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]
        return linear(h, w, self.precision).astype(jnp.float32)
