"""Paged decode attention on Pallas' Mosaic GPU backend, warp-specialised.

Why a second decode kernel: in the Triton kernel every key block runs one serial chain
QK^T -> y = rK B_k -> rotation -> softmax -> PV in one warpgroup, with two programs per SM, so
the loop is latency-bound (BENCHMARKS.md, Kernels). Here the chain is split across warpgroups:
  producer    streams rK, rV pages and the block's cos | sin table, then K, V pages, by TMA
              into a ring of `stages` slots (page ids read one step ahead);
  K-LoRA      (residual only) computes U = (tab @ W) * [rK, .., rK] for each block (below) and
              copies rV into a 64-column slot (rV^T is a wgmma M operand);
  consumers   `consumers` attention warpgroups take alternate blocks and run online softmax;
              each writes its own split-K partial, B_v is applied once after the combine (as
              in the Triton kernel). Unified: S = Q K^T, O += P V. Residual, transposed so the
              G query heads (padded to 16) are wgmma's N instead of 64 padded M rows:
              S^T = K Q^T + U E^T, O^T += V^T P^T, O_r^T += rV^T P^T. Transposed, the
              softmax's sums over keys would run across the 4 warps (shared memory and two
              warpgroup barriers each): the denominator is left to the O_r^T wgmma instead,
              as row R of O_r^T, with column R of every rV slot set to ones.

K-LoRA scores without rebuilding K. For query head g and a key t at position p, with rotate-half
halves q_g = (q1, q2) and rows b_r = (b1, b2) of B_k:
    q_g . RoPE_p(rK_t B_k) = sum_r rK_t[r] T[t, g*R + r],   T = tab @ W,
    tab[t] = [cos(p theta) | sin(p theta)]                   [D], the same for every request
    W[j, g*R + r] = q1_j b1_j + q2_j b2_j, W[D/2 + j, .] = q2_j b1_j - q1_j b2_j   [D, G*R]
so a 64-key block costs the K-LoRA warpgroup one [64, D] @ [D, G*R] wgmma and one element-wise
product with rK repeated G times along columns (U), and the consumer sums over r inside its
score wgmma: S^T += U @ E^T with E^T[g*R + r, g] = 1. No element of K is rotated; tab (2 MB for
8k positions) stays in L2 and W is computed per call by a Triton kernel (mosaic_operands.py,
which also pads q, and runs the epilogue).

The producer only issues copies: it keeps 40 registers a thread and gives the rest of the CTA's
to the math warpgroups (`_register_split`, setmaxnreg).

Layout (the Triton split-K partials, so the combine is the same, transposed for residual):
  q      [B, Hkv, NQ, D]         the G query heads of KV head h in rows 0..G-1, zero rows after
                                 (NQ = 64, wgmma's M; residual: G rounded up to 16, its N)
  pools  [L, Hkv, P, 16, D]      a block of 64 keys is 4 pages, one TMA copy each; L = 1
                                 (added) when the caller passes one layer
  pages  [B, Mp] int32           Mp a multiple of 4; entries past a sequence are valid page ids
  out    o [B, KS*C, Hkv, 64, D], ml [B, KS*C, Hkv, 2, 64], float32; residual:
         o^T [.., D, NQ], ml [.., 2, NQ] (l unused), o_r^T [.., 64, NQ] (row R: l; rows R+1..
         unused)
Split ks takes key blocks ks, ks + KS, ...; consumer c of a split every C-th of those.
Ring slots are used round-robin, so with stages a multiple of C each consumer owns fixed slots
and observes every phase of their barriers (Mosaic GPU tracks barrier phases per waiter).
An item is one (batch row, KV head, split). By default each CTA runs one; with `ctas` fewer than
the items (one consumer only), CTA c runs items c, c + ctas, ... in turn, every warpgroup
counting ring steps across them, so the producer streams the next item's first blocks while
the consumer finishes the last one's. Meant for many short items (B=64, L=2k: 512 items of 32
blocks, one CTA an SM instead of each paying the ring's fill and its output stores); the
default from 1.5 items an SM (BENCHMARKS.md, Engine).

The SM count and the shared memory a CTA may use are the device's (tuning.py; the H200's off a
GPU). P goes through shared memory into its wgmma and accumulators are scoped refs: the forms
the CPU interpreter runs in jax 0.11.2, so the CPU tests run this kernel too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from forkjax.pallas_kernels.paged_attention.combine import combine_splits
from forkjax.pallas_kernels.paged_attention.mosaic_operands import (
    query_operands,
    query_operands_reference,
    residual_combine,
    residual_combine_reference,
    supported,
)
from forkjax.pallas_kernels.tuning import H200_KIND, for_device, sm_count, smem_bytes
from forkjax.rope import rope_cos_sin

ROWS = 64  # wgmma M: the query rows of one KV head, padded
BLOCK_K = 64  # keys per step: 4 pages of 16
PAGE = 16
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
WGMMA = plgpu.Layout.WGMMA


class Tuned(NamedTuple):
    k_splits: int | None  # None: as many as fill the SMs in one wave
    stages: int
    consumers: int


# By device kind, then residual (else unified): the H200's (bench_kernels.py --mgpu sweeps them);
# a device kind without an entry runs the H200's.
TUNED = {H200_KIND: {True: Tuned(k_splits=None, stages=3, consumers=1),
                     False: Tuned(k_splits=1, stages=4, consumers=2)}}


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """The kernel's options (None: the tuned default for the call's shapes and device, `resolve`).
    k_splits: split-K partials a (request, KV head); stages: ring slots; consumers: attention
    warpgroups; ctas: launch at most this many CTAs, each then running several (request, KV
    head, split) items in turn (module docstring)."""
    k_splits: int | None = None
    stages: int | None = None
    consumers: int | None = None
    ctas: int | None = None

    def resolve(self, residual: bool, pairs: int, key_blocks: int) -> MosaicConfig:
        """What the kernel runs for `pairs` (request, KV head) pairs over page tables of
        `key_blocks` blocks of keys: None fields from TUNED and the device's SM count, ctas at
        most the items."""
        tuned, sms = for_device(TUNED)[residual], sm_count()
        k_splits = self.k_splits
        if k_splits is None:  # one CTA per SM (shared memory): split the keys so that the items
            # fill the SMs in at most one wave (rounded down: rounded up, a second wave of a few
            # CTAs would take as long as the first)
            k_splits = tuned.k_splits or max(1, min(sms // pairs, key_blocks))
        consumers = tuned.consumers if self.consumers is None else self.consumers
        n_items = pairs * k_splits
        ctas = self.ctas
        if ctas is None:  # one CTA per SM from 1.5 items an SM (fewer: a tail of CTAs running
            # two items each while the rest idle)
            ctas = sms if consumers == 1 and 2 * n_items >= 3 * sms else n_items
        return MosaicConfig(k_splits=k_splits,
                            stages=tuned.stages if self.stages is None else self.stages,
                            consumers=consumers, ctas=max(1, min(ctas, n_items)))


def _tiles(cols: int, dtype) -> tuple:
    """Tiling + swizzle for a [rows, cols] shared-memory operand of wgmma / TMA."""
    swizzle = min(128, cols * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _mma(pairs, shapes):
    """Issue sum_i a_i @ b_i for each output (a list of (a, b) pairs per output; a callable in
    the list runs between the issues, e.g. a barrier wait for the operands after it), all
    operands in shared memory, then wait once -> float32 values [M, N] per output."""
    def run(*accs):
        for acc, terms in zip(accs, pairs):
            for term in terms:
                if callable(term):
                    term()
                else:
                    plgpu.wgmma(acc, *term)
        plgpu.wgmma_wait(0)
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(run, *[plgpu.ACC(s, jnp.float32) for s in shapes])


def _launch_registers(n_wg: int) -> int:
    return min(248, 65536 // (128 * n_wg) // 8 * 8)


def _set_registers(regs: int, n_wg: int):
    """setmaxnreg for this warpgroup: the producer gives registers to the math warpgroups."""
    launch = _launch_registers(n_wg)
    if regs != launch:
        plgpu.set_max_registers(regs, action="increase" if regs > launch else "decrease")


def _register_split(consumers: int, residual: bool) -> tuple[int, int]:
    """(consumer, K-LoRA) registers per thread. The warpgroups share what the CTA was launched
    with (an increase beyond it waits forever): launch * warpgroups, 40 for the producer."""
    n_wg = consumers + 1 + residual
    budget = _launch_registers(n_wg) * n_wg - 40
    k_regs = min(240, budget // (consumers + 1) // 8 * 8) if residual else 0
    return min(240, (budget - k_regs) // consumers // 8 * 8), k_regs


def _kernel(q_ref, k_ref, v_ref, pt_ref, len_ref, layer_ref, *rest, k_splits: int, n_ctas: int,
            stages: int, consumers: int, scale: float, residual: bool):
    if residual:
        (kr_ref, vr_ref, rpt_ref, w_ref, e_ref, tab_ref, o_ref, ml_ref, or_ref,
         q_smem, k_smem, v_smem, p_smem, q_bar, k_ready, v_ready, k_free, v_free,
         kr_smem, vr_smem, rvp_smem, tab_smem, w_smem, e_smem, const_bar, r_ready, u_smem,
         u_ready, u_free) = rest
    else:
        (o_ref, ml_ref, q_smem, k_smem, v_smem, p_smem, q_bar, k_ready, v_ready, k_free,
         v_free) = rest
    cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
    hkv = o_ref.shape[2]
    n_items = len_ref.shape[0] * hkv * k_splits
    n_mine = pl.cdiv(n_items - cta, n_ctas)  # this CTA's items: cta, cta + n_ctas, ...
    ppb = BLOCK_K // PAGE
    n_blocks = pt_ref.shape[1] // ppb
    d = q_smem.shape[-1]
    layer = layer_ref[0]
    n_wg = consumers + 1 + residual
    c_regs, k_regs = _register_split(consumers, residual)

    def coords(j):  # (b, h, split) of this CTA's j-th item
        x = cta + j * n_ctas
        return x // (hkv * k_splits), x // k_splits % hkv, x % k_splits

    def item(j):
        """(b, h, split, tokens, key blocks) of this CTA's j-th item. Every warpgroup walks the
        same items, counting ring steps across them, so ring slots and barrier phases agree."""
        b, h, ks = coords(j)
        length = len_ref[b]
        return b, h, ks, length, pl.cdiv(jnp.maximum(pl.cdiv(length, BLOCK_K) - ks, 0), k_splits)

    def over_items(body):
        """body(j, item(j), g) for each item, g its first ring step -> ring steps in all."""
        def run(j, g):
            it = item(j)
            body(j, it, g)
            return g + it[4]
        if n_ctas == n_items:  # one item a CTA: no loop around it
            return run(0, jnp.int32(0))
        return lax.fori_loop(0, n_mine, run, jnp.int32(0))

    def block_of(ks, i):  # the key block of split ks's i-th step
        return ks + i * k_splits

    @pl.when(wg == consumers + residual)
    def _producer():
        _set_registers(40, n_wg)

        def one_item(j, it, g):
            b, h, ks, _, steps = it

            def page_ids(i):  # the base (and residual) page ids of step i's block
                kb = jnp.minimum(block_of(ks, i), n_blocks - 1)  # (a prefetch past the end)
                tables = (pt_ref, rpt_ref) if residual else (pt_ref,)
                return tuple(t[b, kb * ppb + p] for t in tables for p in range(ppb))

            def step(i, ids):
                # Next step's page ids first: GMEM loads issued here complete behind this
                # step's waits and copies (loaded in front of each copy, every page would pay
                # a load latency).
                nxt = page_ids(i + 1)
                slot = lax.rem(g + i, stages)

                @pl.when(g + i >= stages)  # the slot's previous tiles are consumed
                @jax.named_scope("prod_wait_free")
                def _():
                    plgpu.barrier_wait(k_free.at[slot])
                    plgpu.barrier_wait(v_free.at[slot])

                if residual:  # first: the K-LoRA warpgroup's inputs, so U is ready with K
                    for p in range(ppb):
                        rows = pl.ds(p * PAGE, PAGE)
                        plgpu.copy_gmem_to_smem(kr_ref.at[layer, ids[ppb + p]],
                                                kr_smem.at[slot, rows], r_ready.at[slot])
                        plgpu.copy_gmem_to_smem(vr_ref.at[layer, ids[ppb + p]],
                                                vr_smem.at[slot, rows], r_ready.at[slot])
                    # cos | sin of the block's positions (the same for every CTA: L2)
                    plgpu.copy_gmem_to_smem(tab_ref.at[block_of(ks, i)], tab_smem.at[slot],
                                            r_ready.at[slot])

                for p in range(ppb):
                    rows = pl.ds(p * PAGE, PAGE)
                    plgpu.copy_gmem_to_smem(k_ref.at[layer, h, ids[p]], k_smem.at[slot, rows],
                                            k_ready.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[layer, h, ids[p]], v_smem.at[slot, rows],
                                            v_ready.at[slot])
                return nxt

            lax.fori_loop(0, steps, step, page_ids(0))

        total = over_items(one_item)

        @pl.loop(jnp.maximum(total - stages, 0), total)  # observe the last releases
        def _(i):
            plgpu.barrier_wait(k_free.at[lax.rem(i, stages)])
            plgpu.barrier_wait(v_free.at[lax.rem(i, stages)])

    if residual:
        G = w_smem.shape[1] // kr_smem.shape[-1]
        u_slots = u_smem.shape[0]

        @pl.when(wg == consumers)
        def _k_lora():  # U = (tab @ W) * [rK, .., rK]: the K-LoRA scores, not yet summed over r
            _set_registers(k_regs, n_wg)
            # column R of every rV slot is ones: row R of O_r^T sums P, the softmax
            # denominator (the copies below fill 0..R-1)
            r = vr_smem.shape[-1]
            ones = plgpu.broadcasted_iota(jnp.int32, (BLOCK_K, 16), 1, layout=WGMMA) == 0
            for st in range(stages):
                rvp_smem[st, :, pl.ds(r, 16)] = ones.astype(rvp_smem.dtype)

            def one_item(j, it, g):
                b, h, _, _, steps = it
                # (the previous item's wgmmas on W have completed: _mma waits for them)
                plgpu.copy_gmem_to_smem(w_ref.at[b, h], w_smem, const_bar)
                plgpu.barrier_wait(const_bar)

                @pl.loop(0, steps)
                def _(i):
                    slot, u = lax.rem(g + i, stages), lax.rem(g + i, u_slots)
                    with jax.named_scope("kl_wait_r"):
                        plgpu.barrier_wait(r_ready.at[slot])
                    # rV into the first R columns of a 64-wide slot: rV^T is a wgmma's M
                    # operand (64 rows) in O_r^T = rV^T P^T; rows past R (the ones) are not rV
                    rvp_smem[slot, :, pl.ds(0, vr_smem.shape[-1])] = vr_smem[slot]
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(v_ready.at[slot])
                    with jax.named_scope("kl_mma"):
                        (t,) = _mma([[(tab_smem.at[slot], w_smem)]], [u_smem.shape[1:]])
                    rk = kr_smem[slot].astype(jnp.float32)
                    plgpu.barrier_arrive(k_free.at[slot])  # tab and rK of the slot are read

                    @pl.when(g + i >= u_slots)  # the consumer is done with the slot's last U
                    @jax.named_scope("kl_wait_u_free")
                    def _():
                        plgpu.barrier_wait(u_free.at[u])

                    with jax.named_scope("kl_store_u"):
                        # column g * R + r of U: query head g, rank r
                        u_smem[u] = (t * jnp.concatenate([rk] * G, axis=1)).astype(u_smem.dtype)
                        plgpu.commit_smem()  # generic-proxy writes before the consumer's wgmma
                    plgpu.barrier_arrive(u_ready.at[u])

            total = over_items(one_item)

            @pl.loop(jnp.maximum(total - u_slots, 0), total)  # observe the last releases
            def _(i):
                plgpu.barrier_wait(u_free.at[lax.rem(i, u_slots)])

    @pl.when(wg < consumers)
    def _attention():
        _set_registers(c_regs, n_wg)
        c = wg
        # Residual: transposed (S^T = K q^T + U E^T, O^T = V^T P^T, O_r^T = rV^T P^T), so the
        # 16 padded query rows are wgmma's N, not its M of 64; the softmax runs down the keys.
        ax = int(residual)  # the query axis of S (S^T)
        n_q = q_smem.shape[0]
        vs = (v_smem, rvp_smem) if residual else (v_smem,)
        sum_p = len(vs) == 1  # else the O_r^T product sums P (rV's column R is ones)
        o_shapes = [(ref.shape[-1], n_q) if residual else (n_q, d) for ref in vs]
        s_shape = (BLOCK_K, n_q) if residual else (n_q, BLOCK_K)
        use_u = residual

        def load_q(j):
            # each consumer loads (the same) q (and E^T) and tracks its own copy; the previous
            # item's wgmmas on them have completed (_mma waits)
            b, h, _ = coords(j)
            plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[c])
            if residual:
                plgpu.copy_gmem_to_smem(e_ref, e_smem, q_bar.at[c])

        load_q(0)

        def one_item(j, it, g):
            b, h, ks, length, steps = it
            plgpu.barrier_wait(q_bar.at[c])
            m = plgpu.layout_cast(jnp.full((n_q,), MASK_VALUE, jnp.float32), WGMMA.reduce(1 - ax))
            l = plgpu.layout_cast(jnp.zeros((n_q,), jnp.float32), WGMMA.reduce(1 - ax))
            o = tuple(plgpu.layout_cast(jnp.zeros(x, jnp.float32), WGMMA) for x in o_shapes)

            def step(t, carry):
                o, m, l = carry
                i = c + t * consumers
                slot = lax.rem(g + i, stages)
                kb = block_of(ks, i)
                with jax.named_scope("c_wait_k"):
                    plgpu.barrier_wait(k_ready.at[slot])
                if residual:
                    terms = [(k_smem.at[slot], q_smem.transpose((1, 0)))]
                else:
                    terms = [(q_smem, k_smem.at[slot].transpose((1, 0)))]
                if use_u:  # + sum_r U[key, g * R + r] into column g: E^T is 1 at (g * R + r, g)
                    u = lax.rem(g + i, u_slots)

                    def wait_u():  # after K q^T is issued: U may still be on its way
                        with jax.named_scope("c_wait_u"):
                            plgpu.barrier_wait(u_ready.at[u])

                    terms += [wait_u, (u_smem.at[u], e_smem)]
                with jax.named_scope("c_s_mma"):
                    (s,) = _mma([terms], [s_shape])
                plgpu.barrier_arrive(k_free.at[slot])
                if use_u:
                    plgpu.barrier_arrive(u_free.at[u])
                key = kb * BLOCK_K + plgpu.broadcasted_iota(jnp.int32, s_shape, 1 - ax,
                                                            layout=WGMMA)
                s = jnp.where(key < length, s * scale, MASK_VALUE)  # NaN keys past the end too
                m_new = jnp.maximum(m, s.max(axis=1 - ax))
                alpha = jnp.exp2(m - m_new)
                p_ = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [ax]))
                if sum_p:  # (residual: across the 4 warps, through shared memory)
                    l = l * alpha + p_.sum(axis=1 - ax)
                p_smem[c] = p_.astype(p_smem.dtype)
                with jax.named_scope("c_wait_v"):
                    plgpu.barrier_wait(v_ready.at[slot])

                @pl.when((kb + 1) * BLOCK_K > length)  # the last block: zero V rows past the
                def _():                               # end (0 * NaN in an unused slot is NaN)
                    for ref in vs:
                        v = plgpu.load(ref.at[slot], layout=WGMMA)
                        iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, v.shape,
                                                 layout=WGMMA)
                        keep = kb * BLOCK_K + iota(0) < length
                        if ref is not v_smem and n_ctas < n_items:  # rV's ones column: later
                            keep |= iota(1) >= vr_smem.shape[-1]    # items' denominators
                        ref[slot] = jnp.where(keep, v, jnp.zeros_like(v))

                plgpu.commit_smem()
                with jax.named_scope("c_pv_mma"):
                    if residual:
                        pv = _mma([[(ref.at[slot].transpose((1, 0)), p_smem.at[c])]
                                   for ref in vs], o_shapes)
                    else:
                        pv = _mma([[(p_smem.at[c], v_smem.at[slot])]], o_shapes)
                plgpu.barrier_arrive(v_free.at[slot])
                o = tuple(x * lax.broadcast_in_dim(alpha, x.shape, [ax]) + y
                          for x, y in zip(o, pv))
                return o, m_new, l

            o, m, l = lax.fori_loop(0, pl.cdiv(jnp.maximum(steps - c, 0), consumers), step,
                                    (o, m, l))
            if n_ctas < n_items:  # the next item's q lands while this one's outputs are stored
                pl.when(j + 1 < n_mine)(lambda: load_q(j + 1))
            split = ks * consumers + c
            o_ref[b, split, h] = o[0]
            if len(o) > 1:
                or_ref[b, split, h] = o[1]
            ml_ref[b, split, h, 0] = m
            ml_ref[b, split, h, 1] = l

        over_items(one_item)


def _k_lora_tables(G, R, inv_freq, n_blocks, n_q, dt):
    """-> E^T [G*R, n_q], tab [n_blocks, BLOCK_K, D] (see the module docstring; W comes from
    `mosaic_operands.query_operands` or `decode_operands`).

    tab by angle addition, cos(p0 + i) = cos p0 cos i - sin p0 sin i (and sin alike), from the
    tables of the block starts p0 and of the offsets i (each `rope_cos_sin`'s exact angles):
    n_blocks + BLOCK_K table rows instead of 6 sin/cos for every position."""
    e_t = jnp.arange(G * R)[:, None] // R == jnp.arange(n_q)[None, :]
    c0, s0 = rope_cos_sin(jnp.arange(n_blocks) * BLOCK_K, inv_freq)  # [n_blocks, D/2] starts
    c1, s1 = rope_cos_sin(jnp.arange(BLOCK_K), inv_freq)  # [BLOCK_K, D/2] offsets
    c0, s0 = c0[:, None], s0[:, None]
    tab = jnp.concatenate([c0 * c1 - s0 * s1, s0 * c1 + c0 * s1], -1)  # cos | sin
    return e_t.astype(dt), tab.astype(dt)


def query_rows(G: int, residual: bool) -> int:
    """Query rows of q: wgmma's N when transposed (residual; P^T tiles need a 32-byte swizzle,
    so at least 16 bf16 columns), else its M (64)."""
    return -(-G // 16) * 16 if residual else ROWS


def _scratch(G, R, D, dt, stages, consumers):
    """Shared memory of the kernel (R = 0: unified) -> (scratch types, bytes)."""
    residual = R > 0
    n_q, ppb = query_rows(G, residual), BLOCK_K // PAGE
    # Mosaic GPU wants both shared-memory operands of a wgmma tiled alike: transposed, V, rV,
    # U and E^T are tiled like P^T (16 columns)
    ntile = _tiles(n_q, dt) if residual else _tiles(D, dt)
    scratch = [
        plgpu.SMEM((n_q, D), dt, transforms=_tiles(D, dt)),  # q
        plgpu.SMEM((stages, BLOCK_K, D), dt, transforms=_tiles(D, dt)),  # K
        plgpu.SMEM((stages, BLOCK_K, D), dt, transforms=ntile),  # V
        plgpu.SMEM((consumers,) + ((BLOCK_K, n_q) if residual else (ROWS, BLOCK_K)), dt,
                   transforms=_tiles(n_q if residual else BLOCK_K, dt)),  # P (P^T)
        plgpu.Barrier(num_arrivals=1 + residual, num_barriers=consumers),  # q (and E^T)
        plgpu.Barrier(num_arrivals=ppb, num_barriers=stages),  # K pages landed
        plgpu.Barrier(num_arrivals=ppb + residual, num_barriers=stages),  # V (and rV)
        plgpu.Barrier(num_arrivals=1 + residual, num_barriers=stages),  # K (tab, rK) slot free
        plgpu.Barrier(num_barriers=stages),  # V slot free
    ]
    if residual:
        gr = _tiles(G * R, dt)
        scratch += [
            plgpu.SMEM((stages, BLOCK_K, R), dt, transforms=_tiles(R, dt)),  # rK
            plgpu.SMEM((stages, BLOCK_K, R), dt, transforms=_tiles(R, dt)),  # rV
            plgpu.SMEM((stages, BLOCK_K, ROWS), dt, transforms=ntile),  # rV, 64 columns
            plgpu.SMEM((stages, BLOCK_K, D), dt, transforms=gr),  # tab (tiled like W)
            plgpu.SMEM((D, G * R), dt, transforms=gr),  # W
            plgpu.SMEM((G * R, n_q), dt, transforms=ntile),  # E^T
            plgpu.Barrier(),  # W
            plgpu.Barrier(num_arrivals=2 * ppb + 1, num_barriers=stages),  # rK, rV, tab
        ]
    smem = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
               for x in scratch if hasattr(x, "shape"))
    if residual:  # U: two slots per consumer where they fit (K-LoRA then runs a block ahead)
        u_bytes = BLOCK_K * G * R * jnp.dtype(dt).itemsize
        u_slots = consumers * (2 if smem + 2 * consumers * u_bytes <= smem_bytes() else 1)
        smem += u_slots * u_bytes
        scratch += [plgpu.SMEM((u_slots, BLOCK_K, G * R), dt, transforms=ntile),  # U
                    plgpu.Barrier(num_barriers=u_slots),  # U ready
                    plgpu.Barrier(num_barriers=u_slots)]  # U free
    return scratch, smem


def _decode(q, k_pages, v_pages, page_table, lengths, res, layer, *, sm_scale,
            config: MosaicConfig | None, interpret):
    Hkv, _, S, _ = k_pages.shape[-4:]
    if isinstance(q, tuple):  # residual: (qx, W) from mosaic_operands.decode_operands
        (B, _, _, D), out_dtype = q[0].shape, q[0].dtype
        Hq = Hkv * q[1].shape[-1] // res[0].shape[-1]
    else:
        (B, Hq, D), out_dtype = q.shape, q.dtype
    if layer is None:  # one layer: a leading axis of 1 (a free reshape), layer 0
        layer = 0
        k_pages, v_pages = k_pages[None], v_pages[None]
        if res is not None:
            res = (res[0][None], res[1][None]) + tuple(res[2:])
    G = Hq // Hkv
    R = 0 if res is None else res[0].shape[-1]
    if not _shapes_ok(Hq, Hkv, D, S, R, k_pages.dtype):
        raise ValueError(f"mgpu decode: no kernel for Hq={Hq} Hkv={Hkv} D={D} page={S} R={R} "
                         f"{k_pages.dtype}")
    residual = res is not None
    ppb = BLOCK_K // S
    mp = -(-page_table.shape[1] // ppb) * ppb
    cfg = (config or MosaicConfig()).resolve(residual, B * Hkv, mp // ppb)
    k_splits, stages, consumers, n_ctas = cfg.k_splits, cfg.stages, cfg.consumers, cfg.ctas
    if stages % consumers:
        raise ValueError(f"stages ({stages}) must be a multiple of consumers ({consumers})")
    n_items = B * Hkv * k_splits
    if consumers > 1 and n_ctas < n_items:  # a consumer owns fixed ring slots within one item
        raise ValueError(f"ctas ({n_ctas}) < items ({n_items}) needs consumers=1, not {consumers}")
    pad_pages = lambda t: jnp.pad(t.astype(jnp.int32), ((0, 0), (0, mp - t.shape[1])))  # noqa: E731
    dt = k_pages.dtype
    f32 = jnp.float32
    n_q = query_rows(G, residual)
    scale = (D ** -0.5 if sm_scale is None else sm_scale) * math.log2(math.e)
    n_out = k_splits * consumers
    out_type = [jax.ShapeDtypeStruct((B, n_out, Hkv) + ((D, n_q) if residual else (n_q, D)),
                                     f32),
                jax.ShapeDtypeStruct((B, n_out, Hkv, 2, n_q), f32)]
    triton_ops = residual and supported(G, R, D)  # the operand and epilogue kernels
    if residual:  # q padded to n_q rows and W
        k_res, v_res, res_pages, b_k, b_v, adapter_ids, inv_freq = res
        if isinstance(q, tuple):
            qx, w = q
            if qx.shape[2] != n_q or qx.dtype != dt:
                raise ValueError(f"mgpu decode: qx {qx.shape} {qx.dtype}, want {n_q} rows {dt}")
        elif triton_ops:
            qx, w = query_operands(q, b_k, adapter_ids, n_q=n_q, dtype=dt, interpret=interpret)
        else:
            qx, w = query_operands_reference(q, b_k, adapter_ids, n_q=n_q, dtype=dt)
    else:
        qx = jnp.pad(q.astype(dt).reshape(B, Hkv, G, D), ((0, 0), (0, 0), (0, n_q - G), (0, 0)))
    args = [qx, k_pages, v_pages, pad_pages(page_table), lengths.astype(jnp.int32),
            jnp.asarray(layer, jnp.int32).reshape(1)]
    if residual:
        args += [k_res, v_res, pad_pages(res_pages), w,
                 *_k_lora_tables(G, R, inv_freq, mp // ppb, n_q, dt)]
        out_type.append(jax.ShapeDtypeStruct((B, n_out, Hkv, ROWS, n_q), f32))  # O_r^T
    n_wg = consumers + 1 + residual
    scratch, smem = _scratch(G, R, D, dt, stages, consumers)
    if smem > smem_bytes():
        raise ValueError(f"mgpu decode: {smem} B of shared memory for stages={stages} "
                         f"consumers={consumers} G={G} R={R} D={D} (at most {smem_bytes()})")
    kernel = plgpu.kernel(
        functools.partial(_kernel, k_splits=k_splits, n_ctas=n_ctas, stages=stages,
                          consumers=consumers, scale=scale, residual=residual),
        out_type=tuple(out_type), scratch_types=scratch, grid=(n_ctas,), grid_names=("cta",),
        num_threads=n_wg, thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    o, ml, *rest = kernel(*args)
    if residual:  # O^T and O_r^T (its row R: l, P summed by its wgmma)
        ml = ml if n_out > 1 else None  # (one split: nothing to rescale)
        if triton_ops and B * Hkv >= 16:  # the epilogue as one kernel of a program a (request,
            # KV head); with fewer programs XLA's, spread over more SMs, is faster
            return residual_combine(o, rest[0], b_v, adapter_ids, ml, groups=G,
                                    dtype=out_dtype, interpret=interpret)
        return residual_combine_reference(o, rest[0], b_v, adapter_ids, ml, groups=G,
                                          dtype=out_dtype)
    # Only the G real query rows (of n_q): sliced first, so the combine moves G/n_q of the data
    l = ml[:, :, :, 1, :G]
    o = combine_splits(o[..., :G, :], ml[:, :, :, 0, :G], l)
    return o.reshape(B, Hq, D).astype(out_dtype)


def _shapes_ok(Hq: int, Hkv: int, D: int, page_size: int, R: int, dtype) -> bool:
    G = Hq // Hkv
    return (page_size == PAGE and D in (64, 128) and G <= ROWS and R in (0, 16, 32)
            and G * R <= 256  # U's width: a wgmma N
            and (G * R in (16, 32) or G * R % 64 == 0)  # U's swizzle: 32, 64 or 128 bytes
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def supports(Hq: int, Hkv: int, D: int, page_size: int, R: int, dtype,
             config: MosaicConfig | None = None) -> bool:
    """Shapes this kernel handles, as compiled and tested on the H200 (R = 0: unified), with the
    ring `config` sets (stages, consumers; None: the tuned defaults) fitting the device's shared
    memory."""
    ring = (config or MosaicConfig()).resolve(R > 0, 1, 1)  # (only stages and consumers count)
    return (_shapes_ok(Hq, Hkv, D, page_size, R, dtype)
            and _scratch(Hq // Hkv, R, D, dtype, ring.stages, ring.consumers)[1] <= smem_bytes())


_STATIC = ("sm_scale", "config", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def mgpu_residual_decode(q, k_base, v_base, k_res, v_res, base_pages, res_pages, lengths, b_k,
                         b_v, adapter_ids, inv_freq, *, layer=None, sm_scale=None,
                         config: MosaicConfig | None = None, interpret: bool = False):
    """ResidualAttention decode, the `residual_attention_decode` contract (page size 16, R 16
    or 32, D 64 or 128, G * R 16, 32, 64, 128, 192 or 256, bf16/f16) -> [B, Hq, D].

    q: [B, Hq, D] with RoPE, or the kernel's operands (qx, W) as `decode_operands` builds them
    (mosaic_operands.py; the output then has qx's dtype).

    config.ctas: with fewer CTAs than items, one ring runs across a CTA's items, so an item's
    first loads and its output stores overlap the streaming of the item before and after."""
    return _decode(q, k_base, v_base, base_pages, lengths,
                   (k_res, v_res, res_pages, b_k, b_v, adapter_ids, inv_freq), layer,
                   sm_scale=sm_scale, config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def mgpu_unified_decode(
    q,  # [B, Hq, D]      current token's query, RoPE applied
    k_pages,  # [Hkv, P, 16, D] merged keys; [L, Hkv, P, 16, D] with `layer`
    v_pages,  # [Hkv, P, 16, D]
    page_table,  # [B, M] int32
    lengths,  # [B] int32  tokens to attend, the current one included
    *,
    layer=None,  # int32 scalar: the layer when the pools carry a leading L axis
    sm_scale=None,
    config: MosaicConfig | None = None,  # fewer CTAs than items need consumers=1
    interpret: bool = False,
):
    """Plain paged GQA decode (the `unified_attention_decode` contract) -> [B, Hq, D]."""
    return _decode(q, k_pages, v_pages, page_table, lengths, None, layer, sm_scale=sm_scale,
                   config=config, interpret=interpret)
