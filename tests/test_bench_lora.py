"""scripts/bench_lora.py: each multi-LoRA formulation it times computes x·Wᵀ + x·A_s·B_s (or the
LoRA part alone) for each token's slot s, against float64 numpy."""

import importlib

import jax.numpy as jnp
import numpy as np

bench_lora = importlib.import_module("bench_lora")  # scripts/ is on sys.path (conftest.py)


def test_formulations_match_float64():
    t, n, r, d_in, d_out = 12, 3, 4, 16, 8
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((t, d_in)), rng.standard_normal((d_out, d_in))
    a, b = rng.standard_normal((n, d_in, r)), rng.standard_normal((n, r, d_out))
    gs = np.full(n, t // n, np.int32)
    slot = np.repeat(np.arange(n), gs)
    lora = np.einsum("ti,tir,tro->to", x, a[slot], b[slot])
    a_rows = a.transpose(0, 2, 1)  # [N, R, d_in]
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    got = {"grouped": bench_lora.grouped(f32(x), f32(a), f32(b), gs),
           "onehot": bench_lora.onehot(f32(x), f32(a_rows), f32(b), gs),
           "fused": bench_lora.fused(f32(x), f32(np.concatenate([w, a_rows.reshape(n * r, d_in)])),
                                     f32(b), gs) - f32(x @ w.T)}
    for name, y in got.items():
        np.testing.assert_allclose(np.asarray(y), lora, rtol=1e-4, atol=1e-4, err_msg=name)
