"""RoPE and RMSNorm against HF's own functions."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from forkjax.config import ModelConfig
from forkjax.models.layers import RMSNorm
from forkjax.rope import apply_rope, rope_cos_sin, rope_inv_freq


@pytest.mark.parametrize("head_dim,scaled", [(128, True), (24, True), (64, False), (20, False)])
def test_inv_freq_matches_hf(head_dim, scaled):
    params = {"rope_type": "default", "rope_theta": 500000.0}
    if scaled:
        params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 128}
    hf_cfg = transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2,
                                      head_dim=head_dim, rope_parameters=params,
                                      max_position_embeddings=4096)
    if scaled:
        ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    else:
        ref, _ = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)


def test_rope_is_hf_rotate_half_at_long_positions():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)
    pos = np.array([0, 17, 30000])
    inv = rope_inv_freq(8, 10000.0, None)
    cos, sin = rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv), jnp.float32, exact=False,
                            full=True)  # the model's tables
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    # HF forms the angle in float32 (so do we: at 30k it is off by ~1e-3 from exact); cos/sin
    # of that angle in float64 are the reference.
    ang = (pos[:, None].astype(np.float32) * inv[None, :]).astype(np.float64)  # [T, 4]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :4].astype(np.float64), x[..., 4:].astype(np.float64)
    ref = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    np.testing.assert_allclose(got, ref, rtol=0, atol=5e-5)


def test_rmsnorm_matches_hf():
    x = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32) * 3
    w = np.random.default_rng(2).standard_normal(16).astype(np.float32)
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.tensor(w))
        ref = hf(torch.tensor(x)).numpy()
    norm = RMSNorm(16, 1e-5, jnp.float32)
    norm.weight.set_value(jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), ref, rtol=1e-5, atol=1e-6)
