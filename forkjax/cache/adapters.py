"""Adapter identity for cache keys, and the load-time check that `lrshared` is allowed.

The residual tree (and the base tree under `prefix`) is keyed by the adapter's *content*, not its
name: an adapter reloaded under the same name with different weights gets a new key and can never
hit the old entries (vLLM #30931 / #42125 served stale KV after such a reload). Reloading the
very same weights gives the same key, so that cache stays valid, as it should.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np


def adapter_fingerprint(tensors: Mapping[str, np.ndarray], config: Mapping | None = None) -> str:
    """sha256 hex of an adapter's tensors (names, dtypes, shapes, bytes) and optional config.

    Pass the config entries that change the cached values without changing the tensors (e.g. the
    LoRA scale when it is not folded into the tensors yet).
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    if config is not None:
        h.update(json.dumps(config, sort_keys=True, default=str).encode())
    return h.hexdigest()


def check_shared_lora_a(
    adapters: Mapping[str, Mapping[str, np.ndarray]],
    *,
    rtol: float = 1e-3,
    atol: float = 1e-6,
    projections: tuple[str, ...] = ("k_proj", "v_proj"),
) -> None:
    """Refuse `lrshared` unless every adapter has the same A on every k/v projection.

    adapters: name -> {module key like "layers.3.k_proj" -> A [d_in, r]}. Only modules whose last
    dotted component is in `projections` matter: the residual cache stores x·A_k and x·A_v only.
    Raises ValueError naming the adapters and the module that differ (target set, rank or values;
    values differ when max|A - A_ref| > atol + rtol·max|A_ref|).
    """
    names = sorted(adapters)
    if len(names) < 2:
        return

    def kv_modules(name: str) -> dict[str, np.ndarray]:
        return {k: np.asarray(a) for k, a in adapters[name].items() if k.rsplit(".", 1)[-1] in projections}

    ref_name = names[0]
    ref = kv_modules(ref_name)
    for name in names[1:]:
        other = kv_modules(name)
        if set(other) != set(ref):
            only_ref = sorted(set(ref) - set(other))
            only_other = sorted(set(other) - set(ref))
            raise ValueError(
                f"cache_policy='lrshared' needs adapters with the same k/v LoRA targets: "
                f"{ref_name!r} alone has {only_ref}, {name!r} alone has {only_other}"
            )
        for module in sorted(ref):
            a_ref, a = ref[module], other[module]
            if a.shape != a_ref.shape:
                raise ValueError(
                    f"cache_policy='lrshared' needs equal LoRA A shapes (ranks): module {module!r} is "
                    f"{a_ref.shape} in {ref_name!r} but {a.shape} in {name!r}"
                )
            a_ref64, a64 = a_ref.astype(np.float64), a.astype(np.float64)
            diff = float(np.max(np.abs(a64 - a_ref64), initial=0.0))
            scale = float(np.max(np.abs(a_ref64), initial=0.0))
            if diff > atol + rtol * scale:
                raise ValueError(
                    f"cache_policy='lrshared' needs adapters that share their A matrices: module "
                    f"{module!r} differs between {ref_name!r} and {name!r} (max |ΔA| = {diff:.3g}, "
                    f"allowed {atol + rtol * scale:.3g}); use cache_policy='forkkv' instead"
                )
