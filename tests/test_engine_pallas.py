"""The engine's Pallas path, interpreted on the CPU: the kernels as the engine calls them inside
the jitted step (layered pools, bucketed shapes, chunked prefill) give the reference path's
tokens. On the GPU the same path is compiled; these tests also run there."""

import numpy as np
import pytest

import forkjax
from conftest import SMALL

# The second prompt spans two prefill chunks (max_prefill_tokens=128); the first chunk of 90+
# tokens takes the materialising residual extend path, decode the residual decode kernel.
PROMPTS = [np.arange(35).tolist(), (np.arange(150) * 7 % 251).tolist()]
ADAPTERS = ["planner", "coder"]


def _tokens(policy, **kw):
    engine = forkjax.Engine.from_pretrained("tiny-llama", dtype="float32", cache_policy=policy,
                                            **SMALL, **kw)
    return engine.generate(PROMPTS, adapters=ADAPTERS, max_new_tokens=5, ignore_eos=True)


@pytest.mark.parametrize("policy,kw", [("forkkv", {}), ("prefix", {}),
                                       ("forkkv", dict(residual_fanout=True))])
def test_pallas_path_gives_the_reference_tokens(policy, kw):
    assert _tokens(policy, use_pallas=True, **kw) == _tokens(policy, use_pallas=False, **kw)
