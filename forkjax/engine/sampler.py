"""Token sampling on the host: greedy, temperature, top-p, per-request seeded generators."""

from __future__ import annotations

import numpy as np


def validate_sampling(temperature: float, top_p: float):
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r}: expected a number >= 0")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r}: expected a number in (0, 1]")


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """logits [vocab] float32 -> one token id. temperature 0 is greedy (ties: lowest id)."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]  # smallest set reaching top_p
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return int(rng.choice(p.shape[0], p=p))
