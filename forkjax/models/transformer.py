"""Llama and Qwen2 decoder-only models (Flax NNX) with stacked multi-LoRA projections.

One module serves both families: Qwen2 is Llama with q/k/v biases (and usually tied embeddings).
Attribute names follow HF's parameter names (`layers.3.self_attn.o_proj.weight`), except that
projections reading the same input are stored stacked as vLLM does (`qkv_proj` = q|k|v,
`gate_up_proj` = gate|up: one GEMM each, see `forkjax.lora.layers.LoRALinear` and
`forkjax.lora.targets.STACKED`); the loader maps a checkpoint by name.

The decoder layers are one `DecoderLayer` whose parameters carry a leading layer axis (MaxText's
scanned layers): the forward runs them under `jax.lax.scan`, so a program holds one layer body
whatever the depth, and a step passes a few dozen arrays, not a few per layer. The layer index
reaches attention as an int32 scalar (the KV pools carry the same leading axis).

The forward works on a flat batch of T tokens ordered by adapter slot (see `forkjax.lora.batched`)
and delegates attention to `attn_fn`, which receives the q|k|v projection (`QKV`) and builds q
and the (base, residual) K and V pairs from it: the engine's paged attention
(runtime/paged_attention.py).
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
from forkjax.tensor_parallel import TP_AXIS, local_config


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardBatch:
    positions: jax.Array    # [T] int32 position of every token in its sequence
    slots: jax.Array        # [T] int32 each token's adapter slot (N: none; lora.batched.token_slots)
    attn: Any = None        # attention backend metadata (a pytree)


# attn_fn(layer: int32 scalar, qkv: QKV (models/attention.py), batch, kv_state) ->
# (out [T, Hq, D], kv_state)
AttnFn = Callable[..., tuple[jax.Array, Any]]


def stacked(make: Callable[[], nnx.Module], n: int) -> nnx.Module:
    """`make()`'s module with every array given a leading axis of `n` (its initial value
    repeated): the parameters of `n` layers as one module."""
    graphdef, state = nnx.split(make())
    return nnx.merge(graphdef, jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), state))


class Attention(nnx.Module):
    """`cfg`: one tensor-parallel shard's (its heads); `reduce`: the mesh axis o_proj's partial
    sums are all-reduced over (row-parallel), None without tensor parallelism."""

    def __init__(self, cfg: ModelConfig, targets=TARGETS, reduce=None, **lora):
        d, kv = cfg.hidden_size, cfg.kv_size
        self.qkv_proj = LoRALinear(d, {"q_proj": cfg.q_size, "k_proj": kv, "v_proj": kv},
                                   bias=cfg.attention_bias, lora=targets, **lora)
        self.o_proj = LoRALinear(cfg.q_size, {"o_proj": d}, bias=False, lora=targets,
                                 reduce=reduce, **lora)
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def __call__(self, layer, x, rope, batch: ForwardBatch, attn_fn: AttnFn, state):
        qkv = QKV(self.qkv_proj.project(x, batch.slots), self.qkv_proj, self.heads, rope,
                  batch.slots, x)
        out, state = attn_fn(layer, qkv, batch, state)
        return self.o_proj.merged(out.reshape(x.shape[0], -1), batch.slots)[0], state


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, targets=TARGETS, reduce=None, **lora):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = LoRALinear(d, {"gate_proj": f, "up_proj": f}, bias=False,
                                       lora=targets, **lora)
        self.down_proj = LoRALinear(f, {"down_proj": d}, bias=False, lora=targets,
                                    reduce=reduce, **lora)

    def __call__(self, x, slots):
        gate, up = self.gate_up_proj.merged(x, slots)
        return self.down_proj.merged(jax.nn.silu(gate) * up, slots)[0]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, reduce=None, **lora):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype=dtype, reduce=reduce, **lora)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype=dtype, reduce=reduce, **lora)

    def __call__(self, layer, x, rope, batch, attn_fn, state):
        h, state = self.self_attn(layer, self.input_layernorm(x), rope, batch, attn_fn, state)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), batch.slots), state


class CausalLM(nnx.Module):
    """HF `LlamaForCausalLM` / `Qwen2ForCausalLM` with N LoRA slots of rank R on the projections
    named in `lora_targets` (k_proj and v_proj always), run on `lora_path` (lora/layers.py).

    `tp` > 1: the modules are one tensor-parallel shard's (tensor_parallel.py: its heads,
    intermediate and vocabulary rows), run under `shard_map` over the mesh axis TP_AXIS; the
    parameters hold the global arrays of that layout."""

    def __init__(self, cfg: ModelConfig, *, num_slots: int, rank: int, dtype=jnp.float32,
                 lora_targets=TARGETS, lora_path: str = "fused", tp: int = 1):
        self.dtype = dtype
        self.tp, self.vocab_size = tp, cfg.vocab_size
        reduce = TP_AXIS if tp > 1 else None
        cfg = local_config(cfg, tp)
        # float32 means "exact": no TF32 on the GPU.
        precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
        self.precision = precision
        lora = dict(num_slots=num_slots, rank=rank, precision=precision,
                    targets=tuple(lora_targets) + ALWAYS_LORA, lora_path=lora_path)
        self.embed_tokens = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        self.num_layers = cfg.num_layers
        self.layers = stacked(lambda: DecoderLayer(cfg, dtype, reduce=reduce, **lora), cfg.num_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype)))
        self.inv_freq = nnx.Variable(jnp.asarray(
            rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)))

    def __call__(self, tokens, batch: ForwardBatch, attn_fn: AttnFn, kv_state=None,
                 output_hidden_states: bool = False):
        """tokens [T] int32 -> (final normed hidden [T, d], kv_state, every layer's input
        [L, T, d] with `output_hidden_states`, else None).

        `kv_state` (the paged pools, or None) is threaded through `attn_fn` layer after layer as
        the scan's carry, so the caller can donate it at the jit boundary and every write stays
        in place.
        """
        x = self.embed(tokens)
        rope = rope_cos_sin(batch.positions, self.inv_freq[...], self.dtype, exact=False, full=True)
        layer_def, layer_params = nnx.split(self.layers)

        def body(carry, xs):
            x, kv_state = carry
            i, params = xs
            out, kv_state = nnx.merge(layer_def, params)(i, x, rope, batch, attn_fn, kv_state)
            return (out, kv_state), x if output_hidden_states else None

        layers = (jnp.arange(self.num_layers, dtype=jnp.int32), layer_params)
        (x, kv_state), inputs = jax.lax.scan(body, (x, kv_state), layers)
        return self.norm(x), kv_state, inputs

    def embed(self, tokens):
        """tokens [T] int32 -> [T, d]. Under tensor parallelism each shard looks up the tokens
        in its vocabulary rows (zeros for the others) and the shards' rows are summed."""
        table = self.embed_tokens[...]
        if self.tp == 1:
            return table[tokens]
        rows = table.shape[0]
        local = tokens - jax.lax.axis_index(TP_AXIS) * rows
        mine = (local >= 0) & (local < rows)
        return jax.lax.psum(jnp.where(mine[:, None], table[jnp.clip(local, 0, rows - 1)], 0), TP_AXIS)

    def logits(self, h):
        """h [T, d] -> [T, vocab] float32 (under tensor parallelism every shard's vocabulary
        rows gathered, the padding cut)."""
        w = self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]
        y = linear(h, w, self.precision).astype(jnp.float32)
        if self.tp == 1:
            return y
        return jax.lax.all_gather(y, TP_AXIS, axis=1, tiled=True)[:, :self.vocab_size]
