"""The kernels' backend registries (pallas_kernels/*/api.py): a backend by name runs that
backend, a name an op lacks or a call a backend cannot take raises a ValueError, a kernel config
runs the backend of its class (and must match a named one), and the automatic choice picks the
Mosaic kernels only on a GPU, compiled and where they support the shapes: Triton (or XLA's
scatters for the K/V write) everywhere else. The configs' tuned tables fill their None fields."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkjax.pallas_kernels.kv_write import KVPools
from forkjax.pallas_kernels.kv_write import api as kvw
from forkjax.pallas_kernels.kv_write import mosaic as kvw_mosaic
from forkjax.pallas_kernels.kv_write.reference import write_kv
from forkjax.pallas_kernels.paged_attention import api
from forkjax.pallas_kernels.paged_attention.api import MosaicConfig, TritonConfig
from forkjax.pallas_kernels.tuning import sm_count
from attention_cases import decode_case, make_case

sd = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
# Llama-3-8B's attention: Hq 32, Hkv 8, D 128, pages of 16, R 16 (the Mosaic kernel's shapes)
Q, KB, KR = sd((4, 32, 128), BF16), sd((8, 50, 16, 128), BF16), sd((50, 16, 16), BF16)


@pytest.fixture
def on_gpu(monkeypatch):
    """jax's default backend reads as a GPU (only what the checks see: nothing runs)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def _decode_args(c):
    return (c.q[:, 0], c.k_base, c.v_base, c.k_res, c.v_res, jnp.asarray(c.base_pages),
            jnp.asarray(c.res_pages), jnp.asarray(c.prefix + c.chunk), c.b_k, c.b_v,
            jnp.asarray(c.adapter_ids), jnp.asarray(c.inv_freq))


def _extend_args(c):
    return (c.q, c.k_base, c.v_base, c.k_res, c.v_res, jnp.asarray(c.base_pages),
            jnp.asarray(c.res_pages), jnp.asarray(c.prefix), jnp.asarray(c.chunk), c.b_k, c.b_v,
            jnp.asarray(c.adapter_ids), jnp.asarray(c.inv_freq))


def test_backend_reference_is_the_reference():
    d = decode_case(31, [1, 37, 70], dtype=np.float32)
    e = make_case(32, prefix=[0, 21], chunk=[9, 4], T=9, dtype=np.float32)
    da, ea = _decode_args(d), _extend_args(e)
    uni_d = (da[0], da[1], da[2], da[5], da[7])
    uni_e = (ea[0], ea[1], ea[2], ea[5], ea[7], ea[8])
    for fn, ref, args in (
            (api.residual_attention_decode, api.residual_attention_decode_reference, da),
            (api.residual_attention_extend, api.residual_attention_extend_reference, ea),
            (api.unified_attention_decode, api.unified_attention_decode_reference, uni_d),
            (api.unified_attention_extend, api.unified_attention_extend_reference, uni_e)):
        np.testing.assert_array_equal(np.asarray(fn(*args, backend="reference", sm_scale=0.3)),
                                      np.asarray(ref(*args, sm_scale=0.3)))


def test_unknown_or_unsupported_backends_raise():
    with pytest.raises(ValueError, match="backend must be None or one of 'triton', 'reference'"):
        api.backend_for("unified_attention_decode", Q, KB, backend="mosaic")
    with pytest.raises(ValueError, match="backend must be None or one of"):
        api.backend_for("residual_attention_extend", Q, KB, KR, backend="cuda")
    # the Mosaic kernel: bf16/f16 only, D 64 or 128
    for q, kb, kr in ((sd((4, 32, 128), jnp.float32), sd((8, 50, 16, 128), jnp.float32),
                       sd((50, 16, 16), jnp.float32)),
                      (sd((4, 8, 40), BF16), sd((2, 50, 16, 40), BF16), KR)):
        with pytest.raises(ValueError, match="backend 'mosaic' does not support"):
            api.backend_for("residual_attention_decode", q, kb, kr, backend="mosaic")
    c = decode_case(2, [5, 37], d=40, r=4, group=2, dtype=np.float32)  # as called, too
    with pytest.raises(ValueError, match="backend 'mosaic' does not support .*D=40"):
        api.residual_attention_decode(*_decode_args(c), backend="mosaic", interpret=True)
    pools = KVPools(sd((2, 2, 5, 16, 64), BF16), sd((2, 2, 5, 16, 64), BF16),
                    sd((2, 5, 16, 4), BF16), sd((2, 5, 16, 4), BF16))  # residual rows of 8 B
    with pytest.raises(ValueError, match="kv_write: backend 'mosaic' does not support"):
        kvw.kv_writer(pools, backend="mosaic")
    with pytest.raises(ValueError, match="backend must be None or one of 'mosaic', 'reference'"):
        kvw.kv_writer(pools, backend="triton")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="off a GPU only")
def test_automatic_choice_off_a_gpu_is_triton_and_xlas_scatters():
    for op in api.BACKENDS:
        for interpret in (True, False, None):
            assert api.backend_for(op, Q, KB, KR, interpret=interpret) == "triton"
    assert not api.fused_decode_supported((32, 8, 128), 16, 16, BF16, interpret=None)
    pools = KVPools(sd((2, 8, 5, 16, 128), BF16), sd((2, 8, 5, 16, 128), BF16), KR, KR)
    for interpret in (True, False, None):
        assert kvw.backend_for(pools, interpret=interpret) == "reference"
        assert kvw.kv_writer(pools, interpret=interpret) is write_kv


def test_automatic_choice_runs_what_it_names():
    """Interpreted off a GPU, the residual decode traces to the Triton backend's program."""
    args = _decode_args(decode_case(33, [5, 37], dtype=jnp.bfloat16))
    trace = lambda **kw: str(jax.make_jaxpr(  # noqa: E731
        functools.partial(api.residual_attention_decode, interpret=True, **kw))(*args))
    assert trace() == trace(backend="triton") != trace(backend="reference")


def test_automatic_choice_on_a_gpu(on_gpu):
    choose = functools.partial(api.backend_for, "residual_attention_decode")
    assert choose(Q, KB, KR) == "mosaic" == choose(Q, KB, KR, interpret=None)
    assert choose(Q, KB, KR, interpret=True) == "triton"  # the reliable interpreter
    assert choose(Q, KB, KR, config=TritonConfig(block_k=32)) == "triton"  # Triton's options
    assert choose(Q, KB, KR, config=TritonConfig(k_splits=4)) == "triton"
    assert choose(Q, KB, KR, config=MosaicConfig(k_splits=4)) == "mosaic"
    assert choose(sd((4, 8, 40), BF16), sd((2, 50, 16, 40), BF16), KR) == "triton"  # D = 40
    assert choose(Q, KB, KR, backend="reference") == "reference"
    for op in ("residual_attention_extend", "unified_attention_decode",
               "unified_attention_extend"):
        assert api.backend_for(op, Q, KB, KR) == "triton"
    assert api.fused_decode_supported((32, 8, 128), 16, 16, BF16)
    assert not api.fused_decode_supported((32, 8, 128), 16, 16, BF16, backend="triton")
    assert not api.fused_decode_supported((32, 8, 128), 16, 16, BF16, backend="reference")
    assert not api.fused_decode_supported((96, 8, 64), 16, 16, BF16)  # G = 12: Mosaic, not fused
    pools = KVPools(sd((2, 8, 5, 16, 128), BF16), sd((2, 8, 5, 16, 128), BF16), KR, KR)
    assert kvw.kv_writer(pools) is kvw_mosaic.kv_write
    assert kvw.kv_writer(pools, interpret=True) is write_kv
    assert kvw.kv_writer(pools, backend="reference") is write_kv
    small = pools._replace(res_k=sd((2, 5, 16, 4), BF16))
    assert kvw.kv_writer(small) is write_kv


def test_configs_pick_their_backend_and_must_match_a_named_one():
    choose = functools.partial(api.backend_for, "residual_attention_decode", Q, KB, KR)
    for op in api.BACKENDS:
        assert api.backend_for(op, Q, KB, KR, config=TritonConfig(k_splits=2)) == "triton"
    assert choose(config=MosaicConfig()) == "mosaic" == choose(config=MosaicConfig(),
                                                                 interpret=True)
    for backend, config, match in (
            ("triton", MosaicConfig(), "backend 'triton' takes a TritonConfig, not a MosaicConfig"),
            ("mosaic", TritonConfig(), "backend 'mosaic' takes a MosaicConfig, not a TritonConfig"),
            ("reference", TritonConfig(), "backend 'reference' takes no config, not a Triton")):
        with pytest.raises(ValueError, match=match):
            choose(backend=backend, config=config)
    with pytest.raises(ValueError, match="unified_attention_decode: no backend takes a Mosaic"):
        api.backend_for("unified_attention_decode", Q, KB, config=MosaicConfig())
    with pytest.raises(ValueError, match="backend 'mosaic' does not support .*D=40"):
        api.backend_for("residual_attention_decode", sd((4, 8, 40), BF16),
                        sd((2, 50, 16, 40), BF16), KR, config=MosaicConfig())
    with pytest.raises(ValueError, match="backend 'mosaic' does not support"):  # shared memory
        choose(config=MosaicConfig(stages=4, consumers=2))
    c = decode_case(2, [5, 37], dtype=np.float32)  # as called, too
    with pytest.raises(ValueError, match="takes a TritonConfig, not a MosaicConfig"):
        api.residual_attention_decode(*_decode_args(c), backend="triton", config=MosaicConfig(),
                                      interpret=True)


def test_tuned_tables_fill_none_fields():
    """Off a GPU (and for device kinds without an entry) the H200's values; given fields stay.
    Configs are frozen and hashable: static arguments of the jitted functions."""
    shape = dict(batch=4, kv_heads=8, group=4, page_size=16)
    decode = TritonConfig().resolve(residual=True, tokens=1, pages=50, **shape)
    assert decode == TritonConfig(block_q=1, block_k=64, k_splits=13, num_warps=4, num_stages=2,
                                  reconstruct_k=False, swap_ab=True, materialize=False)
    extend = TritonConfig(block_k=16, swap_ab=True).resolve(residual=True, tokens=64, pages=8,
                                                           **dict(shape, batch=1))
    assert extend == TritonConfig(block_q=16, block_k=16, k_splits=8, num_warps=4, num_stages=2,
                                  reconstruct_k=True, swap_ab=True, materialize=True)
    unified = TritonConfig().resolve(residual=False, tokens=100, pages=64, **dict(shape, batch=2))
    assert unified == TritonConfig(block_q=32, block_k=64, k_splits=16, num_warps=4, num_stages=2,
                                   reconstruct_k=True, swap_ab=False, materialize=False)
    splits = sm_count() // 32
    assert MosaicConfig().resolve(True, 32, 128) == MosaicConfig(
        k_splits=splits, stages=3, consumers=1, ctas=32 * splits)
    assert MosaicConfig(ctas=7).resolve(False, 32, 128) == MosaicConfig(
        k_splits=1, stages=4, consumers=2, ctas=7)
    config = TritonConfig(block_k=32)
    assert hash(config) == hash(TritonConfig(block_k=32)) and {config: 1}[TritonConfig(block_k=32)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_k = 64
