"""The programs a ModelRunner dispatches: the step (one forward of a bucketed batch, its pools
donated), copy-on-write page copies and sampling. Static arguments that are costly to hash go
in as `HashOnce`; the parameters as a flat list of leaves.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from forkjax.lora.batched import token_slots
from forkjax.models.transformer import ForwardBatch
from forkjax.runtime.input_batch import InputLayout
from forkjax.runtime.kv_pools import KV_SPECS, copy_pages
from forkjax.runtime.paged_attention import PagedState, paged_attention
from forkjax.runtime.sampler import (ProcessArrays, SamplingArrays, apply_token_bitmask, greedy,
                                     process_logits, sample, top_logprobs)
from forkjax.tensor_parallel import REPLICATED, shard


class HashOnce:
    """A static jit argument hashed once. jit hashes its static arguments on every call, and
    hashing a large model's nnx GraphDef takes milliseconds of host time a step (for the same
    reason the parameters go in as a flat list of leaves, not as an nnx State to flatten)."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, HashOnce) and self._hash == other._hash
                                 and self.value == other.value)


def _forward(graphdef: HashOnce, state_def: HashOnce, params, pools, packed,
             prev_tokens, *, tp: HashOnce | None, **static):
    """The step program: `_step_body`, or under tensor parallelism (`tp`: the size and the
    parameters' PartitionSpecs) that body run per shard (tensor_parallel.py), every output but
    the pools replicated."""
    body = functools.partial(_step_body, graphdef, state_def, **static)
    if tp is None:
        return body(params, pools, packed, prev_tokens)
    size, specs = tp.value
    return shard(body, size, in_specs=(list(specs), KV_SPECS, REPLICATED, REPLICATED),
                 out_specs=(REPLICATED, KV_SPECS))(params, pools, packed, prev_tokens)


def _step_body(graphdef: HashOnce, state_def: HashOnce, params, pools, packed,
               prev_tokens, *, layout: InputLayout, kind: str, all_logits: bool, hidden: bool,
               residual: bool, use_pallas: bool, alora: bool):
    """One forward of a bucketed batch; the pools are donated and come back updated.
    packed [layout.size] int32: the step's inputs (input_batch.InputLayout).
    prev_tokens [max_batch] int32: the previous step's sampled tokens, still on the device
    (overlap scheduling). Returns ((greedy tokens [max_batch] int32, the sampled rows' logits
    [B, vocab] float32, every row's logits [T, vocab] float32 or None, finite [B] bool,
    fan_finite [B, N] bool, hidden states [L + 1, T, d] float32 or None), pools).

    hidden: as HF's output_hidden_states, the embeddings, the output of every layer but the
    last, and the final normed hidden state.

    finite[i]: request i's rows of the last hidden state and its sampled logits are all finite.
    A NaN or inf anywhere upstream (a K, V or LoRA term of any layer) reaches the residual stream
    of its token or of a later one, so the host keeps a chunk out of the trees unless it holds.
    fan_finite[i, j]: every fan-out residual request i wrote for adapter slot j is finite (those
    never reach its own stream: slot j's A applied to its hidden states may overflow alone).

    alora: an Activated LoRA adapter may be in the batch (under a residual policy its rows
    fold their LoRA K/V into the base pool: paged_attention.py)."""
    model = nnx.merge(graphdef.value, jax.tree.unflatten(state_def.value, params))
    inputs = layout.unpack(packed)
    rows = inputs.prev_rows
    tokens = jnp.where(rows >= 0, prev_tokens[jnp.maximum(rows, 0)], inputs.tokens)
    slots = token_slots(inputs.group_sizes, inputs.positions, inputs.lora_starts)
    meta = inputs.meta
    if alora and residual:  # aLoRA rows keep merged K/V in the base pool (paged_attention.py)
        n, activated = inputs.group_sizes.shape[0], inputs.lora_starts >= 0  # [B]
        tokens_activated = jnp.repeat(activated, slots.shape[0] // activated.shape[0])
        meta = dataclasses.replace(meta, adapter_ids=jnp.where(activated, 0, meta.adapter_ids),
                                   fold=tokens_activated & (slots < n))
    batch = ForwardBatch(positions=inputs.positions, slots=slots, attn=meta)
    attn = functools.partial(paged_attention, kind=kind, residual=residual, use_pallas=use_pallas,
                             inv_freq=model.inv_freq[...])
    fan = inputs.meta.fan_adapters
    state = PagedState(pools, None if fan is None else jnp.ones(fan.shape, bool))
    h, (pools, fan_ok), layer_inputs = model(tokens, batch, attn, state, output_hidden_states=hidden)
    states = jnp.concatenate([layer_inputs, h[None]]).astype(jnp.float32) if hidden else None
    logits = model.logits(h) if all_logits else None
    # The sampled rows get their own [B, vocab] GEMM even when every row's logits are computed:
    # a request's sampled logits then never depend on a score request sharing its step.
    rows = model.logits(h[inputs.sample_rows])
    b = inputs.sample_rows.shape[0]
    valid = jnp.arange(h.shape[0] // b)[None, :] < inputs.meta.chunk_lengths[:, None]  # [B, c]
    finite = jnp.all(jnp.isfinite(h).all(-1).reshape(b, -1) | ~valid, axis=1)
    finite &= jnp.isfinite(rows).all(-1)
    n = inputs.group_sizes.shape[0]
    fan_finite = jnp.ones((b, n), bool)
    if fan_ok is not None:  # a target's rows that are not finite, per adapter slot
        fan_bad = ~fan_ok[..., None] & (
            inputs.meta.fan_adapters[..., None] == jnp.arange(n))  # [T, F, N]
        slot_ok = ~fan_bad.any(1).reshape(b, -1, n)  # [B, c, N]
        fan_finite = jnp.all(slot_ok | ~valid[..., None], axis=1)
    return (_pad_to(greedy(rows), prev_tokens.shape[0]), rows, logits, finite, fan_finite,
            states), pools


_JIT = dict(static_argnums=(0, 1), donate_argnums=3,
            static_argnames=("layout", "kind", "all_logits", "hidden", "residual", "use_pallas", "alora",
                             "tp"))
# XLA's dot merger concatenates the weights of GEMMs that share an input into one matrix to run
# one GEMM; the weights are jit arguments, so the concatenation would run on every step. Off.
# The GEMMs run on cuBLAS at every size: inside the scanned layers a weight is a dynamic slice
# of its stacked array, and XLA's Triton GEMM fusions over such slices took twice cuBLAS's step
# time at 16 rows (BENCHMARKS.md, Engine decode and prefill).
_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0, "xla_gpu_enable_triton_gemm": False}


def _fresh(fn, **jit):
    """`jax.jit` of a new function object wrapping `fn`. jax's trace, lowering and compile caches
    key a program on its function, weakly: a module-level function would keep every program it
    ever compiled (up to 2,048 of them) after the engines that ran them are gone (compiler.py)."""
    return jax.jit(functools.partial(fn), **jit)


def lower_step(*args, **static):
    """The Lowered step program (`_forward`) of `args` (arrays or jax.ShapeDtypeStruct) and its
    static arguments."""
    return _fresh(_forward, **_JIT, compiler_options=_OPTIONS).trace(*args, **static).lower()


def _pad_to(tokens, size: int):
    # A pad, not a scatter into zeros: at full size that scatter's index array is an empty
    # constant, on which the partitioner (Shardy) crashes under tensor parallelism.
    return jnp.pad(tokens.astype(jnp.int32), (0, size - tokens.shape[0]))


# Copy-on-write is its own small program, run before a step only when that step has copies:
# inside the step program every step would copy a batch of padding pages (sink to sink) in every
# layer. Under tensor parallelism each shard copies its heads' pages.
@functools.cache
def copy_pages_program(tp: int):
    fn = copy_pages if tp == 1 else shard(copy_pages, tp, in_specs=(KV_SPECS, *[REPLICATED] * 4),
                                          out_specs=KV_SPECS)
    return jax.jit(fn, donate_argnums=0)


def sample_padded(rows, sampling: SamplingArrays, size: int):
    """rows [B, vocab] float32 -> [size] int32 sampled tokens (row i: request i)."""
    return _pad_to(sample(rows, sampling), size)


def process_and_sample(rows, sampling: SamplingArrays, process: ProcessArrays | None, prev_tokens,
                        masks, size: int, sampled: bool, k: int):
    """rows [B, vocab] float32, prev_tokens [size] int32 (the previous step's samples), masks
    [B, ceil(vocab / 32)] int32 allowed-token bitmasks or None ->
    ([size] int32 tokens sampled from the processed logits (`process` None: as they are) under
    the masks, (logprobs [B], top ids [B, k], top logprobs [B, k]) of the model's logits, or
    None: k = 0). `sampled` False: every row is greedy, and the argmax replaces `sample`'s sort
    over the vocabulary (the costly part of this program)."""
    z = rows if process is None else process_logits(rows, process, prev_tokens)
    z = z if masks is None else apply_token_bitmask(z, masks)
    tokens = sample(z, sampling) if sampled else greedy(z)
    return _pad_to(tokens, size), top_logprobs(rows, tokens, k) if k else None


def lower_sampling(shape: tuple, args: tuple, size: int):
    """The Lowered sampling program of `shape` ("sample", B): sample_padded, or ("process", B,
    id list widths or None, masked, sampled, k): process_and_sample, over `args` (arrays, or
    their shapes: jax.ShapeDtypeStruct) padded to `size` tokens."""
    if shape[0] == "sample":
        return _fresh(sample_padded, static_argnums=2).trace(*args, size).lower()
    return _fresh(process_and_sample, static_argnums=(5, 6, 7)).trace(*args, size, *shape[-2:]).lower()
