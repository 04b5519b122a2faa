"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds; logits processing
(penalties, logit bias, min_tokens) and the logprobs of what was sampled.

The step computes greedy tokens itself; `sample` runs as a second small program only for batches
with a temperature > 0 (the host knows). A `lax.cond` on the temperatures inside the step made
XLA copy the predicate to the host and wait for the device in the middle of every step, so the
next step could never be dispatched ahead (overlap scheduling).

Requests with processed logits, logprobs or a grammar's token mask (constrained decoding) run a
third program instead (`process_and_sample`, step_program.py), only in steps that hold such a
request, so every other step runs as before; the mask comes after the other processing.
Its masks come after the step's finiteness check: a -inf it puts in a row is no fault of the
model's.

A request's random key is `fold_in(key(seed), n)` for its n-th generated token, so what it samples
does not depend on which other requests share its batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    temperature: jax.Array  # [B] float32, 0 = greedy
    top_p: jax.Array  # [B] float32 in (0, 1]
    top_k: jax.Array  # [B] int32, 0 = off
    seed: jax.Array  # [B] uint32
    step: jax.Array  # [B] int32 tokens generated so far by the request


def greedy(logits):
    """logits [B, V] float32 -> [B] int32 argmax."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample(logits, s: SamplingArrays):
    """logits [B, V] float32 -> [B] int32 token ids (rows with temperature 0: greedy)."""
    v = logits.shape[-1]
    z = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    order = jnp.argsort(-z, axis=-1)  # [B, V] descending
    zs = jnp.take_along_axis(z, order, axis=-1)
    probs = jax.nn.softmax(zs, axis=-1)
    rank = jnp.arange(v)[None, :]
    # Smallest prefix whose mass reaches top_p (the first token always stays), then top_k.
    keep = (jnp.cumsum(probs, axis=-1) - probs) < s.top_p[:, None]
    keep &= (s.top_k[:, None] == 0) | (rank < s.top_k[:, None])
    zs = jnp.where(keep, zs, -jnp.inf)
    keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(s.seed, s.step)
    pick = jax.vmap(jax.random.categorical)(keys, zs)  # index into the sorted order
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(s.temperature > 0, sampled, greedy(logits))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ProcessArrays:
    """Per row, what `process_logits` changes (sequence.SamplingParams says the order)."""
    presence: jax.Array  # [B] float32
    frequency: jax.Array  # [B] float32
    repetition: jax.Array  # [B] float32, 1 = off
    output_ids: jax.Array  # [B, H] int32 generated tokens the host knows, -1 padding
    pending_row: jax.Array  # [B] int32 row of the previous step's output holding one more, -1 none
    prompt_ids: jax.Array  # [B, P] int32 prompt tokens (rows with a repetition penalty), -1 padding
    bias_ids: jax.Array  # [B, K] int32, -1 padding
    bias: jax.Array  # [B, K] float32
    banned_ids: jax.Array  # [B, S] int32 stop tokens masked (fewer than min_tokens out), -1 padding


def _counts(ids, v: int, weights=1.0):
    """ids [B, L] int32 (-1 padding), weights [B, L] or a scalar -> [B, V] float32: per row, the
    weights of each token's occurrences summed (their count with the default)."""
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
    cols = jnp.where(ids >= 0, ids, v)  # padding lands out of bounds and is dropped
    return jnp.zeros((ids.shape[0], v), jnp.float32).at[rows, cols].add(weights, mode="drop")


def process_logits(logits, p: ProcessArrays, prev_tokens):
    """logits [B, V] float32 -> processed [B, V]; prev_tokens [M] int32: the previous step's
    sampled tokens (a row's newest token may still be only there: overlap scheduling)."""
    b, v = logits.shape
    pending = jnp.where(p.pending_row >= 0, prev_tokens[jnp.maximum(p.pending_row, 0)], -1)
    output = _counts(jnp.concatenate([p.output_ids, pending[:, None]], axis=1), v)
    z = logits + _counts(p.bias_ids, v, p.bias)
    banned = _counts(p.banned_ids, v) > 0
    masked = jnp.where(banned, -jnp.inf, z)
    # A row whose every token is banned keeps its logits: it still yields a token.
    z = jnp.where(jnp.isfinite(masked).any(-1, keepdims=True), masked, z)
    seen = (output + _counts(p.prompt_ids, v)) > 0
    r = p.repetition[:, None]
    z = jnp.where(seen, jnp.where(z > 0, z / r, z * r), z)
    return z - p.presence[:, None] * (output > 0) - p.frequency[:, None] * output


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one row's allowed-token bitmask."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits, masks):
    """logits [B, V] float32, masks [B, W] int32 (bit j of word w allows token 32 w + j; tokens
    past 32 W are refused) -> logits with the refused tokens at -inf. A row that would keep no
    finite logit keeps its logits (it still yields a token, which its matcher then refuses)."""
    v = logits.shape[-1]
    ids = jnp.arange(v)
    words = jnp.take(masks, jnp.minimum(ids // 32, masks.shape[1] - 1), axis=1)  # [B, V]
    allowed = ((words >> (ids % 32)) & 1).astype(bool) & (ids < 32 * masks.shape[1])
    masked = jnp.where(allowed, logits, -jnp.inf)
    return jnp.where(jnp.isfinite(masked).any(-1, keepdims=True), masked, logits)


def top_logprobs(logits, chosen, k: int):
    """logits [B, V] float32 (the model's), chosen [B] int32 -> (chosen's logprob [B], the k
    most likely ids [B, k] int32, their logprobs [B, k]) under log_softmax(logits)."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    top, ids = jax.lax.top_k(lp, k)
    return jnp.take_along_axis(lp, chosen[:, None], axis=-1)[:, 0], ids.astype(jnp.int32), top
