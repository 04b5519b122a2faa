"""ModelRunner: the one jit boundary. Parameters are split once; the KV pools are donated state.

Shapes are bucketed (buckets.py), a batch's inputs padded to its bucket (input_batch.py), so a
fixed set of programs serves every batch, compiled at start or in the background while serving
(compiler.py); page tables are as wide as the bucket of the batch's longest request. A program
compiled after warm-up logs a warning: a shape escaped the buckets.

Residual fan-out adds one input, the residual slots of every adapter slot for every token
(`PagedMeta.fan_slots`), written by the K/V write: an engine with `residual_fanout` runs (and
compiles) only programs with it; otherwise a batch runs them only when one of its requests fans
out.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from forkjax.cache import PoolLayout, copy_index_arrays, copy_pages
from forkjax.cache.pool import KV_SPECS
from forkjax.engine.buckets import Buckets
from forkjax.engine.compiler import COMPILER
from forkjax.engine.input_batch import (StepInputs, batch_shape, build_inputs, dummy_inputs,
                                        processing_arrays, sampling_arrays)
from forkjax.engine.paged_attention import paged_attention
from forkjax.engine.sampler import (ProcessArrays, SamplingArrays, greedy, process_logits, sample,
                                    top_logprobs)
from forkjax.engine.sequence import MAX_LOGPROBS
from forkjax.engine.batch import ScheduledBatch
from forkjax.models.transformer import ForwardBatch
from forkjax.tensor_parallel import REPLICATED, param_specs, shard, sharding

log = logging.getLogger("forkjax")


@dataclasses.dataclass
class Launched:
    """A dispatched step: its batch and device outputs (not waited for)."""
    batch: ScheduledBatch
    tokens: jax.Array  # [max_batch] int32 sampled token of request i in row i
    logits: jax.Array | None  # [b * c, vocab] float32 with all_logits
    finite: jax.Array  # [b] bool: request i's step computed only finite values
    fan_finite: jax.Array  # [b, N] bool: the fan-out residuals it wrote for slot j are finite
    hidden: jax.Array | None  # [L + 1, b * c, d] float32 hidden states with `hidden`
    chunk: int  # c: rows per request
    # when a request asked for logprobs: (sampled token's [b], top ids [b, k], top logprobs [b, k])
    logprobs: tuple | None = None


@dataclasses.dataclass
class Fetched:
    """A finished step's outputs, per request (n of them)."""
    tokens: np.ndarray  # [n] int32 sampled tokens
    finite: np.ndarray  # [n] bool
    fan_finite: np.ndarray  # [n, N] bool
    logits: list | None  # per request [chunk, vocab] float32
    hidden: list | None  # per request [L + 1, chunk, d] float32
    logprobs: list | None = None  # per request (logprob, top ids [k], top logprobs [k])


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


def _forward(graphdef: HashOnce, state_def: HashOnce, state_leaves, pools, inputs: StepInputs,
             prev_tokens, *, tp: HashOnce | None, **static):
    """The step program: `_step_body`, or under tensor parallelism (`tp`: the size and the
    parameters' PartitionSpecs) that body run per shard (tensor_parallel.py), every output but
    the pools replicated."""
    body = functools.partial(_step_body, graphdef, state_def, **static)
    if tp is None:
        return body(state_leaves, pools, inputs, prev_tokens)
    size, specs = tp.value
    return shard(body, size, in_specs=(list(specs), KV_SPECS, REPLICATED, REPLICATED),
                 out_specs=(REPLICATED, KV_SPECS))(state_leaves, pools, inputs, prev_tokens)


def _step_body(graphdef: HashOnce, state_def: HashOnce, state_leaves, pools, inputs: StepInputs,
               prev_tokens, *, kind: str, all_logits: bool, hidden: bool, residual: bool,
               use_pallas: bool):
    """One forward of a bucketed batch; the pools are donated and come back updated.
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
    never reach its own stream: slot j's A applied to its hidden states may overflow alone)."""
    model = nnx.merge(graphdef.value, jax.tree.unflatten(state_def.value, state_leaves))
    rows = inputs.prev_rows
    tokens = jnp.where(rows >= 0, prev_tokens[jnp.maximum(rows, 0)], inputs.tokens)
    batch = ForwardBatch(positions=inputs.positions, group_sizes=inputs.group_sizes, attn=inputs.meta)
    fan_checks = []  # [T, N] per layer, appended while the layers are traced
    attn = functools.partial(paged_attention, kind=kind, residual=residual, use_pallas=use_pallas,
                             inv_freq=model.inv_freq[...], fan_checks=fan_checks)
    h, pools, layers = model(tokens, batch, attn, pools, output_hidden_states=hidden)
    states = jnp.stack(layers[:-1] + [h]).astype(jnp.float32) if hidden else None
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
    if fan_checks:
        fan_ok = jnp.stack(fan_checks).all(0).reshape(b, -1, n)  # [B, c, N]
        fan_finite = jnp.all(fan_ok | ~valid[..., None], axis=1)
    return (_pad_to(greedy(rows), prev_tokens.shape[0]), rows, logits, finite, fan_finite,
            states), pools


_JIT = dict(static_argnums=(0, 1), donate_argnums=3,
            static_argnames=("kind", "all_logits", "hidden", "residual", "use_pallas", "tp"))
# XLA's dot merger concatenates the weights of GEMMs that share an input into one matrix to run
# one GEMM; the weights are jit arguments, so the concatenation would run on every step. Off.
_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}
_step = jax.jit(_forward, **_JIT, compiler_options=_OPTIONS)
# Steps of 64 tokens or more run their GEMMs on cuBLAS, where XLA's autotuned Triton GEMMs are
# slower; below 64 tokens cuBLAS is the slower one (BENCHMARKS.md, Engine decode and
# prefill).
CUBLAS_FROM_TOKENS = 64
_step_cublas = jax.jit(_forward, **_JIT,
                       compiler_options={**_OPTIONS, "xla_gpu_enable_triton_gemm": False})


def _pad_to(tokens, size: int):
    # A pad, not a scatter into zeros: at full size that scatter's index array is an empty
    # constant, on which the partitioner (Shardy) crashes under tensor parallelism.
    return jnp.pad(tokens.astype(jnp.int32), (0, size - tokens.shape[0]))


# Copy-on-write is its own small program, run before a step only when that step has copies:
# inside the step program every step would copy a batch of padding pages (sink to sink) in every
# layer. Under tensor parallelism each shard copies its heads' pages.
@functools.cache
def _copy_pages(tp: int):
    fn = copy_pages if tp == 1 else shard(copy_pages, tp, in_specs=(KV_SPECS, *[REPLICATED] * 4),
                                          out_specs=KV_SPECS)
    return jax.jit(fn, donate_argnums=0)


@functools.partial(jax.jit, static_argnums=2)
def _sample_padded(rows, sampling: SamplingArrays, size: int):
    """rows [B, vocab] float32 -> [size] int32 sampled tokens (row i: request i)."""
    return _pad_to(sample(rows, sampling), size)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _process_and_sample(rows, sampling: SamplingArrays, process: ProcessArrays | None, prev_tokens,
                        size: int, k: int):
    """rows [B, vocab] float32, prev_tokens [size] int32 (the previous step's samples) ->
    ([size] int32 tokens sampled from the processed logits (`process` None: as they are),
    (logprobs [B], top ids [B, k], top logprobs [B, k]) of the model's logits, or None: k = 0)."""
    z = rows if process is None else process_logits(rows, process, prev_tokens)
    tokens = sample(z, sampling)
    return _pad_to(tokens, size), top_logprobs(rows, tokens, k) if k else None


class ModelRunner:
    def __init__(self, model, layout: PoolLayout, buckets: Buckets, *, num_slots: int,
                 use_pallas: bool, fanout: bool = False):
        self.layout = layout
        self.buckets = buckets
        self.num_slots = num_slots
        self.residual = layout.policy.uses_residual
        self.fanout = fanout
        self.use_pallas = use_pallas
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        self.graphdef, self.state_def = HashOnce(graphdef), HashOnce(treedef)
        self.state_leaves = leaves  # a flat list: jit's C++ path flattens it in microseconds
        self._exes: dict = {}  # shape -> executable, this runner's view of COMPILER
        self.vocab_size = model.vocab_size
        self.tp = model.tp
        self._tp = None if model.tp == 1 else HashOnce((model.tp, tuple(param_specs(state))))
        self.pools = layout.allocate()
        # The last step's sampled tokens, padded to the largest decode bucket (one fixed shape),
        # on every device of the mesh under tensor parallelism (where the step's outputs are).
        self.prev_tokens = jnp.zeros(buckets.decode_sizes[-1], jnp.int32,
                                     device=sharding(self.tp, REPLICATED))
        # What a step program depends on besides the model's structure and its bucket shape
        # (COMPILER's keys): every array argument's shape and dtype but the inputs' (the bucket
        # shape's), so that engines of other batch sizes or pools never share a program.
        avals = lambda tree: (jax.tree.structure(tree), tuple(  # noqa: E731
            (x.shape, x.dtype.name) for x in jax.tree.leaves(tree)))
        self._program = HashOnce((avals(self.state_leaves), avals(self.pools),
                                  avals(self.prev_tokens), self.residual, use_pallas))
        self.warm = False  # every bucket compiled: a program compiled later logs a warning
        self.background_warmup = None  # compiler.BackgroundWarmup of warmup(background=True)
        self.last_inputs_s = self.last_dispatch_s = 0.0  # host time of the last launch()

    def replace_params(self, pairs) -> None:
        """[(old array, new array)]: parameters the model replaced (adapter slot writes); shapes
        never change, so the programs stay (a re-split of the whole model would cost ~15 ms of
        host time at 32 layers)."""
        where = {id(x): i for i, x in enumerate(self.state_leaves)}
        leaves = list(self.state_leaves)
        for old, new in pairs:
            leaves[where[id(old)]] = new
        self.state_leaves = leaves

    def warmup(self, progress: bool = True, workers: int | None = None, background: bool = False,
               host_pools=(None, None)):
        """Compile every bucket's step (compiler.py): now, XLA's compiles on `workers` threads
        (default: the host's cores), or with `background` on threads of their own (default: all
        cores but one) while the engine serves, in the order a first request needs them: one
        request's shapes first, then larger batches. Now, not in the background, also the host
        tier's copies of `host_pools` (base, residual; they run on the pools, which a serving
        step donates: in the background they compile when first needed)."""
        items = [(self._key(kind, b, c, w, False, False, self.fanout), self._lowering(kind, b, c, w))
                 for kind, b, c, w in sorted(self.buckets.all(), key=lambda s: (s[3], s[1], s[2]))]
        cores = os.cpu_count() or 1
        if background:
            t0 = time.perf_counter()

            def done():
                self.warm = True
                log.info("warm-up done: %d shapes compiled in the background in %.0f s",
                         len(items), time.perf_counter() - t0)

            workers = workers or max(1, cores - 1)
            self.background_warmup = COMPILER.start_background(items, workers, done)
            return
        with tqdm(total=len(items), desc="compiling", disable=not progress, unit="shape") as bar:
            COMPILER.compile_all(items, workers or min(len(items), cores), bar.update)
        for b in self.buckets.decode_sizes:  # sampling and copy-on-write: small programs, quick
            jax.block_until_ready(_sample_padded(jnp.zeros((b, self.vocab_size), jnp.float32),
                                                 sampling_arrays([], b), len(self.prev_tokens)))
            self._copy([], [], b)
        base, res = host_pools
        if base is not None:
            k, v = base.warmup(self.pools.base_k, self.pools.base_v)
            self.pools = self.pools._replace(base_k=k, base_v=v)
        if res is not None:
            k, v = res.warmup(self.pools.res_k, self.pools.res_v)
            self.pools = self.pools._replace(res_k=k, res_v=v)
        self.warm = True

    def stop_warmup(self):
        """Stop this runner's background warm-up, if running, once its compiles in progress
        finish; what other runners compile, and every compiled program, is left as it is."""
        if self.background_warmup is not None:
            self.background_warmup.stop()

    def _key(self, *shape) -> tuple:
        """COMPILER's key of the step of (kind, B, C, W, all_logits, hidden, fanout)."""
        return (self.graphdef, self.state_def, self._program, *shape)

    def _lowering(self, kind, b, c, w):
        return lambda: self._lower(kind, False, False,
                                   dummy_inputs(b, c, w, self.num_slots, self.fanout)[0])

    def _lower(self, kind, all_logits, hidden, inputs):
        """The step of `inputs`' shapes, lowered from shapes alone (the pools may be donated
        meanwhile by a step on another thread)."""
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        args = (self.graphdef, self.state_def, jax.tree.map(shape, self.state_leaves),
                jax.tree.map(shape, self.pools), inputs, shape(self.prev_tokens))
        return self._jit(inputs).trace(*args, **self._static(kind, all_logits, hidden)).lower()

    # ---- one step -------------------------------------------------------------------------

    def launch(self, batch: ScheduledBatch, all_logits: bool = False, hidden: bool = False) -> Launched:
        """Dispatch one scheduled batch without waiting for it (`all_logits`: every row's
        logits, `hidden`: every row's hidden states). A PENDING input token is read on the
        device from the previous launch's row `row.prev_row`, so this step can be dispatched
        before that one has finished."""
        b, c, w = batch_shape(batch, self.buckets)
        t0 = time.perf_counter()
        self._host_copies(batch.host_pools)
        if batch.base_copies or batch.res_copies:  # before this step writes into the copies
            self._copy(batch.base_copies, batch.res_copies)
        fanout = self.fanout or any(r.fan_slots for r in batch.rows)
        inputs, sampling = build_inputs(batch, b, c, w, self.num_slots, fanout)
        t1 = time.perf_counter()
        (tokens, rows, logits, finite, fan_finite, states), self.pools = self._call(
            batch.kind, all_logits, hidden, inputs, (batch.kind, b, c, w, all_logits, hidden, fanout))
        processed = any(r.params.processed for r in batch.rows)
        k = MAX_LOGPROBS if any(r.params.logprobs is not None for r in batch.rows) else 0
        logprobs = None
        if processed or k:  # only steps holding such a request pay for the program
            process = processing_arrays(batch.rows, b) if processed else None
            tokens, logprobs = _process_and_sample(rows, sampling, process, self.prev_tokens,
                                                   len(tokens), k)
        elif np.any(sampling.temperature > 0):
            tokens = _sample_padded(rows, sampling, len(tokens))
        self.prev_tokens = tokens
        t2 = time.perf_counter()  # the call returns once XLA has launched the step's kernels
        self.last_inputs_s, self.last_dispatch_s = t1 - t0, t2 - t1
        return Launched(batch, self.prev_tokens, logits, finite, fan_finite, states, c, logprobs)

    @staticmethod
    def fetch(launched: Launched) -> Fetched:
        """Wait for a launched batch and read its outputs."""
        rows, c = launched.batch.rows, launched.chunk
        n = len(rows)
        spans = [slice(i * c, i * c + r.end - r.start) for i, r in enumerate(rows)]
        logits = None if launched.logits is None else np.asarray(launched.logits)
        hidden = None if launched.hidden is None else np.asarray(launched.hidden)
        lps = None
        if launched.logprobs is not None:
            lp, ids, top = (np.asarray(x) for x in launched.logprobs)
            lps = [(float(lp[i]), ids[i], top[i]) for i in range(n)]
        return Fetched(np.asarray(launched.tokens)[:n], np.asarray(launched.finite)[:n],
                       np.asarray(launched.fan_finite)[:n],
                       None if logits is None else [logits[r] for r in spans],
                       None if hidden is None else [hidden[:, r] for r in spans], lps)

    def _call(self, kind, all_logits, hidden, inputs, shape):
        exe = self._exes.get(shape)
        if exe is None:
            key = self._key(*shape)
            if self.warm and not COMPILER.compiled(key):
                log.warning("compiling a new shape after warm-up: %s", shape)
            exe = self._exes[shape] = COMPILER.get(
                key, lambda: self._lower(kind, all_logits, hidden, inputs))
        return exe(*self._args(inputs)[2:])

    @staticmethod
    def _jit(inputs):
        return _step_cublas if inputs.tokens.shape[0] >= CUBLAS_FROM_TOKENS else _step

    def _args(self, inputs) -> tuple:
        return (self.graphdef, self.state_def, self.state_leaves, self.pools, inputs, self.prev_tokens)

    def _static(self, kind, all_logits, hidden) -> dict:
        return dict(kind=kind, all_logits=all_logits, hidden=hidden, residual=self.residual,
                    use_pallas=self.use_pallas, tp=self._tp)

    def _host_copies(self, host_pools):
        """Run the host tier's queued write-backs and loads (cache/host_pool.py) before the
        step: the step may write pages just written back, and reads pages just loaded."""
        base, res = host_pools
        pools = self.pools
        if base is not None and base.pending:
            k, v = base.execute(pools.base_k, pools.base_v)
            pools = pools._replace(base_k=k, base_v=v)
        if res is not None and res.pending:
            k, v = res.execute(pools.res_k, pools.res_v)
            pools = pools._replace(res_k=k, res_v=v)
        self.pools = pools

    def _copy(self, base_pairs, res_pairs, size: int | None = None):
        """Dispatch the copy-on-write page copies, padded to a decode bucket with sink-to-sink
        no-ops (at most one pair per request and pool per step; more after a preemption storm,
        then a power of two)."""
        n = max(len(base_pairs), len(res_pairs))
        size = size or (self.buckets.decode(n) if n <= self.buckets.decode_sizes[-1]
                        else 1 << (n - 1).bit_length())
        self.pools = _copy_pages(self.tp)(self.pools, *copy_index_arrays(base_pairs, size),
                                          *copy_index_arrays(res_pairs, size))
