"""Mosaic GPU decode kernels (pallas_kernels/paged_attention/mosaic.py) against the float64
model: interpreted on the CPU
(the interpreter also checks the barrier protocol), compiled on a GPU. The interpreter ignores
layouts, tilings and TMA limits; lowering for CUDA, which works on a CPU-only jaxlib, checks them
(test_mgpu_lowers_for_cuda)."""

import functools

import jax
import jax.numpy as jnp
import pytest

from forkjax.pallas_kernels.paged_attention.mosaic import (
    MosaicConfig,
    mgpu_residual_decode,
    mgpu_unified_decode,
    query_rows,
)
from forkjax.pallas_kernels.paged_attention.mosaic_operands import query_operands_reference
from attention_cases import decode_case, lower_for_h200, np_attention, rel_err

INTERPRET = jax.default_backend() != "gpu"


def layered(pool):
    """[L=2, ...] pools whose layer 0 is NaN: the kernel must read only `layer=1`."""
    return jnp.stack([jnp.full_like(pool, jnp.nan), pool])


@pytest.mark.parametrize("lengths,group,d,k_splits,stages,consumers,layers", [
    ([1, 37, 130, 64], 4, 64, 2, 2, 2, False),
    ([200, 16, 513], 8, 128, 1, 4, 2, True),
    ([70, 300], 4, 128, 2, 3, 1, False),
])
def test_mgpu_unified_decode(lengths, group, d, k_splits, stages, consumers, layers):
    c = decode_case(21, lengths, group=group, d=d, dtype=jnp.bfloat16)
    kb, vb = (layered(c.k_base), layered(c.v_base)) if layers else (c.k_base, c.v_base)
    config = MosaicConfig(k_splits=k_splits, stages=stages, consumers=consumers)
    out = mgpu_unified_decode(c.q[:, 0], kb, vb, jnp.asarray(c.base_pages),
                              jnp.asarray(c.prefix + 1), layer=1 if layers else None,
                              config=config, interpret=INTERPRET)
    err = rel_err(out[:, None], np_attention(c, residual=False), c.chunk)
    assert err < 2e-2, err


@pytest.mark.parametrize("lengths,group,d,r,k_splits,stages,consumers,layers,ctas", [
    ([1, 37, 130, 64], 4, 64, 16, None, 2, 2, False, None),  # k_splits None: 3, one per block
    # 16 (request, KV head) items, 2 splits: the Triton combine of several splits
    ([1, 37, 130, 64, 200, 16, 90, 300], 4, 64, 16, 2, 2, 1, False, None),
    ([200, 16, 513], 8, 128, 16, 1, 2, 1, True, 4),
    ([700, 90], 1, 128, 32, 3, 3, 1, False, None),
    ([300, 90, 1], 12, 64, 16, 1, 3, 1, False, None),  # G = 12: the XLA operands and epilogue
    ([700, 90, 1], 4, 64, 16, 3, 3, 1, False, 5),
    ([700, 90, 1], 1, 128, 32, 3, 3, 1, False, 5),
])
def test_mgpu_residual_decode(lengths, group, d, r, k_splits, stages, consumers, layers, ctas):
    """Mixed adapters (one v-only), NaN-poisoned unused slots and pages, bf16; splits that get
    no key block (k_splits None here gives 3 for the 64-long and 1-long sequences too); fewer
    CTAs than items, so CTAs run items of different lengths in turn over one ring."""
    c = decode_case(22, lengths, group=group, d=d, r=r, dtype=jnp.bfloat16)
    pools = (c.k_base, c.v_base, c.k_res, c.v_res)
    if layers:
        pools = tuple(layered(x) for x in pools)
    out = mgpu_residual_decode(
        c.q[:, 0], *pools, jnp.asarray(c.base_pages), jnp.asarray(c.res_pages),
        jnp.asarray(c.prefix + 1), c.b_k, c.b_v, jnp.asarray(c.adapter_ids),
        jnp.asarray(c.inv_freq), layer=1 if layers else None,
        config=MosaicConfig(k_splits=k_splits, stages=stages, consumers=consumers, ctas=ctas),
        interpret=INTERPRET)
    err = rel_err(out[:, None], np_attention(c), c.chunk)
    assert err < 2e-2, err


def test_mgpu_residual_decode_from_operands():
    """(qx, W) built by the caller, as the engine's `decode_operands` builds them, for q."""
    c = decode_case(25, [200, 16, 513], group=4, d=128, r=16, dtype=jnp.bfloat16)
    ids = jnp.asarray(c.adapter_ids)
    ops = query_operands_reference(c.q[:, 0], c.b_k, ids, n_q=query_rows(4, True),
                                   dtype=jnp.bfloat16)
    out = mgpu_residual_decode(
        ops, c.k_base, c.v_base, c.k_res, c.v_res, jnp.asarray(c.base_pages),
        jnp.asarray(c.res_pages), jnp.asarray(c.prefix + 1), c.b_k, c.b_v, ids,
        jnp.asarray(c.inv_freq), config=MosaicConfig(k_splits=1), interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16 and out.shape == c.q[:, 0].shape
    err = rel_err(out[:, None], np_attention(c), c.chunk)
    assert err < 2e-2, err


@pytest.mark.parametrize("r,stages,consumers,match", [
    (8, 3, 1, "no kernel"),  # rank 8: no wgmma tiling for it
    (16, 4, 2, "shared memory"),  # 4 stages and two attention warpgroups exceed 227 KB
])
def test_mgpu_rejects_unsupported_configs(r, stages, consumers, match):
    c = decode_case(23, [20], group=4, d=128, r=r, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        mgpu_residual_decode(
            c.q[:, 0], c.k_base, c.v_base, c.k_res, c.v_res, jnp.asarray(c.base_pages),
            jnp.asarray(c.res_pages), jnp.asarray(c.prefix + 1), c.b_k, c.b_v,
            jnp.asarray(c.adapter_ids), jnp.asarray(c.inv_freq),
            config=MosaicConfig(stages=stages, consumers=consumers), interpret=INTERPRET)


def test_mgpu_supports_only_swizzled_u_widths():
    """U is [64, G*R] in shared memory: its rows must be 32, 64 or a multiple of 128 bytes."""
    from forkjax.pallas_kernels.paged_attention.mosaic import supports
    assert supports(32, 8, 128, 16, 16, jnp.bfloat16) and supports(96, 8, 64, 16, 16, jnp.bfloat16)
    assert not supports(24, 8, 64, 16, 16, jnp.bfloat16)  # G = 3: rows of 96 bytes
    assert not supports(40, 8, 64, 16, 16, jnp.bfloat16)  # G = 5: 160 bytes


def test_mgpu_fewer_ctas_than_items_needs_one_consumer():
    """Two consumers own alternate ring slots of one item: items in turn would shift them."""
    c = decode_case(23, [20, 90], group=4, d=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="consumers=1"):
        mgpu_unified_decode(c.q[:, 0], c.k_base, c.v_base, jnp.asarray(c.base_pages),
                            jnp.asarray(c.prefix + 1),
                            config=MosaicConfig(stages=2, consumers=2, ctas=2),
                            interpret=INTERPRET)


def test_mgpu_default_ctas():
    """One CTA per SM for one-consumer kernels with 1.5+ items an SM, else one per item (the
    device's SM count: 132 off a GPU)."""
    from forkjax.pallas_kernels.tuning import sm_count
    SMS = sm_count()

    def ctas(items, **kw):  # one split: an item a (request, KV head) pair
        return MosaicConfig(k_splits=1, **kw).resolve(True, items, 64).ctas
    assert ctas(512) == SMS and ctas(198) == SMS
    assert ctas(136) == 136  # B=1's split items: a CTA each
    assert ctas(512, consumers=2) == 512  # two consumers: one item a CTA
    assert ctas(512, ctas=7) == 7 and ctas(100, ctas=132) == 100  # never more than items


@pytest.mark.parametrize("residual,stages,consumers,ctas", [
    (False, 4, 2, None), (False, 3, 1, None), (True, 3, 1, None), (True, 2, 2, None),
    (True, 3, 1, 5),
])
def test_mgpu_lowers_for_cuda(residual, stages, consumers, ctas):
    """Mosaic GPU lowering (layout inference, wgmma operand tilings, TMA shapes) runs on the CPU
    when lowering for CUDA: the errors the interpreter cannot see, at the Llama-3-8B shape."""
    c = decode_case(24, [300, 70], hkv=8, group=4, d=128, r=16, dtype=jnp.bfloat16)
    pages = (jnp.asarray(c.base_pages),)
    if residual:
        config = MosaicConfig(stages=stages, consumers=consumers, ctas=ctas)
        fn = functools.partial(mgpu_residual_decode, config=config)
        args = (c.q[:, 0], c.k_base, c.v_base, c.k_res, c.v_res, *pages,
                jnp.asarray(c.res_pages), jnp.asarray(c.prefix + 1), c.b_k, c.b_v,
                jnp.asarray(c.adapter_ids), jnp.asarray(c.inv_freq))
    else:
        fn = functools.partial(mgpu_unified_decode,
                               config=MosaicConfig(stages=stages, consumers=consumers))
        args = (c.q[:, 0], c.k_base, c.v_base, *pages, jnp.asarray(c.prefix + 1))
    text = lower_for_h200(fn, *args)
    assert "mosaic_gpu" in text
    assert ("xla.gpu.triton" in text) == residual  # q's operands and (one split) the combine
