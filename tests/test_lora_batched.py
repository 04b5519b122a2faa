"""The grouped multi-LoRA matmul against the naive per-token gather, on random groupings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkjax.lora.batched import lora_expand, lora_naive_reference, lora_shrink, slots_from_group_sizes


@pytest.mark.parametrize("seed", range(5))
def test_grouped_equals_naive(seed):
    rng = np.random.default_rng(seed)
    n, t, d_in, d_out, r = 5, 37, 24, 40, 8
    sizes = rng.multinomial(t - 3, np.ones(n) / n)  # some groups may be empty; 3 padding rows
    sizes[rng.integers(n)] = 0
    sizes[0] += t - 3 - sizes.sum()
    gs = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.standard_normal((t, d_in)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((n, r, d_in)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, r, d_out)), jnp.float32)
    got = lora_expand(lora_shrink(x, a, gs, "highest"), b, "highest")
    slots = slots_from_group_sizes(gs, t)
    valid = int(sizes.sum())
    np.testing.assert_array_equal(np.asarray(slots[:valid]), np.repeat(np.arange(n), sizes))
    ref = lora_naive_reference(x[:valid], a, b, slots[:valid])
    np.testing.assert_allclose(got[:valid], ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got[valid:]), 0)  # padding rows stay zero


def test_shrink_is_jittable_with_traced_group_sizes():
    x = jnp.ones((8, 4)); a = jnp.ones((2, 3, 4))
    f = jax.jit(lora_shrink)
    assert np.asarray(f(x, a, jnp.array([5, 3], jnp.int32))).shape == (8, 2, 3)
    rows = np.asarray(f(x, a, jnp.array([5, 3], jnp.int32)))
    np.testing.assert_allclose(rows[:5, 0], 4.0)  # tokens 0-4 in slot 0, 5-7 in slot 1
    np.testing.assert_allclose(rows[5:, 1], 4.0)
    np.testing.assert_array_equal(rows[:5, 1], 0)
    np.testing.assert_array_equal(rows[5:, 0], 0)
