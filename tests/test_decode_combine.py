"""The residual decode's one-split epilogue kernel (pallas_kernels/decode_combine.py) against
float64 numpy and against its XLA reference: interpreted on the CPU, compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkjax.pallas_kernels.decode_combine import residual_combine, residual_combine_reference

INTERPRET = jax.default_backend() != "gpu"


def _case(seed, B=3, Hkv=2, D=64, NQ=16, RB=64, R=16, N=5):
    rng = np.random.default_rng(seed)
    o_t = rng.standard_normal((B, 1, Hkv, D, NQ)).astype(np.float32)
    or_t = rng.standard_normal((B, 1, Hkv, RB, NQ)).astype(np.float32)
    or_t[..., R, :] = rng.uniform(0.5, 3.0, (B, 1, Hkv, NQ))  # l
    or_t[0, 0, 1, R, 2] = 0.0  # l = 0 (a row no key reached): divided by 1, not NaN
    b_v = rng.standard_normal((N, R, Hkv, D)).astype(np.float32)
    ids = rng.permutation(N)[:B].astype(np.int32)  # requests of shuffled adapter slots
    return o_t, or_t, b_v, ids


def _want(o_t, or_t, b_v, ids, G):
    """O = (O^T + B_v^T O_r^T)^T / l, float64."""
    B, _, Hkv, D, _ = o_t.shape
    R = b_v.shape[1]
    ot, ort, bv = (np.asarray(a, np.float64) for a in (o_t, or_t, b_v))
    out = np.zeros((B, Hkv, G, D))
    for b in range(B):
        for h in range(Hkv):
            l = ort[b, 0, h, R, :G]
            lora = ort[b, 0, h, :R, :G].T @ bv[ids[b], :, h, :]
            out[b, h] = (ot[b, 0, h, :, :G].T + lora) / np.where(l > 0, l, 1.0)[:, None]
    return out.reshape(B, Hkv * G, D)


@pytest.mark.parametrize("G,R,RB,D,dtype", [(4, 16, 64, 64, jnp.float32),
                                            (8, 32, 64, 128, jnp.bfloat16),
                                            (2, 16, 32, 64, jnp.float16)])
def test_residual_combine(G, R, RB, D, dtype):
    o_t, or_t, b_v, ids = _case(G + R, R=R, RB=RB, D=D)
    want = _want(o_t, or_t, np.asarray(jnp.asarray(b_v, dtype), np.float32), ids, G)
    args = (jnp.asarray(o_t), jnp.asarray(or_t), jnp.asarray(b_v, dtype), jnp.asarray(ids))
    got = residual_combine(*args, groups=G, dtype=dtype, interpret=INTERPRET)
    ref = residual_combine_reference(*args, groups=G, dtype=dtype)
    assert got.shape == (3, 2 * G, D) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # one rounding of the output
    for out in (got, ref):
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol)


def test_residual_combine_rejects_what_it_cannot_do():
    o_t, or_t, b_v, ids = _case(0)
    with pytest.raises(ValueError, match="one split"):  # two splits
        residual_combine(jnp.asarray(np.concatenate([o_t, o_t], 1)), jnp.asarray(or_t),
                         jnp.asarray(b_v), jnp.asarray(ids), groups=4, dtype=jnp.float32,
                         interpret=INTERPRET)
    with pytest.raises(ValueError, match="one split"):  # R + 1 = 17 rows of O_r^T needed
        residual_combine(jnp.asarray(o_t), jnp.asarray(or_t[..., :16, :]), jnp.asarray(b_v),
                         jnp.asarray(ids), groups=4, dtype=jnp.float32, interpret=INTERPRET)
