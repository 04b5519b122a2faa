"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

The step computes greedy tokens itself; `sample` runs as a second small program only for batches
with a temperature > 0 (the host knows). A `lax.cond` on the temperatures inside the step made
XLA copy the predicate to the host and wait for the device in the middle of every step, so the
next step could never be dispatched ahead (overlap scheduling).

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
