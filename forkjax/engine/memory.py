"""What the device's memory allows by default: how many sequences run at once (vLLM's
`max_num_seqs`), the KV budget, which is the free memory less the largest step's workspace, and
the host tier's budget.

The workspace is set aside before the pools are sized, because a step's temporaries (the
logits of its sampled rows, a scoring request's logits of every token, the activations of a
full prefill chunk, the extend kernels' merged K/V) are allocated only when the step runs: a
pool that took their room would make the first large step fail with an out-of-memory error
long after start-up.
"""

from __future__ import annotations

import math
import os

import jax

from forkjax.config import ModelConfig

DEFAULT_CPU_KV_BYTES = 256 << 20
CPU_MAX_BATCH = 16
# (least device memory, max_batch_size): a device of 40 GiB or more (A100-40G and up) runs 256
# sequences at once, as vLLM and SGLang do; smaller ones fewer, so that the KV pool left over
# still holds a useful context per sequence.
GPU_MAX_BATCH = ((40 << 30, 256), (16 << 30, 128), (0, 64))
# Share of the free device memory the engine takes (vLLM's gpu_memory_utilization): the rest
# is for XLA's allocator (fragmentation) and what the process allocates later.
MEMORY_UTILIZATION = 0.9
# The extend kernels rebuild merged K/V in HBM for chunks whose page tables span at most this
# many slots (kernels' materialising path); a larger span streams and needs no workspace.
MATERIALISED_SLOTS = 64 << 10


# The host tier by default (cache/host_pool.py): off on a CPU, where the host is the device; on a
# GPU this share of the host memory available at start, at most HOST_KV_RATIO times the device's
# KV budget (SGLang's HiCache default ratio, 2), so that the rest of the machine keeps its memory.
HOST_KV_SHARE = 0.5
HOST_KV_RATIO = 2
# Pinned host memory comes from XLA's host allocator, whose limit is PINNED_HOST_ENV GiB (64
# unless set; read when the GPU client starts). The host tier takes at most PINNED_HOST_SHARE of
# it: the rest is for the allocator's fragmentation (blocks of many power-of-two sizes) and for
# blocks freed while a copy still reads them.
PINNED_HOST_ENV, PINNED_HOST_DEFAULT_GIB, PINNED_HOST_SHARE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", 64, 0.8


def device_memory() -> tuple[int, int]:
    """(bytes the allocator may hand out, bytes in use) of the first device; (0, 0) where the
    platform does not say (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)


def default_max_batch_size(on_gpu: bool, device_bytes: int) -> int:
    if not on_gpu:
        return CPU_MAX_BATCH
    return next(b for least, b in GPU_MAX_BATCH if device_bytes >= least)


def step_workspace_bytes(cfg: ModelConfig, max_batch_size: int, max_prefill_tokens: int) -> int:
    """An upper bound of the device temporaries of the largest step, float32 throughout (the
    logits are; activations are bf16 by default): the sampled rows' logits and their processing
    (three [B, vocab] arrays), a scoring step's logits and log-probabilities of every token
    ([T, vocab] twice), hidden states returned for every layer ([L + 1, T, d]), one layer's
    activations at T tokens (q|k|v, gate|up, the MLP's product, three [T, d]), and the merged
    K/V an extend kernel may rebuild for one layer."""
    f32, t, v, d = 4, max_prefill_tokens, cfg.vocab_size, cfg.hidden_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    logits = 3 * max_batch_size * v * f32 + 2 * t * v * f32
    hidden = (cfg.num_layers + 1) * t * d * f32
    layer = t * (qkv + 3 * cfg.intermediate_size + 3 * d) * f32
    merged_kv = 2 * MATERIALISED_SLOTS * cfg.num_kv_heads * cfg.head_dim * f32
    return logits + hidden + layer + merged_kv


def host_memory_available() -> int:
    """Bytes of host memory available now (Linux's MemAvailable); 0 where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


def pinned_host_limit() -> int:
    """Bytes XLA's pinned host allocator may hand out (on a GPU)."""
    return int(float(os.environ.get(PINNED_HOST_ENV, PINNED_HOST_DEFAULT_GIB)) * (1 << 30))


def reserve_pinned_host(host_kv_bytes: int | None) -> None:
    """Raise XLA's pinned host limit so that a host tier of `host_kv_bytes` fits it. Call before
    jax starts its GPU client (the command-line entry points do, as they parse); a limit set in
    the environment stays as it is."""
    if host_kv_bytes and PINNED_HOST_ENV not in os.environ:
        gib = _pinned_gib(host_kv_bytes)
        if gib > PINNED_HOST_DEFAULT_GIB:
            os.environ[PINNED_HOST_ENV] = str(gib)


def _pinned_gib(host_kv_bytes: int) -> int:
    """The pinned host limit, in GiB, whose PINNED_HOST_SHARE holds `host_kv_bytes`."""
    return math.ceil(host_kv_bytes / PINNED_HOST_SHARE / (1 << 30))


def default_host_kv_bytes(on_gpu: bool, kv_bytes: int, available: int, pinned_limit: int) -> int:
    """The host tier's budget: 0 (off) on a CPU, else HOST_KV_SHARE of the `available` host
    bytes, at most HOST_KV_RATIO times the device KV budget `kv_bytes` and PINNED_HOST_SHARE of
    the pinned allocator's limit."""
    if not on_gpu:
        return 0
    return min(int(available * HOST_KV_SHARE), HOST_KV_RATIO * kv_bytes, int(PINNED_HOST_SHARE * pinned_limit))


def host_kv_bytes(requested: int | None, on_gpu: bool, kv_bytes: int) -> int:
    """`requested` host tier bytes, or the default where None. On a GPU a request past
    PINNED_HOST_SHARE of the pinned allocator's limit is an error: a copy would fail mid-run."""
    if requested is None:
        return default_host_kv_bytes(on_gpu, kv_bytes, host_memory_available(), pinned_host_limit())
    if on_gpu and requested > int(PINNED_HOST_SHARE * pinned_host_limit()):
        raise ValueError(f"host_kv_bytes={requested}: past {PINNED_HOST_SHARE:g} of XLA's pinned host memory "
                         f"limit ({pinned_host_limit() >> 30} GiB); set {PINNED_HOST_ENV}="
                         f"{_pinned_gib(requested)} before jax starts, or ask for less")
    return requested


def default_kv_cache_bytes(on_gpu: bool, free_bytes: int, workspace_bytes: int) -> int:
    """The KV budget: MEMORY_UTILIZATION of the free device memory less the step workspace
    (DEFAULT_CPU_KV_BYTES on a CPU, and at least that anywhere)."""
    if not on_gpu:
        return DEFAULT_CPU_KV_BYTES
    return max(int(free_bytes * MEMORY_UTILIZATION) - workspace_bytes, DEFAULT_CPU_KV_BYTES)


def check_kv_fits(kv_bytes: int, limit: int, in_use: int, workspace: int) -> None:
    """Refuse a KV budget of `kv_bytes` (per device) that the device's `limit` cannot hold beside
    the `in_use` bytes (the weights) and the largest step's `workspace`: the pools would
    allocate, and the first large step then fail with an out-of-memory error after retrying for
    a minute. `limit` 0 (a CPU: the platform does not say) checks nothing."""
    left = limit - in_use - workspace
    if limit and kv_bytes > left:
        raise ValueError(f"kv_cache_bytes={_gb(kv_bytes)} does not fit: the device has {_gb(limit)}, the "
                         f"weights take {_gb(in_use)} and the largest step's workspace {_gb(workspace)}: "
                         f"at most {_gb(max(left, 0))} is left for the KV cache (--kv-cache-bytes)")


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"
