"""Byte sizes (forkjax/sizes.py): one reading for the engine's keywords and every script's flags,
and a KV budget the device cannot hold refused at start (engine/memory.py)."""

import argparse

import pytest

import bench_serving
import forkjax
from conftest import SMALL, bench_workflows
from forkjax.config import EngineConfig
from forkjax.engine import memory
from forkjax.fidelity.__main__ import parse_args as fidelity_args
from forkjax.sizes import parse_size, size_flag

GIB = 1 << 30

SIZES = [
    (268435456, 268435456), (0, 0), (60e9, 60 * 10**9), (1.9, 1),
    ("268435456", 268435456), (" 60e9 ", 60 * 10**9), ("1.5e9", 1_500_000_000), ("0.5", 0),
    ("60GB", 60 * 10**9), ("60 gb", 60 * 10**9), ("1.5kB", 1500), ("2MB", 2 * 10**6), ("3TB", 3 * 10**12),
    ("0.3GB", 300_000_000), ("2GiB", 2 * GIB), ("256MiB", 256 << 20), ("4KiB", 4096), ("1tib", 1 << 40),
    # vLLM's single letters: lower case decimal, upper case binary
    ("60g", 60 * 10**9), ("60G", 60 * GIB), ("256M", 256 << 20), ("256m", 256 * 10**6),
    ("4K", 4096), ("4k", 4000), ("1T", 1 << 40), ("1t", 10**12),
]
NOT_SIZES = [-1, -0.5, float("nan"), float("inf"), True, None, "", "12X", "GB", "1.5.3", "-1", "nan",
             "inf", "1e", "60 GBs", "4Kib2"]


@pytest.mark.parametrize("value,expected", SIZES)
def test_sizes(value, expected):
    assert parse_size(value) == expected and type(parse_size(value)) is int


@pytest.mark.parametrize("value", NOT_SIZES)
def test_not_sizes(value):
    with pytest.raises(ValueError, match=r"is not a size \(e\.g\. 268435456, 60e9, 16GB, 16GiB, 16G\)"):
        parse_size(value)
    if isinstance(value, str):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
            size_flag(value)


@pytest.mark.parametrize("text", ["16G", "60e9", "1.5GB", "256MiB", "268435456"])
def test_keywords_and_flags_agree(text):
    """The engine's keywords, the server's flags and the scripts' flags read a size the same way."""
    from forkjax.serve import parse_args
    config = EngineConfig(kv_cache_bytes=text, host_kv_bytes=text)
    argv = ["--kv-cache-bytes", text, "--host-kv-bytes", text]
    server = parse_args(argv)
    serving = bench_serving.build_parser().parse_args(argv)
    workflows = bench_workflows().build_parser().parse_args(argv)
    fidelity = fidelity_args(["--model", "m", "--lora", "a=d", "--prompts", "p", *argv[:2]])
    assert fidelity.kv_cache_bytes == parse_size(text)
    for args in (config, server, serving, workflows):
        assert args.kv_cache_bytes == args.host_kv_bytes == parse_size(text)
    with pytest.raises(SystemExit):  # argparse's usage error
        bench_serving.build_parser().parse_args(["--kv-cache-bytes", "12X"])


def test_engine_keywords_take_sizes():
    engine = forkjax.Engine.from_pretrained("tiny-llama", **{**SMALL, "kv_cache_bytes": "32M"})
    assert engine.config.kv_cache_bytes == 32 << 20
    engine.close()
    for kw in ("kv_cache_bytes", "host_kv_bytes"):
        with pytest.raises(ValueError, match=f"{kw}='12X': '12X' is not a size"):
            forkjax.Engine.from_pretrained("tiny-llama", **{**SMALL, kw: "12X"})
    with pytest.raises(ValueError, match="kv_cache_bytes=0: expected a positive int"):
        EngineConfig(kv_cache_bytes="0.4")  # rounds to 0 bytes
    assert EngineConfig(host_kv_bytes="0").host_kv_bytes == 0 and EngineConfig().kv_cache_bytes is None


def test_kv_budget_that_cannot_fit_is_refused():
    gb = 10**9
    memory.check_kv_fits(int(59.7 * gb), limit=int(79.1 * gb), in_use=int(16.1 * gb), workspace=int(3.2 * gb))
    memory.check_kv_fits(10**15, limit=0, in_use=0, workspace=gb)  # a CPU: the platform does not say
    with pytest.raises(ValueError) as e:
        memory.check_kv_fits(60 * gb, limit=int(79.1 * gb), in_use=int(16.1 * gb), workspace=int(3.2 * gb))
    assert str(e.value) == ("kv_cache_bytes=60.0 GB does not fit: the device has 79.1 GB, the weights take "
                            "16.1 GB and the largest step's workspace 3.2 GB: at most 59.8 GB is left for "
                            "the KV cache (--kv-cache-bytes)")
    with pytest.raises(ValueError, match="at most 0.0 GB is left"):
        memory.check_kv_fits(gb, limit=10 * gb, in_use=9 * gb, workspace=2 * gb)
