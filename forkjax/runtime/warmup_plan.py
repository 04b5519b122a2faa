"""Every program a ModelRunner's warm-up compiles, in the order requests need them.

1. The plain steps (the sampled rows' logits only, the engine's own fan-out width) of every
   bucket, one request's shapes first, then larger batches: what a first request runs.
2. The sampling programs of every sampled batch size B (buckets.Buckets.sample_sizes): sampling
   at a temperature (`sample_padded`), logprobs alone, and logits processing (penalties, logit
   bias, min_tokens) with and without logprobs (`process_and_sample`) over id lists of the
   shortest padded width (input_batch.MIN_ID_LIST), and a grammar's token mask alone, greedy
   and sampled (constrained decoding; with other processing or logprobs it compiles when first
   needed).
3. Fan-out steps, where requests can fan out but the plain steps carry no fan-out inputs
   (`forkkv` without residual_fanout): a batch runs them when one of its requests writes
   residuals for other adapters (a workflow's shared prefix written for its agents).
4. Score steps (every row's logits: the server's echo and prompt_logprobs, Engine.score) of the
   extend buckets, with the engine's width and with fan-out, as a score request may share its
   prefill step with a request that fans out. A score request never decodes.

Left out, compiled when first used: steps returning hidden states (only
Engine.score(return_hidden_states=True) asks for them, no server endpoint does; they would double
the score steps), processing over id lists longer than MIN_ID_LIST (a penalised request's outputs
past it, a repetition penalty's long prompt: one program per power of two), and the host tier's
copies in the background (they run on the pools, which a serving step donates).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from forkjax.runtime.buckets import Buckets
from forkjax.runtime.input_batch import id_list_widths, processing_arrays, sampling_arrays
from forkjax.runtime.sampler import bitmask_width


def step_shapes(buckets: Buckets, width: int, fanout_width: int) -> tuple[list, list]:
    """(the plain steps, then the fan-out and score steps), each a list of (kind, B, C, W,
    all_logits, hidden, fan-out width) in order: `width` the plain steps' fan-out width,
    `fanout_width` that of a request that fans out (0: none can)."""
    plain = sorted(buckets.all(), key=lambda s: (s[3], s[1], s[2]))
    widths = [width] + ([fanout_width] if fanout_width and fanout_width != width else [])
    extend = [s for s in plain if s[0] == "extend"]
    return ([(*s, False, False, width) for s in plain],
            [(*s, False, False, f) for f in widths[1:] for s in plain]
            + [(*s, True, False, f) for f in widths for s in extend])


def sampling_programs(buckets: Buckets, vocab_size: int, prev_tokens: jax.Array, k: int) -> list[tuple]:
    """(shape, example arguments) of every sampling program to compile (step_program.lower_sampling
    takes both): `prev_tokens` the runner's, `k` the logprobs' alternatives."""
    prev = jax.ShapeDtypeStruct(prev_tokens.shape, prev_tokens.dtype, sharding=prev_tokens.sharding)
    out = []
    for b in buckets.sample_sizes():
        # the step's sampled rows' logits lie where its outputs do: with the previous tokens
        rows = jax.ShapeDtypeStruct((b, vocab_size), jnp.float32, sharding=prev_tokens.sharding)
        sampling, process = sampling_arrays([], b), processing_arrays([], b)
        lists = id_list_widths(process)
        masks = jax.ShapeDtypeStruct((b, bitmask_width(vocab_size)), jnp.int32, sharding=prev_tokens.sharding)
        out += [(("sample", b), (rows, sampling)),
                (("process", b, None, False, True, k), (rows, sampling, None, prev, None)),
                (("process", b, lists, False, True, 0), (rows, sampling, process, prev, None)),
                (("process", b, lists, False, True, k), (rows, sampling, process, prev, None)),
                (("process", b, None, True, False, 0), (rows, sampling, None, prev, masks)),
                (("process", b, None, True, True, 0), (rows, sampling, None, prev, masks))]
    return out
