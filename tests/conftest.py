import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def hf_suite(tmp_path_factory):
    """Tiny random Llama (sharded) and Qwen2 checkpoints with PEFT adapters, built once."""
    from hf_utils import build_suite
    return build_suite(str(tmp_path_factory.mktemp("hf")))


@pytest.fixture(scope="session")
def engine_for(hf_suite):
    """engine_for(kind, dtype) -> a forkjax Engine over that checkpoint with all its adapters."""
    import forkjax

    @functools.lru_cache(maxsize=None)
    def make(kind, dtype):
        base, adapters = hf_suite[kind]
        return forkjax.Engine.from_pretrained(base, adapters=adapters, dtype=dtype)

    return make
