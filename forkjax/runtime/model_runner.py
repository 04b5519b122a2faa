"""ModelRunner: the one jit boundary and the one holder of device state: the parameters (split
from the model once, a flat list a few dozen arrays long: the layers are stacked), the KV pools
(donated state), the host tier's blocks and the compiled programs of step_program.py.

Shapes are bucketed (buckets.py), a batch's inputs padded to its bucket (input_batch.py), so a
fixed set of programs serves every batch, compiled at start or in the background while serving
(compiler.py; which ones and in which order: warmup_plan.py; kept across processes:
program_store.py); page tables are as wide as the bucket of the batch's longest request. A
step or sampling program compiled after warm-up logs a warning: a shape escaped the warm-up.

Residual fan-out adds two inputs, a token's fan-out targets (at most `fanout_width` adapter
slots, 0 where no request can fan out) and their residual slots (`PagedMeta.fan_adapters`,
`fan_slots`), written by the K/V write: an engine with `residual_fanout` runs (and compiles) only
programs with them; otherwise a batch runs them only when one of its requests fans out.
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

from forkjax.cache import PoolLayout
from forkjax.runtime import kv_pools
from forkjax.runtime.batch import ScheduledBatch
from forkjax.runtime.buckets import Buckets
from forkjax.runtime.compiler import COMPILER
from forkjax.runtime.decode_rows import DecodeRows
from forkjax.runtime.host_blocks import HostBlocks
from forkjax.runtime.input_batch import (InputLayout, batch_shape, build_inputs, id_list_widths,
                                         padded_masks, processing_arrays)
from forkjax.runtime.program_store import ProgramStore
from forkjax.runtime.sampler import SamplingArrays
from forkjax.runtime.step_program import HashOnce, copy_pages_program, lower_sampling, lower_step
from forkjax.runtime.warmup_plan import sampling_programs, step_shapes
from forkjax.sampling_params import MAX_LOGPROBS
from forkjax.tensor_parallel import REPLICATED, param_specs, sharding

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
class Forwarded:
    """A step whose forward pass is dispatched and whose sampling is not (`ModelRunner.sample`)."""
    launched: Launched  # its tokens the forward program's greedy ones until sampled
    b: int  # the batch bucket
    rows: jax.Array  # [b, vocab] float32 each request's last logits
    sampling: SamplingArrays  # [b] each
    processed: bool  # a row has logit processors (penalties, bias, min_tokens, ...)
    logprobs: int  # top logprobs to return, 0 for none


@dataclasses.dataclass
class Fetched:
    """A finished step's outputs, per request (n of them)."""
    tokens: np.ndarray  # [n] int32 sampled tokens
    finite: np.ndarray  # [n] bool
    fan_finite: np.ndarray  # [n, N] bool
    logits: list | None  # per request [chunk, vocab] float32
    hidden: list | None  # per request [L + 1, chunk, d] float32
    logprobs: list | None = None  # per request (logprob, top ids [k], top logprobs [k])


class ModelRunner:
    def __init__(self, model, layout: PoolLayout, buckets: Buckets, *, num_slots: int,
                 use_pallas: bool, fanout: bool = False, fanout_width: int = 0,
                 host_tier: tuple[int, int] = (0, 0), alora: bool = False):
        """`host_tier`: the largest block (pages) of the base and residual pools' host tiers
        (cache/host_pool.py), 0 for none. `alora`: Activated LoRA adapters may run
        (`enable_alora`)."""
        self.layout = layout
        self.buckets = buckets
        self.num_slots = num_slots
        self.residual = layout.policy.uses_residual
        self.fanout_width = fanout_width
        self.fanout = fanout and fanout_width > 0
        self.use_pallas = use_pallas
        self.alora = False
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        self.graphdef, self.state_def = HashOnce(graphdef), HashOnce(treedef)
        # The parameters, a flat list (jit's C++ path flattens it in microseconds): their one
        # holder, which adapter writes replace (`write_adapter`)
        self.params = leaves
        self._exes: dict = {}  # shape -> executable, this runner's view of COMPILER
        self._layouts: dict = {}  # (b, c, w, fan-out width) -> InputLayout
        self.vocab_size = model.vocab_size
        self.tp = model.tp
        self._tp = None if model.tp == 1 else HashOnce((model.tp, tuple(param_specs(state))))
        self.pools = kv_pools.allocate(layout)
        self.decode_rows = DecodeRows(buckets.decode_sizes[-1], buckets.page_widths[-1], layout.page_size)
        self.host_blocks = tuple(HostBlocks(axis, most) if most else None  # page axes: base 2, residual 1
                                 for axis, most in zip((2, 1), host_tier))
        # The last step's sampled tokens, padded to the largest decode bucket (one fixed shape),
        # on every device of the mesh under tensor parallelism (where the step's outputs are).
        self.prev_tokens = jnp.zeros(buckets.decode_sizes[-1], jnp.int32,
                                     device=sharding(self.tp, REPLICATED))
        # What a step program depends on besides the model's structure and its bucket shape
        # (COMPILER's keys): every array argument's shape and dtype but the inputs' (the bucket
        # shape's), so that engines of other batch sizes or pools never share a program.
        avals = lambda tree: (jax.tree.structure(tree), tuple(  # noqa: E731
            (x.shape, x.dtype.name) for x in jax.tree.leaves(tree)))
        self._avals = (avals(self.params), avals(self.pools), avals(self.prev_tokens))
        self._program = HashOnce((*self._avals, self.residual, use_pallas, self.alora))
        self.store = self._program_store()
        self.warm = False  # every bucket compiled: a program compiled later logs a warning
        self.background_warmup = None  # compiler.BackgroundWarmup of warmup(background=True)
        self.last_inputs_s = self.last_dispatch_s = 0.0  # host time of the last step's dispatch
        if alora:
            self.enable_alora()

    def enable_alora(self) -> None:
        """Let Activated LoRA rows run: under a residual policy the step programs then fold
        their LoRA K/V into the base pool (runtime/paged_attention.py), a variant compiled
        from here on; other policies need nothing."""
        if self.residual and not self.alora:
            self.alora = True
            self._program = HashOnce((*self._avals, self.residual, self.use_pallas, True))
            self.store = self._program_store()
            self._exes.clear()

    def _program_store(self) -> ProgramStore | None:
        """This runner's programs on disk across processes (beside jax's compilation cache,
        when it is on), so that a restart loads them instead of tracing and lowering them."""
        devices = jax.local_devices()[:self.tp] if self.tp > 1 else list(self.prev_tokens.devices())
        return ProgramStore.beside_jax_cache(devices, repr((
            self.graphdef.value, self.state_def.value, self._program.value, self.num_slots,
            self._tp and self._tp.value)))

    @property
    def model(self):
        """The nnx model over the current parameters (a view: a later adapter write donates
        the arrays it replaces)."""
        return nnx.merge(self.graphdef.value, jax.tree.unflatten(self.state_def.value, self.params))

    def write_adapter(self, writer, slot: int, adapter) -> None:
        """Write `adapter` (None: zeros) into device slot `slot` with `writer` (a
        lora.slot_writer.SlotWriter; dispatched, ordered after the step in flight by the
        donation). Shapes never change, so the programs stay."""
        self.params = writer.write(self.params, slot, adapter)

    def warmup(self, progress: bool = True, workers: int | None = None, background: bool = False):
        """Compile the programs of warmup_plan.py (every bucket's step, sampling, the fan-out
        and score steps; compiler.py): now, `workers` compiles at a time (default: the host's
        cores), or with `background` on threads of their own (default: all cores but one)
        while the engine serves, in the order requests need them: one request's plain
        shapes first, then larger batches, then the variants. Now, not in the background, also
        the copy programs (they run on the pools, which a serving step donates: in the
        background they compile when first needed)."""
        plain, variants = step_shapes(self.buckets, self._width(self.fanout), self.fanout_width)
        sampling = sampling_programs(self.buckets, self.vocab_size, self.prev_tokens, MAX_LOGPROBS)
        items = ([(shape, self._lowering(shape)) for shape in plain]
                 + [(shape, self._stored(shape, functools.partial(
                     lower_sampling, shape, args, len(self.prev_tokens)))) for shape, args in sampling]
                 + [(shape, self._lowering(shape)) for shape in variants])
        shapes = {self._key(*shape): shape for shape, _ in items}
        items = [(self._key(*shape), lower) for shape, lower in items]
        cores = os.cpu_count() or 1

        def keep(key, exe):  # this runner holds its programs (COMPILER refers to them weakly)
            if key == self._key(*shapes[key]):  # not a program enable_alora replaced since
                self._exes.setdefault(shapes[key], exe)

        if background:
            t0 = time.perf_counter()
            log.info("warm-up: %d step programs (%d plain, %d fan-out and score), %d sampling programs",
                     len(plain) + len(variants), len(plain), len(variants), len(sampling))

            def done():
                self.warm = True
                log.info("warm-up done: %d shapes compiled in the background in %.0f s (%s)",
                         len(items), time.perf_counter() - t0,
                         self.store or "no program store")

            workers = workers or max(1, cores - 1)
            self.background_warmup = COMPILER.start_background(items, workers, keep, done)
            return
        with tqdm(total=len(items), desc="compiling", disable=not progress, unit="shape") as bar:
            COMPILER.compile_all(items, workers or min(len(items), cores), keep, bar.update)
        log.info("warm-up: %d shapes compiled (%s)", len(items), self.store or "no program store")
        for b in self.buckets.decode_sizes:  # copy-on-write: small programs, quick
            self._copy([], [], b)
        for i, blocks in enumerate(self.host_blocks):
            if blocks is not None:
                self._on_pool(i, blocks.warmup)
        self.warm = True

    def stop_warmup(self):
        """Stop this runner's background warm-up, if running, once its compiles in progress
        finish; what other runners compile, and every compiled program, is left as it is."""
        if self.background_warmup is not None:
            self.background_warmup.stop()

    def _width(self, fanout: bool) -> int:
        """The fan-out width of a program with (or without) fan-out inputs."""
        return self.fanout_width if fanout else 0

    def _key(self, *shape) -> tuple:
        """COMPILER's key of the step of (kind, B, C, W, all_logits, hidden, fan-out width), or
        of a sampling program (warmup_plan.sampling_programs)."""
        return (self.graphdef, self.state_def, self._program, *shape)

    def _layout(self, b, c, w, fanout: int) -> InputLayout:
        """One InputLayout a shape, kept: its field offsets are computed once."""
        key = (b, c, w, fanout)
        if key not in self._layouts:
            self._layouts[key] = InputLayout(b, c, w, self.num_slots, fanout)
        return self._layouts[key]

    def _lowering(self, shape):
        """() -> the Lowered step of `shape` (kind, B, C, W, all_logits, hidden, fan-out width)."""
        kind, b, c, w, all_logits, hidden, fanout = shape
        layout = self._layout(b, c, w, fanout)
        return self._stored(shape, lambda: self._lower(kind, all_logits, hidden, layout))

    def _stored(self, shape, lower):
        """`lower` (() -> jax Lowered of program `shape`), through the program store if there is
        one: its executable is then loaded from there, or written there once compiled."""
        return lower if self.store is None else self.store.lowering(shape, lower)

    def _lower(self, kind, all_logits, hidden, layout: InputLayout):
        """The step of `layout`'s bucket, lowered from shapes alone (the pools may be donated
        meanwhile by a step on another thread)."""
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        args = (self.graphdef, self.state_def, jax.tree.map(shape, self.params),
                jax.tree.map(shape, self.pools), jax.ShapeDtypeStruct((layout.size,), jnp.int32),
                shape(self.prev_tokens))
        return lower_step(*args, **self._static(kind, all_logits, hidden, layout))

    # ---- one step -------------------------------------------------------------------------

    def forward(self, batch: ScheduledBatch, all_logits: bool = False, hidden: bool = False) -> Forwarded:
        """Dispatch one scheduled batch's forward pass without waiting for it (`all_logits`:
        every row's logits, `hidden`: every row's hidden states); `sample` dispatches its
        sampling, so its token masks (`batch.token_masks`) may be set in between. A PENDING
        input token is read on the device from the previous launch's row `row.prev_row`, so
        this step can be dispatched before that one has finished."""
        t0 = time.perf_counter()
        decode = batch.kind == "decode"
        b, c, w = batch_shape(batch, self.buckets, self.decode_rows.update(batch) if decode else None)
        self._host_copies(batch.host_copies)
        if batch.base_copies or batch.res_copies:  # before this step writes into the copies
            self._copy(batch.base_copies, batch.res_copies)
        whole = [r for r in batch.rows if r is not None]  # (a decode batch's changed rows)
        fanout = self._width(self.fanout or any(r.fan_slots for r in whole))
        layout = self._layout(b, c, w, fanout)
        packed, sampling = self.decode_rows.build(batch, layout) if decode else build_inputs(batch, layout)
        t1 = time.perf_counter()
        (tokens, rows, logits, finite, fan_finite, states), self.pools = self._call(
            batch.kind, all_logits, hidden, layout, packed, (batch.kind, b, c, w, all_logits, hidden, fanout))
        self.last_inputs_s, self.last_dispatch_s = t1 - t0, time.perf_counter() - t1
        return Forwarded(Launched(batch, tokens, logits, finite, fan_finite, states, c), b, rows, sampling,
                         any(r.params.processed for r in whole),  # such rows come whole
                         MAX_LOGPROBS if any(r.params.logprobs is not None for r in whole) else 0)

    def sample(self, fwd: Forwarded) -> Launched:
        """Dispatch the sampling of a forwarded batch (the forward program's greedy tokens when
        nothing else is asked), under its token masks if it has them."""
        t0 = time.perf_counter()
        launched, batch, sampling, b = fwd.launched, fwd.launched.batch, fwd.sampling, fwd.b
        masks = None if batch.token_masks is None else padded_masks(batch.token_masks, b)
        if fwd.processed or fwd.logprobs or masks is not None:  # only steps holding such a request pay
            process = processing_arrays(batch.rows, b) if fwd.processed else None
            # a greedy batch under masks skips the sort of sampling (other programs always sample)
            sampled = masks is None or bool(np.any(sampling.temperature > 0))
            shape = ("process", b, None if process is None else id_list_widths(process),
                     masks is not None, sampled, fwd.logprobs)
            launched.tokens, launched.logprobs = self._sample(shape, fwd.rows, sampling, process,
                                                              self.prev_tokens, masks)
        elif np.any(sampling.temperature > 0):
            launched.tokens = self._sample(("sample", b), fwd.rows, sampling)
        self.prev_tokens = launched.tokens
        self.last_dispatch_s += time.perf_counter() - t0  # calls return once XLA has launched
        return launched

    @staticmethod
    def fetch(launched: Launched) -> Fetched:
        """Wait for a launched batch and read its outputs."""
        chunks, c = launched.batch.chunks, launched.chunk
        n = len(chunks)
        spans = [slice(i * c, i * c + e - s) for i, (s, e) in enumerate(chunks)]
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

    def _call(self, kind, all_logits, hidden, layout, packed, shape):
        exe = self._executable(shape, lambda: self._lower(kind, all_logits, hidden, layout))
        return exe(self.params, self.pools, packed, self.prev_tokens)

    def _sample(self, shape, *args):
        """Run sampling program `shape` (warmup_plan.sampling_programs') on `args`."""
        exe = self._executable(shape, lambda: lower_sampling(shape, args, len(self.prev_tokens)))
        return exe(*args)

    def _executable(self, shape, lower):
        """The compiled program of `shape` (COMPILER's, `lower()` if no thread compiled it)."""
        exe = self._exes.get(shape)
        if exe is None:
            key = self._key(*shape)
            if self.warm and not COMPILER.compiled(key):
                log.warning("compiling a new shape after warm-up: %s", shape)
            exe = self._exes[shape] = COMPILER.get(key, self._stored(shape, lower))
        return exe

    def _static(self, kind, all_logits, hidden, layout) -> dict:
        return dict(layout=layout, kind=kind, all_logits=all_logits, hidden=hidden,
                    residual=self.residual, use_pallas=self.use_pallas, alora=self.alora, tp=self._tp)

    def _host_copies(self, copies):
        """Run the host tier's write-backs and loads (base pool's, residual pool's;
        cache/host_pool.py) before the step: the step may write pages just written back, and
        reads pages just loaded."""
        for i, (blocks, ops) in enumerate(zip(self.host_blocks, copies)):
            if ops:
                self._on_pool(i, lambda k, v: blocks.execute(ops, k, v))  # noqa: B023

    @property
    def host_load_stall_s(self) -> float:
        """Host seconds steps waited while the host tier's loads were issued."""
        return sum(b.load_stall_s for b in self.host_blocks if b is not None)

    def _on_pool(self, i: int, fn):
        """Replace the K and V of the base (i = 0) or residual (1) pool by fn(k, v)."""
        k, v = fn(*self.pools[2 * i:2 * i + 2])
        self.pools = self.pools._replace(**dict(zip(self.pools._fields[2 * i:2 * i + 2], (k, v))))

    def _copy(self, base_pairs, res_pairs, size: int | None = None):
        """Dispatch the copy-on-write page copies, padded to a decode bucket with sink-to-sink
        no-ops (at most one pair per request and pool per step; more after a preemption storm,
        then a power of two)."""
        n = max(len(base_pairs), len(res_pairs))
        size = size or (self.buckets.decode(n) if n <= self.buckets.decode_sizes[-1]
                        else 1 << (n - 1).bit_length())
        self.pools = copy_pages_program(self.tp)(self.pools, *kv_pools.copy_index_arrays(base_pairs, size),
                                                 *kv_pools.copy_index_arrays(res_pairs, size))
