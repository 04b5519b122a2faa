"""The inputs bench_kernels.py times and the calls it times on them, at the Llama-3-8B attention
shape (Hq 32, Hkv 8, D 128, page 16, rank 16, bf16): random pools with shuffled page tables,
the decode methods (ResidualAttention by backend, unified, jax's paged_attention, the naive
rebuild), and the bytes / FLOPs each point moves."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from forkjax.pallas_kernels import (MosaicConfig, TritonConfig, residual_attention_decode,
                                    unified_attention_decode)
from forkjax.pallas_kernels.paged_attention.api import backend_for
from forkjax.pallas_kernels.paged_attention.mosaic import mgpu_residual_decode, mgpu_unified_decode
from forkjax.rope import rope_cos_sin

HQ, HKV, D, S, R = 32, 8, 128, 16, 16
DT = jnp.bfloat16


def random_pools(keys, P):
    """Random base K/V [HKV, P, S, D] and residual K/V [P, S, R] pools from keys[0:4]."""
    return (jax.random.normal(keys[0], (HKV, P, S, D), DT), jax.random.normal(keys[1], (HKV, P, S, D), DT),
            jax.random.normal(keys[2], (P, S, R), DT), jax.random.normal(keys[3], (P, S, R), DT))


def make_decode(B, L, n_sets, seed=0):
    """Pools holding n_sets disjoint batches of B sequences of L tokens, shuffled page tables."""
    M = L // S
    P = n_sets * B * M + 1
    keys = jax.random.split(jax.random.key(seed), 8)
    kb, vb, kr, vr = random_pools(keys, P)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, P)).astype(np.int32)
    bpt = jnp.asarray(perm.reshape(n_sets, B, M))
    rpt = jnp.asarray(rng.permutation(np.arange(1, P)).astype(np.int32).reshape(n_sets, B, M))
    q = jax.random.normal(keys[4], (B, HQ, D), DT)
    A = 4
    bk = (jax.random.normal(keys[5], (A, R, HKV, D), jnp.float32) * 0.25).astype(DT)
    bv = (jax.random.normal(keys[6], (A, R, HKV, D), jnp.float32) * 0.25).astype(DT)
    aid = jnp.asarray(rng.integers(0, A, B).astype(np.int32))
    lengths = jnp.full((B,), L, jnp.int32)
    inv_freq = jnp.asarray((1.0 / 500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32))
    return dict(q=q, kb=kb, vb=vb, kr=kr, vr=vr, bpt=bpt, rpt=rpt, bk=bk, bv=bv, aid=aid,
                lengths=lengths, inv_freq=inv_freq)


def n_sets_for(B, L):
    per_set = B * L * HKV * D * 2 * 2
    return int(min(8, max(1, math.ceil(256e6 / per_set))))


def options(cfg) -> dict:
    """The options a kernel config sets ({} for None), as the benchmarks record them."""
    return {} if cfg is None else {k: v for k, v in dataclasses.asdict(cfg).items()
                                   if v is not None}


def residual_config_class(interpret: bool) -> type:
    """The config class of the backend `residual_attention_decode` picks at this shape."""
    sd = jax.ShapeDtypeStruct
    backend = backend_for("residual_attention_decode", sd((1, HQ, D), DT), sd((HKV, 1, S, D), DT),
                          sd((1, S, R), DT), interpret=interpret)
    return MosaicConfig if backend == "mosaic" else TritonConfig


def decode_fns(cfg_res=None, cfg_uni=None, interpret=False):
    """The decode methods by name; the residual ones run with config cfg_res, the unified ones
    with cfg_uni (None: the tuned defaults; a method takes its backend's config class)."""
    def residual_with(kernel):  # ResidualAttention decode over each page-table set
        return lambda d: [kernel(
            d["q"], d["kb"], d["vb"], d["kr"], d["vr"], d["bpt"][i], d["rpt"][i], d["lengths"],
            d["bk"], d["bv"], d["aid"], d["inv_freq"], config=cfg_res, interpret=interpret)
            for i in range(d["bpt"].shape[0])]

    def unified_with(kernel):  # unified decode over each page-table set
        return lambda d: [kernel(d["q"], d["kb"], d["vb"], d["bpt"][i], d["lengths"],
                                 config=cfg_uni, interpret=interpret)
                          for i in range(d["bpt"].shape[0])]

    def jax_paged(d):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as pa
        return [pa.paged_attention(d["q"], d["kb"], d["vb"], d["bpt"][i], d["lengths"],
                                   k_splits=4 if interpret else 16, interpret=interpret)
                for i in range(d["bpt"].shape[0])]

    def naive(d):
        """Rebuild merged K/V in HBM (XLA), then attend with the unified kernel (ForkKV §5.3)."""
        outs = []
        for i in range(d["bpt"].shape[0]):
            bpt, rpt = d["bpt"][i], d["rpt"][i]
            B, M = bpt.shape
            bk, bv = d["bk"][d["aid"]], d["bv"][d["aid"]]  # [B, R, Hkv, D]
            rk, rv = d["kr"][rpt], d["vr"][rpt]  # [B, M, S, R]
            y = jnp.einsum("bmsr,brhd->hbmsd", rk, bk)
            c, s = rope_cos_sin(jnp.arange(M * S), d["inv_freq"], full=True)  # [M*S, D]
            c, s = c.reshape(M, S, D).astype(DT), s.reshape(M, S, D).astype(DT)
            y_rot = jnp.concatenate([-y[..., D // 2:], y[..., :D // 2]], -1)
            k = d["kb"][:, bpt] + y * c + y_rot * s
            v = d["vb"][:, bpt] + jnp.einsum("bmsr,brhd->hbmsd", rv, bv)
            k = k.reshape(HKV, B * M, S, D)
            v = v.reshape(HKV, B * M, S, D)
            pt = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
            outs.append(unified_attention_decode(d["q"], k, v, pt, d["lengths"], config=cfg_uni,
                                                 interpret=interpret))
        return outs

    return {"residual": residual_with(residual_attention_decode),
            "triton_residual": residual_with(functools.partial(residual_attention_decode,
                                                               backend="triton")),
            "unified": unified_with(unified_attention_decode), "jax_paged": jax_paged,
            "naive": naive, "mgpu_residual": residual_with(mgpu_residual_decode),
            "mgpu_unified": unified_with(mgpu_unified_decode)}


def decode_bytes(B, L, residual):
    per_tok = HKV * D * 2 * 2 + (R * 2 * 2 if residual else 0)
    return B * L * per_tok + B * (L // S) * 4 * (2 if residual else 1)


def make_extend(prefix, T, seed=0):
    L = prefix + T
    M = -(-L // S)
    P = M + 1
    keys = jax.random.split(jax.random.key(seed), 8)
    kb, vb, kr, vr = random_pools(keys, P)
    rng = np.random.default_rng(seed)
    bpt = jnp.asarray(rng.permutation(np.arange(1, P)).astype(np.int32)[None])
    rpt = jnp.asarray(rng.permutation(np.arange(1, P)).astype(np.int32)[None])
    q = jax.random.normal(keys[4], (1, T, HQ, D), DT)
    bk = (jax.random.normal(keys[5], (2, R, HKV, D), jnp.float32) * 0.25).astype(DT)
    bv = (jax.random.normal(keys[6], (2, R, HKV, D), jnp.float32) * 0.25).astype(DT)
    inv_freq = jnp.asarray((1.0 / 500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32))
    return dict(q=q, kb=kb, vb=vb, kr=kr, vr=vr, bpt=bpt, rpt=rpt, bk=bk, bv=bv,
                aid=jnp.zeros((1,), jnp.int32), prefix=jnp.array([prefix], jnp.int32),
                chunk=jnp.array([T], jnp.int32), inv_freq=inv_freq)


def extend_flops(prefix, T):
    pairs = T * prefix + T * (T + 1) // 2  # causal (query, key) pairs actually attended
    return 4 * HQ * D * pairs
