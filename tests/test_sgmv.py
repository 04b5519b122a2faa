"""The SGMV kernels (pallas_kernels/sgmv; interpreted on the CPU, compiled on a GPU) against a float64 numpy
reference, the plain-jnp reference beside them and the dense one-hot form the model runs, on
random groupings: empty slots, slots spanning blocks, blocks of several slots, padding rows."""

import jax.numpy as jnp
import numpy as np
import pytest

from forkjax.lora.batched import lora_expand, lora_shrink, slots_from_group_sizes
from forkjax.pallas_kernels.sgmv.reference import sgmv_expand_reference, sgmv_shrink_reference
from forkjax.pallas_kernels.sgmv.triton import SgmvConfig, sgmv_expand, sgmv_shrink
from forkjax.pallas_kernels.tuning import on_gpu

INTERPRET = not on_gpu()


def _grouping(rng, n, t, padding):
    """Random group sizes over n slots (a few empty) for t - padding tokens -> (sizes, slots)."""
    sizes = rng.multinomial(t - padding, rng.dirichlet(np.ones(n) * 0.5))
    sizes[rng.integers(n)] = 0
    sizes[0] += t - padding - sizes.sum()
    gs = jnp.asarray(sizes, jnp.int32)
    return sizes, slots_from_group_sizes(gs, t)


@pytest.mark.parametrize("seed", range(4))
def test_sgmv_matches_float64_and_the_dense_form(seed):
    rng = np.random.default_rng(seed)
    n, t, d_in, d_out, r = 6, 48, 96, 80, 16
    sizes, slots = _grouping(rng, n, t, padding=int(rng.integers(0, 9)))
    x = rng.standard_normal((t, d_in)).astype(np.float32)
    a = rng.standard_normal((n, r, d_in)).astype(np.float32)
    b = rng.standard_normal((n, r, d_out)).astype(np.float32)
    cfg = SgmvConfig.for_shapes(d_in, d_out, interpret=INTERPRET)
    assert (cfg.block_k, cfg.block_n) == (32, 16)  # several chunks and column blocks
    xa = sgmv_shrink(jnp.asarray(x), jnp.asarray(a), slots, cfg)
    y = sgmv_expand(xa, jnp.asarray(b), slots, cfg)
    s = np.asarray(slots)
    valid = s < n
    want_xa = np.where(valid[:, None], np.einsum("td,trd->tr", x.astype(np.float64),
                                                 a[np.minimum(s, n - 1)].astype(np.float64)), 0)
    want_y = np.einsum("tr,tro->to", np.asarray(xa, np.float64), b[np.minimum(s, n - 1)].astype(np.float64))
    want_y[~valid] = 0
    np.testing.assert_allclose(np.asarray(xa), want_xa, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(y)[~valid], 0)  # padding rows stay zero
    # the plain-jnp reference and the model's dense one-hot form agree
    np.testing.assert_allclose(np.asarray(sgmv_shrink_reference(jnp.asarray(x), jnp.asarray(a), slots)),
                               want_xa, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(sgmv_expand_reference(xa, jnp.asarray(b), slots)),
                               want_y, rtol=1e-4, atol=1e-4)
    gs = jnp.asarray(sizes, jnp.int32)
    dense = lora_expand(lora_shrink(jnp.asarray(x), jnp.asarray(a), gs, "highest"), jnp.asarray(b), "highest")
    np.testing.assert_allclose(np.asarray(y), np.asarray(dense), rtol=1e-4, atol=1e-3)


def test_sgmv_reads_only_each_tokens_slot():
    """A slot holding inf or NaN reaches no other slot's tokens (selected, never mixed)."""
    rng = np.random.default_rng(7)
    n, t, d = 4, 32, 64
    gs = jnp.asarray([10, 0, 14, 8], jnp.int32)
    slots = slots_from_group_sizes(gs, t)
    a = rng.standard_normal((n, 16, d)).astype(np.float32)
    b = rng.standard_normal((n, 16, d)).astype(np.float32)
    a[1], b[1] = np.inf, np.nan  # the empty slot
    a[3, 0, 0] = np.inf  # slot 3's tokens alone may see it
    cfg = SgmvConfig.for_shapes(d, d, interpret=INTERPRET)
    y = np.asarray(sgmv_expand(sgmv_shrink(jnp.ones((t, d)), jnp.asarray(a), slots, cfg),
                               jnp.asarray(b), slots, cfg))
    assert np.isfinite(y[:24]).all() and not np.isfinite(y[24:]).all()


def test_sgmv_refuses_shapes_it_does_not_run():
    x, slots = jnp.ones((16, 64)), jnp.zeros(16, jnp.int32)
    with pytest.raises(ValueError, match="stored rank 8"):
        sgmv_shrink(x, jnp.ones((2, 8, 64)), slots, SgmvConfig(interpret=INTERPRET))
    with pytest.raises(ValueError, match="multiple of block_t"):
        sgmv_shrink(x[:12], jnp.ones((2, 16, 64)), slots[:12], SgmvConfig(interpret=INTERPRET))
    with pytest.raises(ValueError, match="d_in=64"):
        sgmv_shrink(x, jnp.ones((2, 16, 64)), slots, SgmvConfig(block_k=128, interpret=INTERPRET))
