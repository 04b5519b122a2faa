"""The paged attention kernels' test cases and their independent reference: random paged
inputs (shuffled page tables, NaN in every slot no sequence owns, lengths that are not
page-aligned) and a token-by-token float64 numpy model of the contract (docs/design.md,
Public contracts, Kernels); lowering for an H200 on any machine."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.mesh import AbstractDevice

from forkjax.pallas_kernels.tuning import H200


# ------------------------------------------------------------------ float64 numpy model


def np_rope(y, pos, inv_freq):
    """HF rotate-half RoPE in float64. y [N, D], pos [N]."""
    ang = pos[:, None].astype(np.float64) * inv_freq.astype(np.float64)[None, :]
    c, s = np.cos(ang), np.sin(ang)
    h = y.shape[1] // 2
    y1, y2 = y[:, :h], y[:, h:]
    return np.concatenate([y1 * c - y2 * s, y2 * c + y1 * s], axis=1)


def np_attention(c, sm_scale=None, residual=True):
    """Token-by-token float64 model of the contract: out [B, T, Hq, D]."""
    f = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    q, kb, vb = f(c.q), f(c.k_base), f(c.v_base)
    B, T, Hq, D = q.shape
    Hkv, _, S, _ = kb.shape
    G = Hq // Hkv
    scale = D ** -0.5 if sm_scale is None else sm_scale
    out = np.zeros((B, T, Hq, D))
    for b in range(B):
        total = int(c.prefix[b] + c.chunk[b])
        t = np.arange(total)
        pages, slots = c.base_pages[b, t // S], t % S
        if residual:
            rpages = c.res_pages[b, t // S]
            rk, rv = f(c.k_res)[rpages, slots], f(c.v_res)[rpages, slots]
            a = int(c.adapter_ids[b])
        for h in range(Hkv):
            K, V = kb[h, pages, slots], vb[h, pages, slots]
            if residual:
                K = K + np_rope(rk @ f(c.b_k)[a, :, h, :], t, np.asarray(c.inv_freq))
                V = V + rv @ f(c.b_v)[a, :, h, :]
            for i in range(int(c.chunk[b])):
                pos = int(c.prefix[b]) + i
                qh = q[b, i, h * G:(h + 1) * G]  # [G, D]
                logits = qh @ K[:pos + 1].T * scale
                p = np.exp(logits - logits.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                out[b, i, h * G:(h + 1) * G] = p @ V[:pos + 1]
    return out


def rel_err(out, ref, chunk):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    live = np.arange(out.shape[1])[None, :] < np.asarray(chunk)[:, None]
    assert np.isfinite(out).all(), "non-finite output"
    assert (out[~live] == 0).all(), "padding rows must be zero"
    return np.linalg.norm(out[live] - ref[live]) / np.linalg.norm(ref[live])


# ------------------------------------------------------------------ random cases


@dataclasses.dataclass
class Case:
    q: jax.Array  # [B, T, Hq, D]
    k_base: jax.Array
    v_base: jax.Array
    k_res: jax.Array
    v_res: jax.Array
    base_pages: np.ndarray
    res_pages: np.ndarray
    prefix: np.ndarray
    chunk: np.ndarray
    b_k: jax.Array
    b_v: jax.Array
    adapter_ids: np.ndarray
    inv_freq: np.ndarray

    def res_args(self):
        return (self.k_res, self.v_res, jnp.asarray(self.base_pages), jnp.asarray(self.res_pages))


def make_case(seed, *, prefix, chunk, T=None, hkv=2, group=4, d=64, r=16, s=16, m=None,
              adapters=3, dtype=np.float32, lora_scale=1.0, rope_base=10000.0):
    """Shuffled page tables, NaN in every unused slot and in the pages past each sequence.

    Adapter 0 has k and v LoRA of full rank r, adapter 1 half rank, adapter 2 v-only (b_k = 0).
    """
    rng = np.random.default_rng(seed)
    prefix, chunk = np.asarray(prefix, np.int32), np.asarray(chunk, np.int32)
    B = len(prefix)
    T = int(chunk.max()) if T is None else T
    totals = prefix + chunk
    need = [-(-int(n) // s) for n in totals]
    m = max(need) if m is None else m
    n_pages = sum(need) + 2  # page 0: padding sink; page 1: NaN poison
    hq = hkv * group

    def pool(shape_tail, heads=None):
        shape = ((heads,) if heads else ()) + (n_pages, s) + shape_tail
        return rng.standard_normal(shape).astype(np.float32)

    kb, vb = pool((d,), hkv), pool((d,), hkv)
    kr, vr = pool((r,)), pool((r,))

    def tables(pools, res):
        perm = rng.permutation(np.arange(2, n_pages))
        pt = np.ones((B, m), np.int32)  # every unused entry -> the NaN page
        at = 0
        for b in range(B):
            pt[b, :need[b]] = perm[at:at + need[b]]
            at += need[b]
            used = int(totals[b])
            last = pt[b, need[b] - 1] if need[b] else None
            if last is not None and used % s:
                for p in pools:  # poison the unused tail slots of the last page
                    if res:
                        p[last, used % s:] = np.nan
                    else:
                        p[:, last, used % s:] = np.nan
        for p in pools:
            if res:
                p[1] = np.nan
            else:
                p[:, 1] = np.nan
        return pt

    base_pages = tables([kb, vb], res=False)
    res_pages = tables([kr, vr], res=True)
    bk = rng.standard_normal((adapters, r, hkv, d)).astype(np.float32) * lora_scale / np.sqrt(r)
    bv = rng.standard_normal((adapters, r, hkv, d)).astype(np.float32) * lora_scale / np.sqrt(r)
    if adapters > 1:
        bk[1, max(1, r // 2):] = 0
        bv[1, max(1, r // 2):] = 0
    if adapters > 2:
        bk[2] = 0  # v-only LoRA
    q = rng.standard_normal((B, T, hq, d)).astype(np.float32)
    q[np.arange(T)[None, :] >= chunk[:, None]] = np.nan  # padded query rows: must not matter
    inv_freq = (1.0 / rope_base ** (np.arange(0, d, 2) / d)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return Case(cast(q), cast(kb), cast(vb), cast(kr), cast(vr), base_pages, res_pages,
                prefix, chunk, cast(bk), cast(bv),
                rng.integers(0, adapters, B).astype(np.int32), inv_freq)


def decode_case(seed, lengths, **kw):
    lengths = np.asarray(lengths, np.int32)
    return make_case(seed, prefix=lengths - 1, chunk=np.ones_like(lengths), **kw)


def lower_for_h200(fn, *args) -> str:
    """StableHLO text of fn(*args) lowered for CUDA, on any machine: Triton's lowering asks for
    the GPU's kind, which an abstract device gives off the GPU."""
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=H200["core_count"], platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=h200)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
