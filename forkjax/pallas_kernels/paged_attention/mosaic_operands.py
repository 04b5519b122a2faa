"""The Mosaic residual decode's operands and epilogue, as Triton kernels: one program per
(request, KV head) each, where XLA would run a few kernels of its own (a pad, a transpose, a
concatenation, a fusion) for each.

Prologue (`query_operands`): the kernel reads the query heads of a KV head padded to NQ rows and
the K-LoRA operand W [D, G*R] (mosaic.py's docstring) built from those heads and the request's
B_k. One program loads q's G rows and B_k's halves once and writes both.

    q       [B, Hkv * G, D]      RoPE applied
    b_k     [N, R, Hkv, D]       every adapter slot's B_k
    qx      [B, Hkv, NQ, D]      q's G heads, zero rows after
    w       [B, Hkv, D, G * R]   W[j, g*R + r] = q1_j b1_j + q2_j b2_j,
                                 W[D/2 + j, g*R + r] = q2_j b1_j - q1_j b2_j (q_g, b_r halves)

The engine's decode goes one step further (`decode_operands`): the same program starts from the
q|k|v GEMM's float32 output, adds q's LoRA (xA_q B_q of the row's slot), applies RoPE to q and
k, and also writes k, v and the row's xA_k, xA_v for the K/V write, rounding where the XLA ops
it replaces (a convert, the q LoRA expand and add, the RoPEs, the slices) round.

Epilogue (`residual_combine`): the Mosaic residual decode leaves its accumulators transposed,
per split-K split, O^T [D, NQ] and O_r^T [.., NQ] (row R: the softmax denominator l), with the G
real query heads in the first columns. The output is O = (O^T + B_v^T O_r^T)^T / l per
(request, KV head), B_v the request's adapter's, after the splits are rescaled to their common
maximum (flash-decoding, combine.py). One program reads its tiles once, applies B_v in float32
as a broadcast product summed over R, and writes [G, D] in the output dtype. With fewer than 16
programs XLA's combine (`residual_combine_reference`), spread over more SMs, is faster, and
mosaic.py runs that there (BENCHMARKS.md, Engine).

    o_t     [B, S, Hkv, D, NQ]   float32, O^T of each split
    or_t    [B, S, Hkv, RB, NQ]  float32, O_r^T (rows R+1.. unused; RB >= R + 1)
    ml      [B, S, Hkv, 2, NQ]   float32, row 0: each split's running maximum (base 2); None
                                 for one split
    b_v     [N, R, Hkv, D]       every adapter slot's B_v
    adapter_ids [B] int32
    out     [B, Hkv * G, D]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from forkjax.pallas_kernels.paged_attention.combine import combine_splits


def _store_w(w_ref, bk_ref, aid, h, q1, q2):
    """W [D, G*R] (the module docstring) of KV head h from q's halves q1, q2 [G, D/2] (float32
    values of the rows the attention kernel reads) and the request's B_k, whose halves are
    loaded from the ref (Triton lowers no slice of a value)."""
    half, f32 = q1.shape[1], jnp.float32
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    q1, q2 = (x.T[:, :, None] for x in (q1, q2))  # [D/2, G, 1]
    b1, b2 = (bk_ref[aid, :, h, part].astype(f32).T[:, None, :] for part in (lo, hi))
    w_ref[lo, :] = (q1 * b1 + q2 * b2).reshape(half, w_ref.shape[1]).astype(w_ref.dtype)
    w_ref[hi, :] = (q2 * b1 - q1 * b2).reshape(half, w_ref.shape[1]).astype(w_ref.dtype)


def _query_kernel(ids_ref, q_ref, bk_ref, qx_ref, w_ref, *, groups: int, rank: int):
    b, h = pl.program_id(0), pl.program_id(1)
    aid = ids_ref[b]
    n_q, d = qx_ref.shape
    half = d // 2
    dt = qx_ref.dtype
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    f32 = jnp.float32
    # q's halves, rounded to the pools' dtype first: W is built from the rows the kernel reads
    _store_w(w_ref, bk_ref, aid, h, *(q_ref[:, part].astype(dt).astype(f32) for part in (lo, hi)))
    rows = lax.broadcasted_iota(jnp.int32, (n_q, d), 0)
    qx = jnp.zeros((n_q, d), f32)
    for g in range(groups):
        qx = jnp.where(rows == g, q_ref[g, :].astype(dt).astype(f32)[None, :], qx)
    qx_ref[...] = qx.astype(dt)


def supported(groups: int, rank: int, head_dim: int) -> bool:
    """Both kernels need Triton's power-of-two blocks (else the XLA references run)."""
    return all(x & (x - 1) == 0 for x in (groups, rank, head_dim))


@functools.partial(jax.jit, static_argnames=("n_q", "dtype", "interpret"))
def query_operands(q, b_k, adapter_ids, *, n_q: int, dtype, interpret=False):
    """q [B, Hq, D], b_k [N, R, Hkv, D] -> qx [B, Hkv, n_q, D], W [B, Hkv, D, G*R] in `dtype`
    (see the module docstring)."""
    B, Hq, D = q.shape
    _, R, Hkv, _ = b_k.shape
    G = Hq // Hkv
    if not supported(G, R, D) or n_q < G:
        raise ValueError(f"query_operands: no kernel for G={G} R={R} D={D} n_q={n_q}")
    qx, w = pl.pallas_call(
        functools.partial(_query_kernel, groups=G, rank=R),
        grid=(B, Hkv),
        in_specs=[pl.BlockSpec((B,), lambda b, h: (0,)),
                  pl.BlockSpec((None, None, G, D), lambda b, h: (b, h, 0, 0)),
                  pl.BlockSpec(b_k.shape, lambda b, h: (0, 0, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, n_q, D), lambda b, h: (b, h, 0, 0)),
                   pl.BlockSpec((None, None, D, G * R), lambda b, h: (b, h, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, n_q, D), dtype),
                   jax.ShapeDtypeStruct((B, Hkv, D, G * R), dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="residual_query_operands",
    )(adapter_ids.astype(jnp.int32), q.reshape(B, Hkv, G, D), b_k)
    return qx, w


def query_operands_reference(q, b_k, adapter_ids, *, n_q: int, dtype):
    """The same in XLA ops."""
    B, Hq, D = q.shape
    _, R, Hkv, _ = b_k.shape
    G, h = Hq // Hkv, D // 2
    qg = q.astype(dtype).reshape(B, Hkv, G, D)
    qx = jnp.pad(qg, ((0, 0), (0, 0), (0, n_q - G), (0, 0)))
    qg = qg.astype(jnp.float32)
    bk = b_k[adapter_ids.astype(jnp.int32)].astype(jnp.float32)  # [B, R, Hkv, D], as gathered
    q1, q2, b1, b2 = qg[..., :h], qg[..., h:], bk[..., :h], bk[..., h:]  # [B, Hkv|R, G|Hkv, D/2]
    prod = functools.partial(jnp.einsum, "bhgj,brhj->bhjgr")
    w = jnp.concatenate([prod(q1, b1) + prod(q2, b2), prod(q2, b1) - prod(q1, b2)], 2)
    return qx, w.reshape(B, Hkv, D, G * R).astype(dtype)


def _decode_kernel(ids_ref, y_ref, cos_ref, sin_ref, *refs, groups: int, rank: int, cols):
    bq_ref = refs[0] if cols[3] is not None else None
    bk_ref, qx_ref, w_ref, kb_ref, vb_ref, kr_ref, vr_ref = refs[-7:]
    b, h = pl.program_id(0), pl.program_id(1)
    aid = ids_ref[b]
    n_q, d = qx_ref.shape
    half, G, R = d // 2, groups, rank
    c_q, c_k, c_v, a_q, a_k, a_v = cols
    dt, f32 = qx_ref.dtype, jnp.float32
    load = lambda idx: y_ref[b, idx].astype(dt).astype(f32)  # noqa: E731  (y rounded as XLA's)
    iota = functools.partial(lax.broadcasted_iota, jnp.int32)
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    cos1, cos2, sin1, sin2 = (ref[b, part].astype(f32)
                              for ref in (cos_ref, sin_ref) for part in (lo, hi))

    def rope(x1, x2):  # rotate-half RoPE of float32 halves [.., D/2], one rounding to dt
        return (x1 * cos1 - x2 * sin1).astype(dt), (x2 * cos2 + x1 * sin2).astype(dt)

    # q's G heads of KV head h as halves [G, D/2], gathered from the GEMM's row
    g_i, j_i = iota((G, half), 0), iota((G, half), 1)
    q_col = (h * G + g_i) * d + j_i
    q1, q2 = (load(c_q + q_col + off) for off in (0, half))
    if bq_ref is not None:  # + xA_q B_q, rounded as XLA's expand and add round it
        xa = load(pl.ds(a_q + aid * R, R))[:, None, None]  # [R, 1, 1]
        b_col = iota((R, G, half), 0) * (bq_ref.shape[1] // R) + q_col[None]
        q1, q2 = ((x + jnp.sum(xa * bq_ref[aid, b_col + off].astype(f32), axis=0)
                   .astype(dt).astype(f32)).astype(dt).astype(f32)
                  for x, off in ((q1, 0), (q2, half)))
    r1, r2 = rope(q1, q2)
    qx_ref[g_i, j_i] = r1
    qx_ref[g_i, j_i + half] = r2
    rows = iota((n_q, d), 0)
    plgpu.store(qx_ref, jnp.zeros((n_q, d), dt), mask=rows >= G)  # (rows < G: stored above)
    _store_w(w_ref, bk_ref, aid, h, r1.astype(f32), r2.astype(f32))  # from the rounded q
    kb_ref[lo], kb_ref[hi] = rope(*(load(pl.ds(c_k + h * d + off, half)) for off in (0, half)))
    vb_ref[...] = y_ref[b, pl.ds(c_v + h * d, d)].astype(dt)

    @pl.when(h == 0)
    def _():
        kr_ref[...] = y_ref[b, pl.ds(a_k + aid * R, R)].astype(dt)
        vr_ref[...] = y_ref[b, pl.ds(a_v + aid * R, R)].astype(dt)


@functools.partial(jax.jit, static_argnames=("heads", "cols", "n_q", "dtype", "num_warps",
                                             "interpret"))
def decode_operands(y, cos, sin, b_q, b_k, adapter_ids, *, heads, cols, n_q: int, dtype,
                    num_warps: int = 4, interpret=False):
    """One decode token per row: the Mosaic residual decode's operands and the K/V to write,
    straight from the q|k|v GEMM's output (`models.attention.QKV`), in `dtype`.

    y        [B, C]            xW + b of q | k | v, then every slot's xA of the parts with slots
                               (float32 as the GEMM leaves it: rounded to `dtype` as loaded)
    cos, sin [B, D]            RoPE of each row's position
    b_q      [N, R, Hq * D]    q's LoRA B, or None (q carries no slots)
    b_k      [N, R, Hkv, D]
    heads    (Hq, Hkv, D);  cols  (q, k, v, A_q | None, A_k, A_v): the first column of each in
             y, slot s's A columns at A + s * R
    -> qx [B, Hkv, n_q, D], W [B, Hkv, D, G * R] (as `query_operands` from the LoRA-applied,
       roped q), k [B, Hkv, D] roped, v [B, Hkv, D], xA_k [B, R], xA_v [B, R] of each row's slot
    num_warps: Triton warps a program (on the H200 at B=64, 2 and 4 about equally fast, 1 and 8
       slower: BENCHMARKS.md, Engine)
    """
    (Hq, Hkv, D), (B, _), R = heads, y.shape, b_k.shape[1]
    G, dt = Hq // Hkv, jnp.dtype(dtype)
    if not supported(G, R, D) or n_q < G or n_q & (n_q - 1):
        raise ValueError(f"decode_operands: no kernel for G={G} R={R} D={D} n_q={n_q}")
    full = lambda x: pl.BlockSpec(x.shape, lambda b, h: (0,) * x.ndim)  # noqa: E731
    ins = [adapter_ids.astype(jnp.int32), y, cos, sin]
    if b_q is not None:
        ins.append(b_q.reshape(b_q.shape[0], -1))
    ins.append(b_k)
    def at(*s):  # program (b, h)'s block of a [B, Hkv, *s] output
        return pl.BlockSpec((None, None) + s, lambda b, h: (b, h) + (0,) * len(s))

    row = pl.BlockSpec((None, R), lambda b, h: (b, 0))  # xA: written by the h = 0 programs
    return pl.pallas_call(
        functools.partial(_decode_kernel, groups=G, rank=R, cols=cols),
        grid=(B, Hkv),
        in_specs=[full(x) for x in ins],
        out_specs=[at(n_q, D), at(D, G * R), at(D), at(D), row, row],
        out_shape=[jax.ShapeDtypeStruct(s, dt) for s in ((B, Hkv, n_q, D), (B, Hkv, D, G * R),
                                                        (B, Hkv, D), (B, Hkv, D), (B, R), (B, R))],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="residual_decode_operands",
    )(*ins)


def _combine_kernel(ids_ref, o_ref, or_ref, *refs, groups: int, rank: int):
    """o_ref [S, D, NQ], or_ref [S, RB, NQ] (ml_ref [S, 2, NQ] with S > 1) -> out_ref [G, D]."""
    *ml_ref, bv_ref, out_ref = refs
    b, h = pl.program_id(0), pl.program_id(1)
    g = pl.ds(0, groups)
    splits = o_ref.shape[0]
    if splits == 1:
        w = [None]
    else:  # each split's weight exp2(m_s - max m); a split that saw no key has m = -huge: 0
        m = [ml_ref[0][s, 0, g] for s in range(splits)]  # [G] each
        m_max = functools.reduce(jnp.maximum, m)
        w = [jnp.exp2(x - m_max) for x in m]

    def total(part):  # sum over splits of w_s * part(s), part(s) [G] or [rows, G]
        return functools.reduce(jnp.add, [part(s) if w[s] is None else w[s] * part(s)
                                          for s in range(splits)])

    o_r = total(lambda s: or_ref[s, pl.ds(0, rank), g])  # [R, G]
    l = total(lambda s: or_ref[s, rank, g])  # [G]
    bv = bv_ref[ids_ref[b], :, h, :].astype(jnp.float32)  # [R, D]
    acc = total(lambda s: o_ref[s, :, g]).T + jnp.sum(o_r[:, :, None] * bv[:, None, :], axis=0)
    out_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("groups", "dtype", "interpret"))
def residual_combine(o_t, or_t, b_v, adapter_ids, ml=None, *, groups: int, dtype,
                     interpret=False):
    """-> [B, Hkv * groups, D] in `dtype` (see the module docstring)."""
    B, splits, Hkv, D, NQ = o_t.shape
    R = b_v.shape[1]
    rows = pl.next_power_of_2(R + 1)
    if ((ml is None) != (splits == 1) or or_t.shape[3] < rows or groups > NQ
            or not supported(groups, R, D)):
        raise ValueError(f"residual_combine: ml with (only) several splits, R + 1 <= O_r^T rows "
                         f"and powers of two, got o_t {o_t.shape}, or_t {or_t.shape}, "
                         f"ml {None if ml is None else ml.shape}, R={R}, groups={groups}")

    def split_block(rows_):  # [B, S, Hkv, rows_, NQ] -> the (request, KV head)'s [S, rows_, NQ]
        return pl.BlockSpec((None, splits, None, rows_, NQ), lambda b, h: (b, 0, h, 0, 0))

    in_specs = [pl.BlockSpec((B,), lambda b, h: (0,)), split_block(D), split_block(rows)]
    args = [adapter_ids.astype(jnp.int32), o_t, or_t]
    if ml is not None:
        in_specs.append(split_block(2))
        args.append(ml)
    out = pl.pallas_call(
        functools.partial(_combine_kernel, groups=groups, rank=R),
        grid=(B, Hkv),
        in_specs=in_specs + [pl.BlockSpec(b_v.shape, lambda b, h: (0, 0, 0, 0))],
        out_specs=pl.BlockSpec((None, None, groups, D), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, groups, D), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="residual_combine",
    )(*args, b_v)
    return out.reshape(B, Hkv * groups, D)


def residual_combine_reference(o_t, or_t, b_v, adapter_ids, ml=None, *, groups: int, dtype):
    """The same in XLA ops, for any shapes. Only the G real query columns are sliced out first,
    so the combine moves G/NQ of the data."""
    B, _, Hkv, D, _ = o_t.shape
    R = b_v.shape[1]
    o, o_r = o_t[..., :groups].swapaxes(-1, -2), or_t[..., :R, :groups].swapaxes(-1, -2)
    bv = b_v[adapter_ids.astype(jnp.int32)].astype(jnp.float32)  # [B, R, Hkv, D]
    m = jnp.zeros(o.shape[:-1], jnp.float32) if ml is None else ml[..., 0, :groups]
    out = combine_splits(o, m, or_t[..., R, :groups], o_r, bv)
    return out.reshape(B, Hkv * groups, D).astype(dtype)
