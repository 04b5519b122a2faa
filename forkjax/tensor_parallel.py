"""Tensor parallelism: the Megatron layout of the model and the KV pools over a 1-D device mesh.

With `tensor_parallel_size` P > 1 every step runs under `jax.shard_map` over the mesh axis
`TP_AXIS` (runtime/step_program.py): each device runs the unchanged model code, Pallas kernels
included, on its own heads and intermediate rows, with one all-reduce after each row-parallel
projection. A module is built for one shard (`local_config`), its parameters hold the whole
(global) arrays laid out so that shard s's block is exactly the rows or columns that module
expects:

- q|k|v and gate|up (column-parallel, stacked): shard s's rows are its heads' q, k, v (its
  intermediate rows' gate, up) followed by every slot's LoRA A rows (the shrink runs on the
  replicated input, so every shard holds every A; S-LoRA's layout);
- o and down (row-parallel): shard s's input columns (its heads, its intermediate rows), the
  A rows included, so x·W and x·A are partial sums, all-reduced together ([T, d + L·N·R]);
- B of a column-parallel projection split by output columns, of a row-parallel one replicated;
- the embedding and the LM head split by vocabulary rows, padded to a multiple of P (vLLM's
  vocab padding): a token's row is looked up on its shard and all-reduced, the logits gathered
  and cut to the vocabulary, so the sampler sees whole logits;
- norms and RoPE replicated.

The base KV pools are split by KV head: each device keeps its heads' pages; the residual pools
(x·A, R values a token) are replicated: every shard computes the same x·A from the same input,
and ResidualAttention runs on each shard's heads with its share of B_k / B_v, no communication.
Page tables, trees and scheduling stay on the host, single.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from forkjax.config import ModelConfig

TP_AXIS = "tp"

# Parameter path (dotted, as nnx names it: `layers.self_attn.qkv_proj.lora_b.q_proj`) ->
# PartitionSpec of one layer's global array: the first rule whose pattern the path contains (a
# decoder layer's parameters carry a leading layer axis, not split: `spec_of`).
PARAM_RULES = (
    (r"^(embed_tokens|lm_head)$", P(TP_AXIS, None)),  # vocabulary rows
    (r"(qkv_proj|gate_up_proj)\.(weight|bias)$", P(TP_AXIS)),  # each shard's stacked rows
    (r"(o_proj|down_proj)\.weight$", P(None, TP_AXIS)),  # input columns
    (r"lora_b\.(q_proj|k_proj|v_proj|gate_proj|up_proj)$", P(None, None, TP_AXIS)),  # output columns
    (r"lora_a\.(o_proj|down_proj)$", P(None, None, TP_AXIS)),  # input columns
    (r"", P()),  # norms, RoPE, A of column-parallel and B of row-parallel projections
)


def spec_of(path: str) -> P:
    """The PartitionSpec of the parameter at dotted `path` (PARAM_RULES; under `layers.` the
    stacked layers' leading axis first)."""
    spec = next(spec for pattern, spec in PARAM_RULES if re.search(pattern, path))
    return P(None, *spec) if path.startswith("layers.") else spec


@functools.cache
def make_mesh(tp: int) -> Mesh:
    """The 1-D mesh over the first `tp` local devices."""
    devices = jax.local_devices()
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp}: only {len(devices)} local "
                         f"{devices[0].platform} device(s)")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """One shard's share of `cfg`: its query and KV heads, intermediate rows and vocabulary rows
    (ceil: the vocabulary is padded). ValueError where the heads do not divide evenly."""
    if tp == 1:
        return cfg
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r}: expected a positive int")
    if cfg.num_kv_heads % tp:
        why = ("fewer KV heads than shards: replicating them is not supported"
               if cfg.num_kv_heads < tp else "not divisible")
        raise ValueError(f"tensor_parallel_size={tp}: the model's {cfg.num_kv_heads} KV heads do "
                         f"not split over {tp} devices ({why}); use a size that divides them")
    if cfg.num_heads % tp or cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp}: {cfg.num_heads} attention heads and "
                         f"{cfg.intermediate_size} intermediate rows must both be divisible by it")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp,
                               vocab_size=-(-cfg.vocab_size // tp))


def global_shape(local: tuple, spec: P, tp: int) -> tuple:
    """A parameter's global shape from one shard's."""
    return tuple(n * tp if i < len(spec) and spec[i] == TP_AXIS else n for i, n in enumerate(local))


def stacked_layout(parts: list, extra_rows: int, tp: int, column: bool):
    """The global array of a projection from its HF parts (each [out, ...]) and `extra_rows`
    zero rows (the LoRA A's) per shard: column-parallel ones shard by shard, [part 0's rows of
    shard s, part 1's, ..., zeros] for s = 0 .. tp - 1; others (row-parallel and tp = 1) the
    parts then the zeros."""
    zeros = lambda: jnp.zeros((extra_rows,) + parts[0].shape[1:], parts[0].dtype)  # noqa: E731
    if not column or tp == 1:
        return jnp.concatenate([*parts, zeros()]) if extra_rows or len(parts) > 1 else parts[0]
    blocks = []
    for s in range(tp):
        blocks += [p[s * (p.shape[0] // tp):(s + 1) * (p.shape[0] // tp)] for p in parts]
        if extra_rows:
            blocks.append(zeros())
    return jnp.concatenate(blocks)


def pad_vocab(table, rows: int):
    """table [V, d] -> [rows, d], zero rows appended (the vocabulary padding)."""
    return table if table.shape[0] == rows else jnp.pad(table, ((0, rows - table.shape[0]), (0, 0)))


def place(value, path: str, tp: int):
    """Put a parameter's global array on the mesh with its PARAM_RULES spec (as it is for tp 1)."""
    return value if tp == 1 else jax.device_put(value, sharding(tp, spec_of(path)))


def param_specs(state) -> list[P]:
    """The PartitionSpecs of an nnx State's leaves, in `jax.tree.leaves` order."""
    paths, _ = jax.tree_util.tree_flatten_with_path(state)
    return [spec_of(".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)))
            for path, _ in paths]


REPLICATED = P()
# The KV pools (cache/pool.py): base [L, Hkv, P, S, D] split by KV head; residual replicated.
BASE_POOL_SPEC, RES_POOL_SPEC = P(None, TP_AXIS), REPLICATED


def sharding(tp: int, spec: P) -> NamedSharding | None:
    """Where an array of `spec` lies on the mesh of `tp` devices (None for tp 1: the default
    device)."""
    return None if tp == 1 else NamedSharding(make_mesh(tp), spec)


def shard(fn, tp: int, in_specs, out_specs):
    """`fn` run per shard over the mesh of `tp` devices (jax.shard_map). Outputs that every
    shard computes alike (whole logits, the replicated residuals, sampled tokens) come out with
    the replicated spec; the types do not prove it (the inputs differ by shard), so the check is
    off."""
    return jax.shard_map(fn, mesh=make_mesh(tp), in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
