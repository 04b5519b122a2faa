"""ResidualAttention / unified paged attention (pallas_kernels/paged_attention/, through its
api.py) against an independent float64 numpy model.

On the CPU the kernels run in Pallas interpret mode (the Triton kernel: api.py's automatic
choice when interpreted); on a GPU the same tests run the compiled kernels the
automatic choice picks there, or the Triton kernel where a test passes a TritonConfig. Grids
are kept small so the CPU run stays short.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkjax.pallas_kernels import (
    TritonConfig,
    residual_attention_decode,
    residual_attention_decode_reference,
    residual_attention_extend,
    residual_attention_extend_reference,
    rope_cos_sin,
    unified_attention_decode,
    unified_attention_decode_reference,
    unified_attention_extend,
    unified_attention_extend_reference,
)
from attention_cases import decode_case, lower_for_h200, make_case, np_attention, rel_err

INTERPRET = jax.default_backend() != "gpu"
TOL = {np.float32: 1e-3, jnp.bfloat16: 2e-2}


def run_decode(c, **kw):
    return residual_attention_decode(
        c.q[:, 0], c.k_base, c.v_base, c.k_res, c.v_res, jnp.asarray(c.base_pages),
        jnp.asarray(c.res_pages), jnp.asarray(c.prefix + c.chunk), c.b_k, c.b_v,
        jnp.asarray(c.adapter_ids), jnp.asarray(c.inv_freq), interpret=INTERPRET, **kw)


def run_extend(c, **kw):
    return residual_attention_extend(
        c.q, c.k_base, c.v_base, c.k_res, c.v_res, jnp.asarray(c.base_pages),
        jnp.asarray(c.res_pages), jnp.asarray(c.prefix), jnp.asarray(c.chunk), c.b_k, c.b_v,
        jnp.asarray(c.adapter_ids), jnp.asarray(c.inv_freq), interpret=INTERPRET, **kw)


# ------------------------------------------------------------------ decode


@pytest.mark.parametrize("k_splits,reconstruct_k,swap_ab",
                         [(1, False, True), (4, True, True), (2, False, False)])
def test_decode_lengths_f32(k_splits, reconstruct_k, swap_ab):
    """Lengths 1, 37, 513 and page-aligned ones, mixed adapters (one v-only), NaN pages."""
    c = decode_case(0, [1, 37, 513, 512, 16, 48], dtype=np.float32)
    out = run_decode(c, config=TritonConfig(k_splits=k_splits, reconstruct_k=reconstruct_k,
                                            swap_ab=swap_ab))
    err = rel_err(out[:, None], np_attention(c), c.chunk)
    assert err < 1e-3, err


@pytest.mark.parametrize("r,group,dtype", [
    (1, 1, jnp.bfloat16),
    (8, 8, np.float32),
    (64, 4, jnp.bfloat16),
    (16, 8, jnp.bfloat16),
])
def test_decode_ranks_and_gqa(r, group, dtype):
    c = decode_case(1, [1, 37, 100, 64], r=r, group=group, dtype=dtype)
    out = run_decode(c, config=TritonConfig(k_splits=2))
    err = rel_err(out[:, None], np_attention(c), c.chunk)
    assert err < TOL[dtype], err


def test_decode_odd_head_dim():
    """head_dim 40 (not a power of two) goes through zero padding."""
    c = decode_case(2, [5, 37], d=40, r=4, group=2, dtype=np.float32)
    err = rel_err(run_decode(c)[:, None], np_attention(c), c.chunk)
    assert err < 1e-3, err


def test_decode_rejects_unknown_backend():
    c = decode_case(2, [5], dtype=np.float32)
    with pytest.raises(ValueError, match="backend must be"):
        run_decode(c, backend="cuda")


def test_decode_rope_far_from_zero():
    """Positions around 30k, peaked softmax: an error in the deferred RoPE shows up here."""
    c = decode_case(3, [30037], hkv=1, group=4, s=32, lora_scale=2.0, dtype=np.float32,
                    rope_base=500000.0)
    # Big blocks keep the interpreted loop short; on the GPU they would not fit shared memory.
    out = run_decode(c, sm_scale=0.5,
                     config=TritonConfig(block_k=512 if INTERPRET else 64, k_splits=4))
    err = rel_err(out[:, None], np_attention(c, sm_scale=0.5), c.chunk)
    assert err < 1e-3, err


def test_rope_tables_accurate():
    pos = np.array([0, 1, 63, 64, 4095, 4096, 30000, 30037, 131071, 1 << 20])
    inv = (1.0 / 10000.0 ** (np.arange(0, 128, 2) / 128)).astype(np.float32)
    c, s = rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv))
    ang = pos[:, None].astype(np.float64) * inv.astype(np.float64)[None, :]
    assert np.abs(np.asarray(c) - np.cos(ang)).max() < 2e-6
    assert np.abs(np.asarray(s) - np.sin(ang)).max() < 2e-6


# ------------------------------------------------------------------ extend


@pytest.mark.parametrize("dtype,reconstruct_k,materialize", [
    (np.float32, False, False), (jnp.bfloat16, True, False),
    (np.float32, None, True), (jnp.bfloat16, None, True)])
def test_extend(dtype, reconstruct_k, materialize):
    """Chunks over cached prefixes (0, 21, 500), page-unaligned, padded to T = 40; on-chip
    reconstruction and the materialising path (merged K/V rebuilt in HBM, then unified)."""
    c = make_case(4, prefix=[0, 21, 500], chunk=[37, 16, 13], T=40, dtype=dtype)
    out = run_extend(c, config=TritonConfig(block_q=8, k_splits=2, reconstruct_k=reconstruct_k,
                                            materialize=materialize))
    err = rel_err(out, np_attention(c), c.chunk)
    assert err < TOL[dtype], err


def test_extend_gqa1_rank1():
    c = make_case(5, prefix=[3, 40], chunk=[20, 9], T=20, group=1, r=1, dtype=np.float32)
    err = rel_err(run_extend(c, config=TritonConfig(block_q=16)), np_attention(c), c.chunk)
    assert err < 1e-3, err


@pytest.mark.parametrize("materialize", [False, True])
def test_chunked_prefill_matches_one_shot(materialize):
    """A 100-token prompt prefilled as chunks of 32 equals the float64 model token for token."""
    full = make_case(6, prefix=[0], chunk=[100], dtype=np.float32)
    ref = np_attention(full)
    outs = []
    for start in range(0, 100, 32):
        n = min(32, 100 - start)
        q = full.q[:, start:start + 32]
        if q.shape[1] < 32:
            q = jnp.pad(q, ((0, 0), (0, 32 - q.shape[1]), (0, 0), (0, 0)))
        part = dataclasses.replace(full, q=q, prefix=np.array([start], np.int32),
                                   chunk=np.array([n], np.int32))
        config = TritonConfig(block_q=16, materialize=materialize)
        outs.append(np.asarray(run_extend(part, config=config))[:, :n])
    out = np.concatenate(outs, axis=1)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 1e-3, err


# ------------------------------------------------------------------ unified (base only)


@pytest.mark.parametrize("dtype,swap_ab", [(np.float32, False), (jnp.bfloat16, True)])
def test_unified_decode(dtype, swap_ab):
    c = decode_case(7, [1, 37, 513, 256], dtype=dtype)
    out = unified_attention_decode(
        c.q[:, 0], c.k_base, c.v_base, jnp.asarray(c.base_pages), jnp.asarray(c.prefix + 1),
        interpret=INTERPRET, config=TritonConfig(k_splits=4, swap_ab=swap_ab))
    err = rel_err(out[:, None], np_attention(c, residual=False), c.chunk)
    assert err < TOL[dtype], err


def test_unified_extend():
    c = make_case(8, prefix=[0, 37, 130], chunk=[24, 5, 17], T=24, group=8, dtype=np.float32)
    out = unified_attention_extend(
        c.q, c.k_base, c.v_base, jnp.asarray(c.base_pages), jnp.asarray(c.prefix),
        jnp.asarray(c.chunk), interpret=INTERPRET, config=TritonConfig(block_q=8, k_splits=2))
    err = rel_err(out, np_attention(c, residual=False), c.chunk)
    assert err < 1e-3, err


# ------------------------------------------------------------------ layered pools, references


def test_layered_pools_match_single_layer():
    c = decode_case(9, [37, 70], dtype=np.float32)
    stack = lambda x: jnp.stack([x * 0.5 + 1.0, x, x * 2.0])  # noqa: E731  layer 1 is the case
    pt, rt, lens = (jnp.asarray(c.base_pages), jnp.asarray(c.res_pages),
                    jnp.asarray(c.prefix + 1))
    out = residual_attention_decode(
        c.q[:, 0], stack(c.k_base), stack(c.v_base), stack(c.k_res), stack(c.v_res), pt, rt,
        lens, c.b_k, c.b_v, jnp.asarray(c.adapter_ids), jnp.asarray(c.inv_freq),
        layer=jnp.int32(1), interpret=INTERPRET)
    err = rel_err(out[:, None], np_attention(c), c.chunk)
    assert err < 1e-3, err
    out_u = unified_attention_decode(c.q[:, 0], stack(c.k_base), stack(c.v_base), pt, lens,
                                     layer=1, interpret=INTERPRET)
    err = rel_err(out_u[:, None], np_attention(c, residual=False), c.chunk)
    assert err < 1e-3, err
    out_m = residual_attention_extend(  # the materialising path gathers from one layer
        c.q, stack(c.k_base), stack(c.v_base), stack(c.k_res), stack(c.v_res), pt, rt,
        jnp.asarray(c.prefix), jnp.asarray(c.chunk), c.b_k, c.b_v, jnp.asarray(c.adapter_ids),
        jnp.asarray(c.inv_freq), layer=jnp.int32(1), interpret=INTERPRET,
        config=TritonConfig(materialize=True))
    assert rel_err(out_m, np_attention(c), c.chunk) < 1e-3


def test_references_match_float64_model():
    c = make_case(10, prefix=[0, 21, 200], chunk=[37, 1, 9], T=37, dtype=np.float32)
    args = (c.k_base, c.v_base, c.k_res, c.v_res, jnp.asarray(c.base_pages),
            jnp.asarray(c.res_pages))
    lora = (c.b_k, c.b_v, jnp.asarray(c.adapter_ids), jnp.asarray(c.inv_freq))
    pre, chk = jnp.asarray(c.prefix), jnp.asarray(c.chunk)
    ref = np_attention(c)
    out = residual_attention_extend_reference(c.q, *args, pre, chk, *lora)
    assert rel_err(out, ref, c.chunk) < 1e-4
    ref_u = np_attention(c, residual=False)
    out_u = unified_attention_extend_reference(c.q, c.k_base, c.v_base, args[4], pre, chk)
    assert rel_err(out_u, ref_u, c.chunk) < 1e-4
    d = decode_case(11, [1, 37, 130], dtype=np.float32)
    dargs = (d.q[:, 0], d.k_base, d.v_base, d.k_res, d.v_res, jnp.asarray(d.base_pages),
             jnp.asarray(d.res_pages), jnp.asarray(d.prefix + 1), d.b_k, d.b_v,
             jnp.asarray(d.adapter_ids), jnp.asarray(d.inv_freq))
    out_d = residual_attention_decode_reference(*dargs)
    assert rel_err(out_d[:, None], np_attention(d), d.chunk) < 1e-4
    out_du = unified_attention_decode_reference(d.q[:, 0], d.k_base, d.v_base,
                                                jnp.asarray(d.base_pages),
                                                jnp.asarray(d.prefix + 1))
    assert rel_err(out_du[:, None], np_attention(d, residual=False), d.chunk) < 1e-4


# ------------------------------------------------------------------ lowering for the GPU


@pytest.mark.parametrize("kernel", ["residual_decode", "unified_decode", "residual_extend",
                                    "unified_extend"])
def test_kernels_lower_for_cuda(kernel):
    """The Pallas -> Triton lowering, which interpret mode skips, at the Llama-3-8B attention
    shape for an (abstract) H200: runs on the CPU-only jaxlib."""
    c = (decode_case(25, [300, 70], hkv=8, group=4, d=128, r=16, dtype=jnp.bfloat16)
         if kernel.endswith("decode") else
         make_case(25, prefix=np.array([40, 0]), chunk=np.array([30, 64]), hkv=8, group=4,
                   d=128, r=16, dtype=jnp.bfloat16))
    pages, res = (jnp.asarray(c.base_pages),), (jnp.asarray(c.res_pages),)
    lora = (c.b_k, c.b_v, jnp.asarray(c.adapter_ids), jnp.asarray(c.inv_freq))
    fn, args, kw = {
        "residual_decode": (residual_attention_decode, (
            c.q[:, 0], c.k_base, c.v_base, c.k_res, c.v_res, *pages, *res,
            jnp.asarray(c.prefix + 1), *lora), {"backend": "triton"}),  # (else Mosaic on a GPU)
        "unified_decode": (unified_attention_decode, (
            c.q[:, 0], c.k_base, c.v_base, *pages, jnp.asarray(c.prefix + 1)), {}),
        "residual_extend": (residual_attention_extend, (
            c.q, c.k_base, c.v_base, c.k_res, c.v_res, *pages, *res, jnp.asarray(c.prefix),
            jnp.asarray(c.chunk), *lora), {"config": TritonConfig(materialize=False)}),
        "unified_extend": (unified_attention_extend, (
            c.q, c.k_base, c.v_base, *pages, jnp.asarray(c.prefix), jnp.asarray(c.chunk)), {}),
    }[kernel]
    assert "triton" in lower_for_h200(functools.partial(fn, interpret=False, **kw), *args).lower()
