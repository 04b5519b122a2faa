"""ResidualAttention (ForkKV Algorithm 1) and plain paged attention as one Pallas Triton kernel.

Layout: kernel -> pallas_call wrapper -> the entry points api.py calls (its "triton" backend).
The contract and its plain-jnp version are in reference.py, the split combine in combine.py.

One kernel serves decode and extend (prefill), with or without the residual (LoRA) part of K/V.
A program owns (KV head h, block of `block_q` query tokens, KV split, request b). Its query rows
are the `block_q x Gp` (token-major, head-minor) query heads of that KV head's group, so every
K/V tile it loads is shared by the whole GQA group. It walks the request's page table in blocks
of `block_k` tokens (whole pages) and keeps an online softmax. Pools are seen as flat token rows
[P*S, D] and each block is one 2-D gather of `block_k` rows (row = page id * S + offset): Triton
then stages K/V straight into shared memory in the MMA's layout (a [pages, S, D] load would
need a reshape in registers first).

Residual reconstruction (the `residual=True` path), per block of keys at positions p0 + i:

    K_t = bK_t + RoPE_t(rK_t @ B_k)               # what we must attend to
    q . RoPE_{p0+i}(y) = RoPE_{-p0}(q) . RoPE_i(y)  # rotations compose; RoPE is orthogonal

so the block-start rotation goes on the query side (rows x D, tiny) and only the in-block offset
rotation RoPE_i, from a loop-invariant table, touches the keys. Rotate-half is applied in halves:
y1 = rK @ B_k[:, :D/2], y2 = rK @ B_k[:, D/2:], z = (y1 c - y2 s, y2 c + y1 s), so every tile
and table is D/2 wide and nothing is computed twice. Scores are q @ bK^T + q_rot1 @ z1^T +
q_rot2 @ z2^T; no sin/cos is evaluated in the loop (`reconstruct_k=True` instead rotates the
key side by the absolute angle, by angle addition: cheaper when the query block is tall).
Values use associativity: acc += p @ bV and acc_r += p @ rV, both rescaled by the same
online-softmax factor, and B_v is applied once, after the loop: the kernel writes acc and acc_r
(r wide) and the split combine computes (acc + acc_r @ B_v) / l. (That small dot inside the
loop's kernel would raise its register count to the limit and lower its occupancy.)

`swap_ab=True` (default for ResidualAttention decode) computes scores as [keys, rows] and keeps
the accumulators as [D, rows] (V^T @ P): the keys / head dim are then the M side of every MMA
(64-128 instead of the 16 query rows), the reconstructed tile feeds the MMA from registers as its
A operand and P stays in its score layout. The options travel as one `TritonConfig`; its None
fields take the tuned defaults of `TritonConfig.resolve` (table TUNED: the fastest of the H200
sweeps, BENCHMARKS.md, Kernels).

Split-K (flash-decoding): each program writes an unnormalised partial (o, m, l [, acc_r]) for
its share of the key blocks (every k_splits-th block, so a sequence much shorter than its page
table still spreads over all splits) and a small jnp step combines them (`acc_r` combines like
`o`: the B_v product is linear). Without the residual and with one split the kernel normalises
itself.

Extend layout (chosen for a padded batch of prefill chunks): q [B, T, Hq, D] padded per request;
request b has `prefix_lengths[b]` cached tokens before the chunk and `chunk_lengths[b]` new
tokens; new token t sits at position prefix_lengths[b] + t and attends causally to positions
0 .. prefix_lengths[b] + t. K/V of the new tokens are read from the pools: the engine writes them
before calling. Rows t >= chunk_lengths[b] of the output are zero. A long prompt is prefilled
chunk after chunk by raising prefix_lengths. Residual extend has a second, default path for
long chunks (`TritonConfig.materialize`, see `residual_extend`): merged K/V rebuilt in HBM by XLA, then
the unified kernel.

Page tables: entries past a sequence's last page must still be valid page ids (0, the padding
sink, is fine): whole blocks of pages are loaded and masked afterwards. Unused slots may hold
anything, NaN included: scores are masked with `where` and the V rows of invalid slots zeroed.

Fast path: D and R powers of two >= 16 (pools are used in place). Other sizes work through
zero padding, which copies the pools on every call (tests, odd parity models only).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from forkjax.pallas_kernels.padding import flat_rows, next_pow2, pad_axis
from forkjax.pallas_kernels.paged_attention.combine import combine_splits
from forkjax.pallas_kernels.tuning import H200_KIND, for_device
from forkjax.rope import rope_cos_sin

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)


# ----------------------------------------------------------------------------------------------
# Options and their tuned defaults
# ----------------------------------------------------------------------------------------------


class Tuned(NamedTuple):
    q_rows: int | None  # query rows (tokens x padded heads) of an extend program; None: 1 token
    block_k: int
    num_warps: int
    num_stages: int


# By device kind, then (residual, one query token): the fastest of the H200 sweeps (BENCHMARKS.md,
# Kernels); a device kind without an entry runs the H200's.
TUNED = {
    H200_KIND: {
        (True, True): Tuned(q_rows=None, block_k=64, num_warps=4, num_stages=2),
        (True, False): Tuned(q_rows=64, block_k=32, num_warps=4, num_stages=2),
        (False, True): Tuned(q_rows=None, block_k=64, num_warps=4, num_stages=3),
        (False, False): Tuned(q_rows=128, block_k=64, num_warps=4, num_stages=2),
    },
}
# Programs the default k_splits aims for (132 SMs on the H200, several programs each).
TARGET_PROGRAMS = 1024
# Residual kernels with at most this many query rows compute scores as [keys, rows] (swap_ab
# pays off with the residual only); with more they rebuild K on chip (reconstruct_k).
SWAP_AB_ROWS = RECONSTRUCT_K_ROWS = 32
# The materialising extend path (`residual_extend`) is taken for chunks of at least
# MATERIALIZE_MIN_TOKENS tokens when the page tables span at most MATERIALIZE_MAX_SLOTS token slots
# in all (the scratch holds every slot the tables span: B * M * S * Hkv * D elements for K and
# for V).
MATERIALIZE_MIN_TOKENS = 64
MATERIALIZE_MAX_SLOTS = 65536


def _given(value, default):
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """The kernel's options (None: the tuned default for the call's shapes and device, `resolve`).
    Each entry point reads those it has: decode runs one query token a program (block_q 1), the
    unified kernels have no residual (reconstruct_k, materialize)."""
    block_q: int | None = None  # query tokens a program
    block_k: int | None = None  # keys a loop step (whole pages)
    k_splits: int | None = None  # split-K partials a (request, KV head, query block)
    num_warps: int | None = None
    num_stages: int | None = None
    reconstruct_k: bool | None = None  # rotate the keys by the absolute angle (tall blocks)
    swap_ab: bool | None = None  # scores as [keys, rows], accumulators as [D, rows]
    materialize: bool | None = None  # residual extend: merged K/V rebuilt in HBM, then unified

    def resolve(self, *, residual: bool, batch: int, tokens: int, kv_heads: int, group: int,
                page_size: int, pages: int) -> TritonConfig:
        """What the kernel runs for `batch` requests of `tokens` query tokens, `group` query heads
        a KV head, page tables of `pages` pages of `page_size`: None fields from TUNED, blocks
        rounded up to powers of two (block_q at most the tokens', block_k at least a page) and
        k_splits at most the key blocks."""
        tuned = for_device(TUNED)[(residual, tokens == 1)]
        gp = next_pow2(group)
        block_q = _given(self.block_q, 1 if tuned.q_rows is None else max(1, tuned.q_rows // gp))
        block_q = max(1, min(next_pow2(block_q), next_pow2(tokens)))
        rows = max(16, block_q * gp)  # the kernel's query rows: dots with M < 16 are not safe
        block_k = max(next_pow2(_given(self.block_k, tuned.block_k)), page_size)
        n_blocks = -(-pages // (block_k // page_size))
        # Split-K: enough programs for the device, a power of two (at most one per key block).
        want = max(1, -(-TARGET_PROGRAMS // (batch * kv_heads * -(-tokens // block_q))))
        k_splits = _given(self.k_splits, next_pow2(want))
        return TritonConfig(
            block_q=block_q, block_k=block_k, k_splits=max(1, min(k_splits, n_blocks)),
            num_warps=_given(self.num_warps, tuned.num_warps),
            num_stages=_given(self.num_stages, tuned.num_stages),
            reconstruct_k=_given(self.reconstruct_k, rows > RECONSTRUCT_K_ROWS),
            swap_ab=_given(self.swap_ab, residual and rows <= SWAP_AB_ROWS),
            materialize=_given(self.materialize, residual and tokens >= MATERIALIZE_MIN_TOKENS
                               and batch * pages * page_size <= MATERIALIZE_MAX_SLOTS))


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


def _attention_kernel(
    q_ref,  # [rows, Dp]            query rows (token-major, head-minor), RoPE applied
    q1_ref,  # [rows, Hp]           first rotate-half half of q (residual only)
    q2_ref,  # [rows, Hp]           second half
    kb_ref,  # [P*S, Dp] or [L, P*S, Dp]  base keys of this KV head (flat token rows)
    vb_ref,  # same                 base values
    kr_ref,  # [Pr*S, Rp] or [L, Pr*S, Rp]  residual key activations (residual only)
    vr_ref,  # same                 residual value activations (residual only)
    bpt_ref,  # [Mp] int32          base page table of this request
    rpt_ref,  # [Mp] int32          residual page table (residual only)
    prefix_ref,  # [] int32         cached tokens before the query block's chunk
    chunk_ref,  # [] int32          new tokens of the chunk
    layer_ref,  # [] int32          layer index into layered pools (or None)
    bk1_ref,  # [Rp, Hp]            B_k columns of the first half, this adapter and KV head
    bk2_ref,  # [Rp, Hp]            B_k columns of the second half
    blkc_ref,  # [NB, Hp] f32       cos at each block start position
    blks_ref,  # [NB, Hp] f32       sin at each block start position
    offc_ref,  # [2, block_k, Hp]   cos of the in-block offsets, twice (see lora_scores)
    offs_ref,  # [2, block_k, Hp]   sin of the in-block offsets, twice
    *out_refs,  # o [rows, Dp] normalised, or unnormalised o, m [rows], l [rows] (+ o_r [rows, Rp])
    block_q: int,
    gp: int,
    block_k: int,
    page_size: int,
    k_splits: int,
    scale: float,
    residual: bool,
    normalize: bool,
    reconstruct_k: bool,
    swap_ab: bool,
):
    qb, ks = pl.program_id(1), pl.program_id(2)
    rows, dp = q_ref.shape
    ppb = block_k // page_size
    dt = q_ref.dtype
    f32 = jnp.float32
    prec = lax.Precision.HIGHEST if dt == f32 else None
    dot = functools.partial(plgpu.dot, precision=prec)

    prefix = prefix_ref[()]
    total = prefix + chunk_ref[()]
    q0 = prefix + qb * block_q  # position of the block's first query token
    kv_end = jnp.minimum(q0 + block_q, total)  # no row sees a key at or past this
    full_end = jnp.minimum(q0 + 1, total)  # every row sees every key below this
    # Split ks takes key blocks ks, ks + k_splits, ks + 2 k_splits, ... (strided, so the splits
    # stay balanced whatever the length: page tables span max_model_len, sequences rarely do).
    kb_end = pl.cdiv(kv_end, block_k)  # blocks some row sees
    kb_full = jnp.minimum(full_end // block_k, kb_end)  # blocks every row sees whole
    n_unmasked = pl.cdiv(jnp.maximum(kb_full - ks, 0), k_splits)
    first_masked = kb_full + lax.rem(ks - lax.rem(kb_full, k_splits) + k_splits, k_splits)
    n_masked = pl.cdiv(jnp.maximum(kb_end - first_masked, 0), k_splits)

    # Orientation: scores as [rows, keys] or, with swap_ab, [keys, rows] (keys on the M side of
    # every MMA: better tiles for the 16-row decode block, and the reconstructed tile enters
    # the MMA as its A operand straight from registers).
    sshape = (block_k, rows) if swap_ab else (rows, block_k)
    kax, rax = (0, 1) if swap_ab else (1, 0)
    q = q_ref[...]
    q_op = q.T if swap_ab else q

    def score(a_keys, b_rows):  # keys tile [block_k, X], rows tile [rows, X] or [X, rows]
        return dot(a_keys, b_rows) if swap_ab else dot(b_rows, a_keys, trans_b=True)

    def rows_t(x):  # a [rows, X] value in the orientation `score` wants
        return x.T if swap_ab else x

    if residual:
        rp = vr_ref.shape[-1]
    q_idx = q0 + lax.div(lax.broadcasted_iota(jnp.int32, sshape, rax), gp)
    kv_iota = lax.broadcasted_iota(jnp.int32, sshape, kax)
    kv_iota_col = lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)

    if layer_ref is not None:
        lyr = layer_ref[()]
        load_rows = lambda ref, rows_: ref[lyr, rows_]  # noqa: E731
    else:
        load_rows = lambda ref, rows_: ref[rows_]  # noqa: E731
    # Token-row gather: pools are flat [P * S, X]; each key row's address comes from its page id
    # (read once per row from the page table, an L1 hit). A 2-D [block_k, X] load lets Triton
    # stage K/V in shared memory in the MMA's layout (a [pages, S, X] load had to be reshaped in
    # registers, and the pipeliner then prefetched V into registers).
    slot_iota = lax.div(lax.broadcasted_iota(jnp.int32, (block_k,), 0), page_size)
    in_page = lax.rem(lax.broadcasted_iota(jnp.int32, (block_k,), 0), page_size)

    def lora_scores(kb, rk):
        """q . RoPE_t(rK_t @ B_k) for the block's keys, in the chosen orientation.

        rotate-half in halves: RoPE(y) = (y1 c - y2 s, y2 c + y1 s), so each half of y is
        computed once ([block_k, D/2] tiles, half-width tables) instead of y and rotate(y).
        """
        y1 = dot(rk, bk1_ref[...])  # [block_k, Hp] f32
        y2 = dot(rk, bk2_ref[...])
        # Two identical copies of the offset table, indexed by kb % 2: the compiler cannot hoist
        # the load out of the loop, where the table would hold registers for the loop's lifetime.
        oc = offc_ref[kb % 2].astype(f32)
        os_ = offs_ref[kb % 2].astype(f32)
        c0 = blkc_ref[pl.ds(kb, 1), :]  # [1, Hp] f32, position kb * block_k
        s0 = blks_ref[pl.ds(kb, 1), :]
        q1 = q1_ref[...].astype(f32)  # [rows, Hp]
        q2 = q2_ref[...].astype(f32)
        if reconstruct_k:  # absolute angles on the key side (angle addition)
            cos = c0 * oc - s0 * os_
            sin = s0 * oc + c0 * os_
            z1 = (y1 * cos - y2 * sin).astype(dt)
            z2 = (y2 * cos + y1 * sin).astype(dt)
            qr1, qr2 = q1.astype(dt), q2.astype(dt)
        else:  # in-block offset on the key side, block start on the query side
            z1 = (y1 * oc - y2 * os_).astype(dt)
            z2 = (y2 * oc + y1 * os_).astype(dt)
            qr1 = (q1 * c0 + q2 * s0).astype(dt)  # RoPE_{-p0}(q)
            qr2 = (q2 * c0 - q1 * s0).astype(dt)
        return score(z1, rows_t(qr1)) + score(z2, rows_t(qr2))

    def pv(p, v):  # p in score orientation, v [block_k, X] -> [rows, X] ([X, rows] if swap_ab)
        return dot(v, p, trans_a=True) if swap_ab else dot(p, v)

    def rescale(alpha, acc):
        return alpha[None, :] * acc if swap_ab else alpha[:, None] * acc

    def body(kb, carry, masked):
        o, o_r, m, l = carry
        slots = kb * ppb + slot_iota
        rows_b = bpt_ref[slots] * page_size + in_page  # [block_k] rows of the flat base pool
        k = load_rows(kb_ref, rows_b)
        s = score(k, q_op)
        if residual:
            rows_r = rpt_ref[slots] * page_size + in_page
            rk = load_rows(kr_ref, rows_r)
            s = s + lora_scores(kb, rk)
        s = s * scale
        if masked:
            kv = kb * block_k + kv_iota
            vis = (kv <= q_idx) & (kv < total)
            s = jnp.where(vis, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=kax))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - (m_new[None, :] if swap_ab else m_new[:, None]))
        if masked:
            p = jnp.where(vis, p, 0.0)
        l_new = alpha * l + jnp.sum(p, axis=kax)
        pd = p.astype(dt)
        v = load_rows(vb_ref, rows_b)
        if masked:
            kv_ok = kb * block_k + kv_iota_col < total  # [block_k, 1]
            v = jnp.where(kv_ok, v, jnp.zeros_like(v))  # NaN in unused slots: 0 * NaN = NaN
        o_new = rescale(alpha, o) + pv(pd, v)
        if residual:  # acc_r: same rescale as acc; B_v waits for the end
            rv = load_rows(vr_ref, rows_r)
            if masked:
                rv = jnp.where(kv_ok, rv, jnp.zeros_like(rv))
            o_r = rescale(alpha, o_r) + pv(pd, rv)
        return o_new, o_r, m_new, l_new

    # Accumulators are [X, rows] under swap_ab: V^T @ P keeps P in its score layout (the MMA's
    # B operand) and puts the 128-wide head dim on the M side.
    acc_shape = (lambda x: (x, rows)) if swap_ab else (lambda x: (rows, x))
    o = jnp.zeros(acc_shape(dp), f32)
    o_r = jnp.zeros(acc_shape(rp), f32) if residual else None
    m = jnp.full((rows,), MASK_VALUE, f32)
    l = jnp.zeros((rows,), f32)
    carry = (o, o_r, m, l)
    carry = lax.fori_loop(0, n_unmasked, lambda i, c: body(ks + i * k_splits, c, False), carry)
    carry = lax.fori_loop(0, n_masked, lambda i, c: body(first_masked + i * k_splits, c, True),
                          carry)
    o, o_r, m, l = carry
    if swap_ab:
        o = o.T
        o_r = o_r.T if residual else None
    if normalize:
        (o_ref,) = out_refs
        o = o / jnp.where(l > 0, l, 1.0)[:, None]
        o_ref[...] = o.astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs[:3]
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l
        if residual:  # B_v waits for the combine, after the loop (associativity)
            out_refs[3][...] = o_r


# ----------------------------------------------------------------------------------------------
# pallas_call wrapper
# ----------------------------------------------------------------------------------------------


def _resolve(config: TritonConfig | None, q, k_base, base_pages, residual: bool) -> TritonConfig:
    """`config` (None: all defaults) as the kernel runs it for q [B, T, Hq, D] over pools
    [.., Hkv, P, S, D] through page tables [B, M]."""
    B, T, Hq, _ = q.shape
    Hkv, _, S, _ = k_base.shape[-4:]
    return (config or TritonConfig()).resolve(
        residual=residual, batch=B, tokens=T, kv_heads=Hkv, group=Hq // Hkv, page_size=S,
        pages=base_pages.shape[1])


def _paged_attention(
    q,  # [B, T, Hq, D]
    k_base,  # [Hkv, P, S, D] or [L, Hkv, P, S, D]
    v_base,
    base_pages,  # [B, M] int32
    prefix_lengths,  # [B] int32
    chunk_lengths,  # [B] int32
    res,  # None or (k_res, v_res, res_pages, b_k, b_v, adapter_ids, inv_freq)
    layer,  # None or int32 scalar
    *,
    sm_scale,
    config: TritonConfig | None,
    interpret,
):
    layered = k_base.ndim == 5
    if layered != (layer is not None):
        raise ValueError("pass `layer` exactly when the pools carry a leading layer axis")
    B, T, Hq, D = q.shape
    Hkv, P, S, Dk = k_base.shape[-4:]
    if v_base.shape != k_base.shape:
        raise ValueError(f"k_base {k_base.shape} and v_base {v_base.shape} differ")
    if Dk != D:
        raise ValueError(f"head_dim of q ({D}) and of the pools ({Dk}) differ")
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    if D % 2:
        raise ValueError(f"head_dim {D} must be even (rotate-half RoPE)")
    if S & (S - 1):
        raise ValueError(f"page size {S} must be a power of two")
    if base_pages.ndim != 2 or base_pages.shape[0] != B:
        raise ValueError(f"base_pages {base_pages.shape} must be [B={B}, M]")
    M = base_pages.shape[1]
    G = Hq // Hkv
    dt = k_base.dtype
    residual = res is not None

    cfg = _resolve(config, q, k_base, base_pages, residual)
    block_q, block_k, k_splits = cfg.block_q, cfg.block_k, cfg.k_splits

    # Query rows: block_q tokens x Gp heads, at least 16 rows (dots with M < 16 are not safe).
    gp = next_pow2(G)
    if block_q * gp < 16:
        gp = 16 // block_q
    rows = block_q * gp
    t_pad = -(-T // block_q) * block_q
    n_qb = t_pad // block_q
    dp = max(16, next_pow2(D))
    ppb = block_k // S
    m_pad = -(-M // ppb) * ppb

    # q -> [B, Hkv, t_pad * gp, dp]
    qx = q.astype(dt).reshape(B, T, Hkv, G, D)
    qx = jnp.pad(qx, ((0, 0), (0, t_pad - T), (0, 0), (0, gp - G), (0, dp - D)))
    qx = qx.transpose(0, 2, 1, 3, 4).reshape(B, Hkv, t_pad * gp, dp)
    # Flat [.., Hkv, P * S, Dp] views (free reshapes) for the kernel's token-row gather.
    kb = pad_axis(k_base, -1, dp).reshape(k_base.shape[:-3] + (P * S, dp))
    vb = pad_axis(v_base, -1, dp).reshape(k_base.shape[:-3] + (P * S, dp))
    bpt = pad_axis(base_pages.astype(jnp.int32), 1, m_pad)
    prefix_lengths = prefix_lengths.astype(jnp.int32)
    chunk_lengths = chunk_lengths.astype(jnp.int32)

    grid = (Hkv, n_qb, k_splits, B)
    pool_block = (None, P * S, dp)
    if layered:
        pool_spec = pl.BlockSpec((k_base.shape[0],) + pool_block, lambda h, i, j, b: (0, h, 0, 0))
    else:
        pool_spec = pl.BlockSpec(pool_block, lambda h, i, j, b: (h, 0, 0))
    q_spec = pl.BlockSpec((None, None, rows, dp), lambda h, i, j, b: (b, h, i, 0))
    pt_spec = pl.BlockSpec((None, m_pad), lambda h, i, j, b: (b, 0))
    per_req = pl.BlockSpec((None,), lambda h, i, j, b: (b,))
    scalar = pl.BlockSpec((None,), lambda h, i, j, b: (0,))
    layer_arr = None if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)

    if residual:
        k_res, v_res, res_pages, b_k, b_v, adapter_ids, inv_freq = res
        R = k_res.shape[-1]
        if b_k.shape[1:] != (R, Hkv, D) or b_v.shape != b_k.shape:
            raise ValueError(f"b_k {b_k.shape} / b_v {b_v.shape} must be [A, R={R}, Hkv={Hkv}, D={D}]")
        if k_res.ndim != (4 if layered else 3) or v_res.shape != k_res.shape:
            raise ValueError(f"k_res {k_res.shape} / v_res {v_res.shape} must be [(L,) Pr, S, R]")
        if k_res.shape[-2] != S:
            raise ValueError(f"residual page size {k_res.shape[-2]} differs from base {S}")
        if inv_freq.shape != (D // 2,):
            raise ValueError(f"inv_freq {inv_freq.shape} must be [D//2={D // 2}]")
        rp = max(16, next_pow2(R))
        h = D // 2
        hp = max(16, next_pow2(h))
        kr, vr = flat_rows(k_res, rp), flat_rows(v_res, rp)
        rpool_spec = pl.BlockSpec(vr.shape, lambda h, i, j, b: (0,) * vr.ndim)
        rpt = pad_axis(res_pages.astype(jnp.int32), 1, m_pad)
        aid = adapter_ids.astype(jnp.int32)
        # Each request's B_v: applied after the split combine, outside the kernel (in the
        # kernel this one small dot set the register count, and so the occupancy, of the loop).
        bv_sel = b_v[aid].astype(jnp.float32)  # [B, R, Hkv, D]
        # Each request's B_k rotate-half column halves [B, Hkv, rp, hp] (a gather of a few KB),
        # query halves and RoPE tables for the in-loop reconstruction.
        bk = b_k.transpose(0, 2, 1, 3)[aid]  # [B, Hkv, R, D]
        bk1, bk2 = (pad_axis(pad_axis(x, 2, rp), 3, hp).astype(dt)
                    for x in (bk[..., :h], bk[..., h:]))
        qh = q.astype(dt).reshape(B, T, Hkv, G, D)

        def q_half(x):
            x = jnp.pad(x, ((0, 0), (0, t_pad - T), (0, 0), (0, gp - G), (0, hp - h)))
            return x.transpose(0, 2, 1, 3, 4).reshape(B, Hkv, t_pad * gp, hp)

        q1, q2 = q_half(qh[..., :h]), q_half(qh[..., h:])
        offc, offs = rope_cos_sin(jnp.arange(block_k), inv_freq)  # [block_k, h]
        offc, offs = (jnp.broadcast_to(pad_axis(x, -1, hp).astype(dt), (2, block_k, hp))
                      for x in (offc, offs))
        n_kv_blocks = m_pad // ppb
        blkc, blks = rope_cos_sin(jnp.arange(n_kv_blocks) * block_k, inv_freq)
        blkc, blks = pad_axis(blkc, -1, hp), pad_axis(blks, -1, hp)
        up_spec = pl.BlockSpec((None, None, rp, hp), lambda h, i, j, b: (b, h, 0, 0))
        qh_spec = pl.BlockSpec((None, None, rows, hp), lambda h, i, j, b: (b, h, i, 0))
        blk_spec = pl.BlockSpec((n_kv_blocks, hp), lambda h, i, j, b: (0, 0))
        off_spec = pl.BlockSpec((2, block_k, hp), lambda h, i, j, b: (0, 0, 0))
        res_args = (q1, q2, kr, vr, rpt, bk1, bk2, blkc, blks, offc, offs)
        res_specs = (qh_spec, qh_spec, rpool_spec, rpool_spec, pt_spec, up_spec, up_spec,
                     blk_spec, blk_spec, off_spec, off_spec)
    else:
        rp = 0
        res_args = (None,) * 11
        res_specs = (None,) * 11
    (q1, q2, kr, vr, rpt, bk1, bk2, blkc, blks, offc, offs) = res_args
    (q1_spec, q2_spec, kr_spec, vr_spec, rpt_spec, bk1_spec, bk2_spec,
     blkc_spec, blks_spec, offc_spec, offs_spec) = res_specs

    scale = (D ** -0.5 if sm_scale is None else sm_scale) * LOG2E
    normalize = k_splits == 1 and not residual
    if normalize:
        out_shape = jax.ShapeDtypeStruct((B, Hkv, t_pad * gp, dp), q.dtype)
        out_specs = q_spec
    else:
        out_shape = (
            jax.ShapeDtypeStruct((B, k_splits, Hkv, t_pad * gp, dp), jnp.float32),
            jax.ShapeDtypeStruct((B, k_splits, Hkv, t_pad * gp), jnp.float32),
            jax.ShapeDtypeStruct((B, k_splits, Hkv, t_pad * gp), jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((None, None, None, rows, dp), lambda h, i, j, b: (b, j, h, i, 0)),
            pl.BlockSpec((None, None, None, rows), lambda h, i, j, b: (b, j, h, i)),
            pl.BlockSpec((None, None, None, rows), lambda h, i, j, b: (b, j, h, i)),
        )
        if residual:
            out_shape += (jax.ShapeDtypeStruct((B, k_splits, Hkv, t_pad * gp, rp), jnp.float32),)
            out_specs += (pl.BlockSpec((None, None, None, rows, rp),
                                       lambda h, i, j, b: (b, j, h, i, 0)),)
    kernel = functools.partial(
        _attention_kernel, block_q=block_q, gp=gp, block_k=block_k, page_size=S,
        k_splits=k_splits, scale=scale, residual=residual, normalize=normalize,
        reconstruct_k=cfg.reconstruct_k, swap_ab=cfg.swap_ab)
    name = f"{'residual' if residual else 'unified'}_attention_bq{block_q}_bk{block_k}_ks{k_splits}"
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[q_spec, q1_spec, q2_spec, pool_spec, pool_spec, kr_spec, vr_spec, pt_spec,
                  rpt_spec, per_req, per_req, None if layer is None else scalar,
                  bk1_spec, bk2_spec, blkc_spec, blks_spec, offc_spec, offs_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=name,
    )(qx, q1, q2, kb, vb, kr, vr, bpt, rpt, prefix_lengths, chunk_lengths, layer_arr,
      bk1, bk2, blkc, blks, offc, offs)

    if not normalize:
        o, m, l = out[:3]
        out = combine_splits(o[..., :D], m, l, out[3][..., :R] if residual else None,
                             bv_sel if residual else None).astype(q.dtype)
    out = out.reshape(B, Hkv, t_pad, gp, -1)[:, :, :T, :G, :D]
    out = out.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    if T > 1:
        live = jnp.arange(T)[None, :] < chunk_lengths[:, None]
        out = jnp.where(live[:, :, None, None], out, jnp.zeros_like(out))
    return out


# ----------------------------------------------------------------------------------------------
# Entry points (api.py's "triton" backend; the arguments are api.py's)
# ----------------------------------------------------------------------------------------------


def residual_decode(q, k_base, v_base, k_res, v_res, base_pages, res_pages, lengths, b_k, b_v,
                    adapter_ids, inv_freq, *, sm_scale=None, interpret=False, layer=None,
                    config: TritonConfig | None = None):
    """ResidualAttention for one new token per request -> [B, Hq, D]: the kernel with one query
    token a program (block_q = 1)."""
    lengths = lengths.astype(jnp.int32)
    out = _paged_attention(
        q[:, None], k_base, v_base, base_pages, lengths - 1, jnp.ones_like(lengths),
        (k_res, v_res, res_pages, b_k, b_v, adapter_ids, inv_freq), layer,
        sm_scale=sm_scale, config=config, interpret=interpret)
    return out[:, 0]


def _merge_pages(k_base, v_base, base_pages, res, layer):
    """Rebuild merged K/V of each request's pages in HBM for the extend path.

    -> k, v [Hkv, B*M, S, D] (pool dtype) and a page table [B, M] over them. K = bK + RoPE(rK B_k)
    at each slot's position, V = bV + rV B_v, summed in float32 and rounded once.
    """
    k_res, v_res, res_pages, b_k, b_v, adapter_ids, inv_freq = res
    B, M = base_pages.shape
    Hkv, _, S, D = k_base.shape[-4:]
    h = D // 2
    f32 = jnp.float32

    def gather(pool, pages):  # one gather, also from a layered pool (never copies a layer)
        if pool.ndim == k_base.ndim:  # [(L,) Hkv, P, S, D] -> [B, M, Hkv, S, D]
            return pool[layer, :, pages] if layer is not None else pool[:, pages].transpose(
                1, 2, 0, 3, 4)
        return pool[layer, pages] if layer is not None else pool[pages]  # [B, M, S, R]

    hi = lax.Precision.HIGHEST
    y = jnp.einsum("bmsr,brhd->bmhsd", gather(k_res, res_pages).astype(f32),
                   b_k[adapter_ids].astype(f32), precision=hi)
    c, s = rope_cos_sin(jnp.arange(M * S), inv_freq)  # [M*S, D/2]
    c, s = c.reshape(M, 1, S, h), s.reshape(M, 1, S, h)
    y1, y2 = y[..., :h], y[..., h:]
    k = gather(k_base, base_pages).astype(f32) + jnp.concatenate(
        [y1 * c - y2 * s, y2 * c + y1 * s], axis=-1)
    v = gather(v_base, base_pages).astype(f32) + jnp.einsum(
        "bmsr,brhd->bmhsd", gather(v_res, res_pages).astype(f32),
        b_v[adapter_ids].astype(f32), precision=hi)

    def pages_of(x):  # [B, M, Hkv, S, D] -> [Hkv, B*M, S, D]
        return x.astype(k_base.dtype).transpose(2, 0, 1, 3, 4).reshape(Hkv, B * M, S, D)

    return pages_of(k), pages_of(v), jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)


def residual_extend(q, k_base, v_base, k_res, v_res, base_pages, res_pages, prefix_lengths,
                    chunk_lengths, b_k, b_v, adapter_ids, inv_freq, *, sm_scale=None,
                    interpret=False, layer=None, config: TritonConfig | None = None):
    """ResidualAttention for a chunk of new tokens per request (causal) -> [B, T, Hq, D].

    Two ways, same result. A prefill chunk is compute-bound: T queries share every key, so
    rebuilding the merged K/V of the requests' pages in HBM (O(L) bytes, tiny next to the
    O(T L) attention FLOPs) and running the unified kernel over them beats rebuilding each key
    on chip once per query block. Short chunks reconstruct on chip (no scratch, no extra pass).
    config.materialize=None: the first way for long chunks (MATERIALIZE_*).
    """
    res = (k_res, v_res, res_pages, b_k, b_v, adapter_ids, inv_freq)
    if _resolve(config, q, k_base, base_pages, True).materialize:
        k, v, pages = _merge_pages(k_base, v_base, base_pages, res, layer)
        return _paged_attention(q, k, v, pages, prefix_lengths, chunk_lengths, None, None,
                                sm_scale=sm_scale, config=config, interpret=interpret)
    return _paged_attention(q, k_base, v_base, base_pages, prefix_lengths, chunk_lengths, res,
                            layer, sm_scale=sm_scale, config=config, interpret=interpret)


def unified_decode(q, k_pages, v_pages, page_table, lengths, *, sm_scale=None, interpret=False,
                   layer=None, config: TritonConfig | None = None):
    """Plain paged GQA decode over a merged cache -> [B, Hq, D]."""
    lengths = lengths.astype(jnp.int32)
    out = _paged_attention(
        q[:, None], k_pages, v_pages, page_table, lengths - 1, jnp.ones_like(lengths), None,
        layer, sm_scale=sm_scale, config=config, interpret=interpret)
    return out[:, 0]


def unified_extend(q, k_pages, v_pages, page_table, prefix_lengths, chunk_lengths, *,
                   sm_scale=None, interpret=False, layer=None,
                   config: TritonConfig | None = None):
    """Plain paged causal attention for a chunk of new tokens per request -> [B, T, Hq, D]."""
    return _paged_attention(q, k_pages, v_pages, page_table, prefix_lengths, chunk_lengths,
                            None, layer, sm_scale=sm_scale, config=config, interpret=interpret)
