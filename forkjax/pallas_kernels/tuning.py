"""Device facts the kernels size themselves by, and the device kind their tuned tables are keyed by:
read from the device on a GPU, the H200's values elsewhere (the CPU interpreter, ahead-of-time
lowering for an abstract H200), so that what runs off the GPU is what the H200 would run."""

from __future__ import annotations

import jax

# The H200's values, and the device attributes jax 0.11.2 exposes them as on a CUDA device
# (`core_count`: streaming multiprocessors; `shared_memory_per_block_optin`: the dynamic shared
# memory a CTA may opt into, 227 KiB on compute capability 9.0, as Mosaic GPU checks it).
H200 = {"core_count": 132, "shared_memory_per_block_optin": 232448}
H200_KIND = "NVIDIA H200"  # jax's `device_kind`


def on_gpu() -> bool:
    """Whether jax's default backend is a GPU."""
    return jax.default_backend() == "gpu"


def _fact(name: str) -> int:
    if on_gpu():
        value = getattr(jax.devices()[0], name, None)
        if value:
            return int(value)
    return H200[name]


def sm_count() -> int:
    """Streaming multiprocessors of the device (132 off a GPU)."""
    return _fact("core_count")


def smem_bytes() -> int:
    """Dynamic shared memory one CTA may use, in bytes (232448 off a GPU)."""
    return _fact("shared_memory_per_block_optin")


def device_kind() -> str:
    """The device's kind as jax names it ("NVIDIA H200" off a GPU)."""
    return jax.devices()[0].device_kind if on_gpu() else H200_KIND


def for_device(table: dict):
    """This device's entry of a table keyed by device kind: the H200's where its kind has none
    (every kernel's tuning so far is the H200's)."""
    return table.get(device_kind(), table[H200_KIND])
