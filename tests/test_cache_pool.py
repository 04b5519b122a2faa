import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkjax.cache import PoolLayout
from forkjax.pallas_kernels.kv_write.reference import write_kv
from forkjax.runtime.kv_pools import allocate, copy_index_arrays, copy_pages

LLAMA8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, lora_rank=16, page_size=16)
GiB = 1 << 30


def test_page_bytes_and_budget_split_llama8b():
    lay = PoolLayout.from_budget(**LLAMA8B, kv_cache_bytes=40 * GiB, policy="forkkv")
    assert lay.base_page_bytes == 2 * 32 * 8 * 16 * 128 * 2  # 2 MiB: K and V, bf16
    assert lay.res_page_bytes == 2 * 32 * 16 * 16 * 2  # n/r = 64 times smaller
    assert lay.nbytes <= 40 * GiB
    assert 40 * GiB - lay.nbytes < lay.base_page_bytes + lay.res_page_bytes
    # Default split: one residual token slot per base token slot and adapter (one by default).
    assert lay.res_pages / lay.base_pages == pytest.approx(1, rel=1e-3)
    three = PoolLayout.from_budget(**LLAMA8B, kv_cache_bytes=40 * GiB, residual_copies=3)
    assert three.res_pages / three.base_pages == pytest.approx(3, rel=1e-3)
    assert three.res_pages * three.res_page_bytes / (40 * GiB) == pytest.approx(3 / 67, rel=1e-3)


def test_policies_without_residual_keep_a_sink_only_residual_pool():
    for policy in ("prefix", "full_reuse"):
        lay = PoolLayout.from_budget(**LLAMA8B, kv_cache_bytes=4 * GiB, policy=policy)
        assert lay.res_pages == 1
        assert lay.base_pages == (4 * GiB - lay.res_page_bytes) // lay.base_page_bytes


def test_residual_fraction_knob_and_lrshared_default():
    lay = PoolLayout.from_budget(**LLAMA8B, kv_cache_bytes=4 * GiB, residual_fraction=0.5)
    assert lay.res_pages * lay.res_page_bytes == pytest.approx(2 * GiB, rel=1e-4)
    lr = PoolLayout.from_budget(**LLAMA8B, kv_cache_bytes=4 * GiB, policy="lrshared")
    assert lr.res_pages / lr.base_pages == pytest.approx(1, rel=1e-2)
    with pytest.raises(ValueError, match="residual_fraction"):
        PoolLayout.from_budget(**LLAMA8B, kv_cache_bytes=4 * GiB, residual_fraction=1.0)


def test_too_small_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 2"):
        PoolLayout.from_budget(**LLAMA8B, kv_cache_bytes=3 << 20)


def _tiny(policy="forkkv"):
    lay = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=4, lora_rank=3, page_size=4, dtype="float32",
                     base_pages=6, res_pages=5, policy=policy)
    return lay, allocate(lay)


def test_allocate_shapes_and_dtype():
    lay, pools = _tiny()
    assert pools.base_k.shape == pools.base_v.shape == (2, 2, 6, 4, 4)  # [L, Hkv, P, S, D]
    assert pools.res_k.shape == pools.res_v.shape == (2, 5, 4, 3)  # [L, Pr, S, R]
    assert pools.base_k.dtype == jnp.float32
    assert lay.nbytes == sum(x.nbytes for x in pools)


@pytest.mark.parametrize("jit", [False, True])
def test_write_kv_scatters_by_slot_and_skips_to_the_sink(jit):
    lay, pools = _tiny()
    rng = np.random.default_rng(0)
    T = 5
    k, v = rng.standard_normal((2, T, 2, 4)).astype(np.float32)  # [T, Hkv, D]
    xk, xv = rng.standard_normal((2, T, 3)).astype(np.float32)  # [T, R]
    base_slots = np.array([5 * 4 + 1, 0, 2 * 4 + 3, 1 * 4 + 0, 0], np.int32)
    res_slots = np.array([0, 3 * 4 + 2, 4 * 4 + 0, 0, 1 * 4 + 1], np.int32)
    fn = jax.jit(write_kv) if jit else write_kv
    out = fn(pools, jnp.int32(1), base_slots, res_slots, k, v, xk, xv)

    want_bk = np.zeros(pools.base_k.shape, np.float32)
    want_rk = np.zeros(pools.res_k.shape, np.float32)
    for t in range(T):
        if base_slots[t]:
            want_bk[1, :, base_slots[t] // 4, base_slots[t] % 4] = k[t]
        if res_slots[t]:
            want_rk[1, res_slots[t] // 4, res_slots[t] % 4] = xk[t]
    # Page 0 receives the skipped writes; everything else must be exact.
    np.testing.assert_array_equal(np.asarray(out.base_k)[:, :, 1:], want_bk[:, :, 1:])
    np.testing.assert_array_equal(np.asarray(out.res_k)[:, 1:], want_rk[:, 1:])
    np.testing.assert_array_equal(np.asarray(out.base_v)[1, :, 2, 3], v[2])
    np.testing.assert_array_equal(np.asarray(out.res_v)[1, 1, 1], xv[4])
    assert not np.any(np.asarray(out.base_k)[0])  # other layer untouched


def test_write_kv_without_residual_leaves_the_residual_pool():
    _, pools = _tiny("prefix")
    k = jnp.ones((1, 2, 4))
    out = write_kv(pools, 0, jnp.array([4], jnp.int32), jnp.array([0], jnp.int32), k, k)
    assert out.res_k is pools.res_k and out.res_v is pools.res_v
    assert float(out.base_k[0, :, 1, 0].sum()) == 8.0


def test_copy_pages_copies_every_layer_and_padding_is_harmless():
    _, pools = _tiny()
    rng = np.random.default_rng(1)
    pools = type(pools)(*(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in pools))
    bsrc, bdst = copy_index_arrays([(2, 4)], 3)
    rsrc, rdst = copy_index_arrays([(1, 3), (2, 4)], 3)
    np.testing.assert_array_equal(bsrc, [2, 0, 0])
    out = jax.jit(copy_pages)(pools, bsrc, bdst, rsrc, rdst)
    np.testing.assert_array_equal(out.base_k[:, :, 4], pools.base_k[:, :, 2])
    np.testing.assert_array_equal(out.base_v[:, :, 4], pools.base_v[:, :, 2])
    np.testing.assert_array_equal(out.res_k[:, 3], pools.res_k[:, 1])
    np.testing.assert_array_equal(out.res_v[:, 4], pools.res_v[:, 2])
    np.testing.assert_array_equal(out.base_k[:, :, 1:4], pools.base_k[:, :, 1:4])


def test_copy_index_arrays_rejects_overflow():
    with pytest.raises(ValueError, match="bucket"):
        copy_index_arrays([(1, 2), (3, 4)], 1)
