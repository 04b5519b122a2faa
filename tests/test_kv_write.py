"""The Mosaic GPU K/V write kernel (pallas_kernels/kv_write/mosaic.py) against `write_kv`, the
XLA scatters it replaces: interpreted on the CPU, compiled on a GPU; lowered for CUDA on the CPU
at the Llama-3-8B shape with pools of over 2^31 elements."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkjax.pallas_kernels.kv_write import KVPools
from forkjax.pallas_kernels.kv_write.mosaic import kv_write, supports
from forkjax.pallas_kernels.kv_write.reference import write_kv

INTERPRET = jax.default_backend() != "gpu"


def _case(seed, residual, dtype, L=3, H=2, P=7, S=16, D=64, Pr=5, R=16, T=6, J=None):
    """J: residual rows a token (its own and fan-out's: res slots [T, J]); None: one, [T]."""
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    pools = KVPools(mk(L, H, P, S, D), mk(L, H, P, S, D), mk(L, Pr, S, R), mk(L, Pr, S, R))
    # distinct shuffled slots off the sink page, then a few tokens sent to the sink (slot 0)
    base = rng.permutation(np.arange(S, P * S))[:T].astype(np.int32)
    res = rng.permutation(np.arange(S, Pr * S))[:T * (J or 1)].astype(np.int32)
    base[2], res[4], res[1] = 0, 0, 0
    shape = (T,) if J is None else (T, J)
    rows = (mk(T, H, D), mk(T, H, D)) + ((mk(*shape, R), mk(*shape, R)) if residual else ())
    return pools, jnp.asarray(base), jnp.asarray(res.reshape(shape)), rows


def _off_sink(pools):
    """Every pool without its sink page (what two writers of the sink leave there is either's)."""
    return [np.asarray(p[:, :, 1:] if p.ndim == 5 else p[:, 1:], np.float32) for p in pools]


@pytest.mark.parametrize("residual,dtype,J", [(True, jnp.bfloat16, None), (False, jnp.float32, None),
                                             (True, jnp.bfloat16, 3)])
def test_kv_write_equals_the_scatters(residual, dtype, J):
    pools, base, res, rows = _case(0, residual, dtype, J=J)
    want = write_kv(pools, 1, base, res, *rows)
    before = _off_sink(pools)
    got = kv_write(KVPools(*[jnp.array(p) for p in pools]), 1, base, res, *rows,
                   interpret=INTERPRET)
    for w, g in zip(_off_sink(want), _off_sink(got)):
        np.testing.assert_array_equal(g, w)
    # the tokens really landed (and nothing else moved): T rows of base K changed, T·J - 2 of rK
    assert (_off_sink(got)[0] != before[0]).any(axis=(1, 4)).sum() == 5
    if residual:
        assert (_off_sink(got)[2] != before[2]).any(axis=(0, 3)).sum() == 6 * (J or 1) - 2


@pytest.mark.parametrize("J", [None, 5])
def test_kv_write_lowers_for_cuda_in_place_at_llama8b_scale(J):
    L, H, P, S, D, Pr, R, T = 32, 8, 70000, 16, 128, 9000, 16, 64  # base pools: 4.6e9 elements
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    pools = KVPools(sd(L, H, P, S, D), sd(L, H, P, S, D), sd(L, Pr, S, R), sd(L, Pr, S, R))
    slots = jax.ShapeDtypeStruct((T,), jnp.int32)
    fan = () if J is None else (J,)  # residual fan-out: J residual rows a token
    res_slots = jax.ShapeDtypeStruct((T, *fan), jnp.int32)
    text = kv_write.trace(pools, 5, slots, res_slots, sd(T, H, D), sd(T, H, D), sd(T, *fan, R),
                          sd(T, *fan, R)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "output_operand_aliases" in text  # the pools are written where they are


def test_supports_needs_16_byte_rows():
    pools, *_ = _case(0, True, jnp.bfloat16)
    assert supports(pools)
    assert not supports(pools._replace(res_k=pools.res_k[..., :4]))


def test_engine_uses_the_kernel_on_a_gpus_kernel_path(monkeypatch):
    from forkjax.runtime import paged_attention as pa
    from forkjax.pallas_kernels.kv_write import mosaic as kvw
    pools, *_ = _case(0, True, jnp.bfloat16)
    monkeypatch.setattr(pa.jax, "default_backend", lambda: "cpu")
    assert pa._kv_writer(True, pools) is write_kv  # off the GPU: XLA's scatters
    monkeypatch.setattr(pa.jax, "default_backend", lambda: "gpu")
    assert pa._kv_writer(True, pools) is kvw.kv_write
    assert pa._kv_writer(False, pools) is write_kv  # the reference path stays the reference
    assert pa._kv_writer(True, pools._replace(res_k=pools.res_k[..., :4])) is write_kv
