"""The Mosaic residual decode's Triton operand and epilogue kernels (pallas_kernels/
paged_attention/mosaic_operands.py) against float64 numpy and against their XLA references:
interpreted on the CPU, compiled on a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkjax.pallas_kernels.paged_attention.mosaic import MASK_VALUE
from forkjax.pallas_kernels.paged_attention.mosaic_operands import (
    decode_operands,
    query_operands,
    query_operands_reference,
    residual_combine,
    residual_combine_reference,
    supported,
)
from attention_cases import lower_for_h200

INTERPRET = jax.default_backend() != "gpu"


def _case(seed, B=3, Hkv=2, D=64, NQ=16, RB=64, R=16, N=5, S=1):
    """The kernel's outputs for S splits: o_t, or_t (row R: l), ml (row 0: m), or None for one
    split; split 1 of request 1 saw no key (m = -huge, O, l = 0) when S > 1."""
    rng = np.random.default_rng(seed)
    o_t = rng.standard_normal((B, S, Hkv, D, NQ)).astype(np.float32)
    or_t = rng.standard_normal((B, S, Hkv, RB, NQ)).astype(np.float32)
    or_t[..., R, :] = rng.uniform(0.5, 3.0, (B, S, Hkv, NQ))  # l
    or_t[0, :, 1, R, 2] = 0.0  # l = 0 (a row no key reached): divided by 1, not NaN
    ml = None
    if S > 1:
        ml = rng.uniform(-4.0, 4.0, (B, S, Hkv, 2, NQ)).astype(np.float32)
        ml[0, :, 1, 0, 2] = MASK_VALUE
        ml[1, 1, :, 0, :] = MASK_VALUE
        o_t[1, 1], or_t[1, 1] = 0.0, 0.0
    b_v = rng.standard_normal((N, R, Hkv, D)).astype(np.float32)
    ids = rng.permutation(N)[:B].astype(np.int32)  # requests of shuffled adapter slots
    return o_t, or_t, b_v, ids, ml


def _want(o_t, or_t, b_v, ids, ml, G):
    """O = (sum_s w_s O_s^T + B_v^T sum_s w_s O_r,s^T)^T / sum_s w_s l_s, w_s = 2^(m_s - max m),
    float64."""
    B, S, Hkv, D, _ = o_t.shape
    R = b_v.shape[1]
    ot, ort, bv = (np.asarray(a, np.float64) for a in (o_t, or_t, b_v))
    m = np.zeros((B, S, Hkv, G)) if ml is None else np.asarray(ml, np.float64)[:, :, :, 0, :G]
    w = np.exp2(m - m.max(axis=1, keepdims=True))  # [B, S, Hkv, G]
    out = np.zeros((B, Hkv, G, D))
    for b in range(B):
        for h in range(Hkv):
            ws = w[b, :, h]  # [S, G]
            l = (ws * ort[b, :, h, R, :G]).sum(0)
            o = np.einsum("sg,sdg->gd", ws, ot[b, :, h, :, :G])
            o_r = np.einsum("sg,srg->gr", ws, ort[b, :, h, :R, :G])
            out[b, h] = (o + o_r @ bv[ids[b], :, h, :]) / np.where(l > 0, l, 1.0)[:, None]
    return out.reshape(B, Hkv * G, D)


@pytest.mark.parametrize("G,R,RB,D,S,dtype", [(4, 16, 64, 64, 1, jnp.float32),
                                              (8, 32, 64, 128, 1, jnp.bfloat16),
                                              (2, 16, 32, 64, 1, jnp.float16),
                                              (4, 16, 64, 128, 2, jnp.bfloat16),
                                              (4, 16, 32, 64, 5, jnp.float32)])
def test_residual_combine(G, R, RB, D, S, dtype):
    """One split, and several (the decode's small batches) with one that saw no key."""
    o_t, or_t, b_v, ids, ml = _case(G + R + S, R=R, RB=RB, D=D, S=S)
    want = _want(o_t, or_t, np.asarray(jnp.asarray(b_v, dtype), np.float32), ids, ml, G)
    args = (jnp.asarray(o_t), jnp.asarray(or_t), jnp.asarray(b_v, dtype), jnp.asarray(ids),
            None if ml is None else jnp.asarray(ml))
    got = residual_combine(*args, groups=G, dtype=dtype, interpret=INTERPRET)
    ref = residual_combine_reference(*args, groups=G, dtype=dtype)
    assert got.shape == (3, 2 * G, D) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # one rounding of the output
    for out in (got, ref):
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol)


def test_residual_combine_rejects_what_it_cannot_do():
    o_t, or_t, b_v, ids, _ = _case(0)
    two = jnp.asarray(np.concatenate([o_t, o_t], 1))
    for bad in ((two, jnp.asarray(np.concatenate([or_t, or_t], 1)), None),  # 2 splits, no ml
                (jnp.asarray(o_t), jnp.asarray(or_t), jnp.zeros((3, 1, 2, 2, 16))),  # ml, 1
                (jnp.asarray(o_t), jnp.asarray(or_t[..., :16, :]), None)):  # R + 1 = 17 rows
        with pytest.raises(ValueError, match="several splits"):
            residual_combine(bad[0], bad[1], jnp.asarray(b_v), jnp.asarray(ids), bad[2],
                             groups=4, dtype=jnp.float32, interpret=INTERPRET)


def _want_query(q, b_k, ids, n_q, dtype):
    """qx, W (mosaic_operands' docstring) in float64 from q rounded to `dtype`."""
    B, Hq, D = q.shape
    _, R, Hkv, _ = b_k.shape
    G, h = Hq // Hkv, D // 2
    qg = np.asarray(q if dtype == np.float64 else jnp.asarray(q, dtype), np.float64)
    qg = qg.reshape(B, Hkv, G, D)
    qx = np.zeros((B, Hkv, n_q, D))
    qx[:, :, :G] = qg
    w = np.zeros((B, Hkv, D, G * R))
    for b in range(B):
        for kv in range(Hkv):
            bk = np.asarray(b_k, np.float64)[ids[b], :, kv]  # [R, D]
            for g in range(G):
                q1, q2 = qg[b, kv, g, :h, None], qg[b, kv, g, h:, None]
                cols = slice(g * R, (g + 1) * R)
                w[b, kv, :h, cols] = q1 * bk[:, :h].T + q2 * bk[:, h:].T
                w[b, kv, h:, cols] = q2 * bk[:, :h].T - q1 * bk[:, h:].T
    return qx, w


@pytest.mark.parametrize("G,R,D,n_q,dtype", [(4, 16, 128, 16, jnp.bfloat16),
                                             (8, 32, 64, 16, jnp.float16),
                                             (2, 16, 64, 16, jnp.float32)])
def test_query_operands(G, R, D, n_q, dtype):
    rng = np.random.default_rng(G * R)
    B, Hkv, N = 3, 2, 5
    q = jnp.asarray(rng.standard_normal((B, Hkv * G, D)), jnp.float32)
    b_k = jnp.asarray(rng.standard_normal((N, R, Hkv, D)), dtype)
    ids = rng.permutation(N)[:B].astype(np.int32)  # requests of shuffled adapter slots
    want_qx, want_w = _want_query(q, b_k, ids, n_q, dtype)
    got = query_operands(q, b_k, jnp.asarray(ids), n_q=n_q, dtype=dtype, interpret=INTERPRET)
    ref = query_operands_reference(q, b_k, jnp.asarray(ids), n_q=n_q, dtype=dtype)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2  # one rounding of W
    for qx, w in (got, ref):
        assert qx.dtype == w.dtype == dtype
        np.testing.assert_array_equal(np.asarray(qx, np.float64), want_qx)  # exact copies
        np.testing.assert_allclose(np.asarray(w, np.float64), want_w, rtol=tol, atol=tol)


def test_query_operands_rejects_what_it_cannot_do():
    assert supported(4, 16, 128) and not supported(3, 16, 128)
    q, b_k = jnp.zeros((2, 6, 64)), jnp.zeros((3, 16, 2, 64))  # G = 3
    with pytest.raises(ValueError, match="no kernel for G=3"):
        query_operands(q, b_k, jnp.zeros(2, jnp.int32), n_q=16, dtype=jnp.float32,
                       interpret=INTERPRET)


def _decode_case(seed, G, R, D, q_lora, dtype, B=3, Hkv=2, N=4):
    """A q|k|v GEMM output y [B, C] (q | k | v | the A columns of q?, k, v for N slots)."""
    rng = np.random.default_rng(seed)
    Hq = Hkv * G
    parts = (("q",) if q_lora else ()) + ("k", "v")
    o = (Hq + 2 * Hkv) * D
    a = {p: o + i * N * R for i, p in enumerate(parts)}
    cols = (0, Hq * D, (Hq + Hkv) * D, a.get("q"), a["k"], a["v"])
    y = rng.standard_normal((B, o + len(parts) * N * R))
    ang = rng.uniform(0, 100, (B, D // 2))
    cos, sin = (np.concatenate([f(ang)] * 2, -1) for f in (np.cos, np.sin))
    b_q = rng.standard_normal((N, R, Hq * D)) / 4 if q_lora else None
    b_k = rng.standard_normal((N, R, Hkv, D))
    ids = (rng.permutation(N)[:B] if B <= N else rng.integers(0, N, B)).astype(np.int32)
    cast = lambda x: None if x is None else jnp.asarray(x, dtype)  # noqa: E731
    # y as the GEMM leaves it: float32
    args = (jnp.asarray(y, jnp.float32), cast(cos), cast(sin), cast(b_q), cast(b_k),
            jnp.asarray(ids))
    return args, dict(heads=(Hq, Hkv, D), cols=cols, dtype=dtype)


def _want_decode(y, cos, sin, b_q, b_k, ids, heads, cols, dtype, n_q):
    """decode_operands in float64 from its inputs (y rounded to `dtype`), no rounding inside."""
    f64 = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    y, cos, sin, b_q, b_k = map(f64, (jnp.asarray(y, dtype), cos, sin, b_q, b_k))
    (Hq, Hkv, D), (c_q, c_k, c_v, a_q, a_k, a_v) = heads, cols
    B, R, h = y.shape[0], b_k.shape[1], D // 2
    xa = lambda a: np.stack([y[b, a + ids[b] * R:a + (ids[b] + 1) * R] for b in range(B)])  # noqa

    def rope(x):  # [B, H, D]
        rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    q = y[:, c_q:c_q + Hq * D]
    if b_q is not None:
        q = q + np.einsum("br,brx->bx", xa(a_q), b_q[ids])
    qx, _ = _want_query(rope(q.reshape(B, Hq, D)), b_k, ids, n_q, np.float64)
    k = rope(y[:, c_k:c_k + Hkv * D].reshape(B, Hkv, D))
    return qx, k, y[:, c_v:c_v + Hkv * D].reshape(B, Hkv, D), xa(a_k), xa(a_v)


@pytest.mark.parametrize("G,R,D,q_lora,dtype", [(4, 16, 128, True, jnp.bfloat16),
                                                (8, 32, 64, False, jnp.bfloat16),
                                                (2, 16, 64, True, jnp.float32)])
def test_decode_operands(G, R, D, q_lora, dtype):
    """From the q|k|v GEMM's output: q with its adapter's LoRA and RoPE (padded, and W from it),
    roped K, V, and each row's own slot's xA of k and v; shuffled adapter slots."""
    args, static = _decode_case(G + R, G, R, D, q_lora, dtype)
    qx, w, *got = decode_operands(*args, **static, n_q=16, interpret=INTERPRET)
    want_qx, *want = _want_decode(*args, **static, n_q=16)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2  # bf16: q rounded after its LoRA and RoPE
    for name, x, ref in zip(("qx", "k", "v", "k_res", "v_res"), [qx] + got, [want_qx] + want):
        assert x.dtype == dtype and x.shape == ref.shape, name
        np.testing.assert_allclose(np.asarray(x, np.float64), ref, rtol=tol, atol=tol,
                                   err_msg=name)
    np.testing.assert_array_equal(np.asarray(qx[:, :, G:]), 0)  # padding rows
    for x, ref in zip(got[1:], want[1:]):  # v and the residuals are copies
        np.testing.assert_array_equal(np.asarray(x, np.float64), ref)
    # W is built from the q the attention kernel reads: qx as rounded (one rounding of W)
    q = np.asarray(qx[:, :, :G], np.float64).reshape(qx.shape[0], -1, qx.shape[-1])
    _, want_w = _want_query(q, args[4], np.asarray(args[5]), 16, np.float64)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(w, np.float64), want_w, rtol=tol, atol=tol)


def test_kernels_lower_for_cuda():
    """Triton lowering at the Llama-3-8B shape on any machine (the interpreter cannot see what
    Triton does not lower, a slice of a value for one)."""
    S = jax.ShapeDtypeStruct
    ids, b = S((64,), jnp.int32), S((9, 16, 8, 128), jnp.bfloat16)
    text = lower_for_h200(functools.partial(query_operands, n_q=16, dtype=jnp.bfloat16),
                          S((64, 32, 128), jnp.bfloat16), b, ids)
    # B=64 decode; B=1 and B=3 (several splits, 5 not a power of 2; D in 8 and 4 slices)
    for B, splits in ((64, 1), (1, 16), (3, 5)):
        text += lower_for_h200(
            functools.partial(residual_combine, groups=4, dtype=jnp.bfloat16),
            S((B, splits, 8, 128, 16), jnp.float32), S((B, splits, 8, 64, 16), jnp.float32),
            b, S((B,), jnp.int32), None if splits == 1 else S((B, splits, 8, 2, 16), jnp.float32))
    (y, cos, sin, b_q, b_k, ids), static = _decode_case(0, 4, 16, 128, True, jnp.bfloat16,
                                                        B=64, Hkv=8, N=9)  # y float32
    text += lower_for_h200(functools.partial(decode_operands, **static, n_q=16),
                           y, cos, sin, b_q, b_k, ids)
    assert text.count("xla.gpu.triton") == 5
