"""The workload of scripts/bench_serving.py: its requests (random token ids, lengths of a
dataset profile: bench_serving.py's docstring says which), their adapters and arrival times."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from forkjax.config import ModelConfig
from forkjax.workflows import TokenSampler

SHAREGPT = {"input": (161.31, 1.2), "output": (337.99, 0.8)}  # (mean tokens, log-space sigma)
SHAREGPT_CLIP = (4, 1024)


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    prompt: list[int]
    output_len: int
    adapter: str | None


def clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for ln X ~ N(mu, sigma²)."""
    cdf = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * (cdf(b - sigma) - cdf(a - sigma)) + lo * cdf(a) + hi * (1 - cdf(b))


def lognormal_lengths(rng, n: int, mean: float, sigma: float) -> np.ndarray:
    """n lognormal lengths clipped to SHAREGPT_CLIP whose clipped mean is `mean` (mu by
    bisection: the clipped mean grows with mu)."""
    lo, hi = SHAREGPT_CLIP
    a, b = math.log(lo) - 10 * sigma, math.log(hi) + 10 * sigma
    for _ in range(100):
        mid = (a + b) / 2
        a, b = (mid, b) if clipped_lognormal_mean(mid, sigma, lo, hi) < mean else (a, mid)
    return np.rint(np.clip(rng.lognormal(a, sigma, n), lo, hi)).astype(int)


def draw_lengths(args, rng) -> tuple[np.ndarray, np.ndarray]:
    n = args.num_prompts
    if args.dataset == "sharegpt":
        return tuple(lognormal_lengths(rng, n, *SHAREGPT[k]) for k in ("input", "output"))
    ratios = (args.range_ratio or 0.0, args.output_range_ratio or 0.0)
    return tuple(rng.integers(max(1, math.floor(m * (1 - r))), math.ceil(m * (1 + r)) + 1, n)
                 for m, r in zip((args.input_len, args.output_len), ratios))


def sample_requests(args, cfg: ModelConfig) -> list[SampleRequest]:
    rng = np.random.default_rng([args.seed, 0])
    tokens = TokenSampler.for_model(cfg)
    names = adapter_names(args.adapters)
    return [SampleRequest(tokens.draw(rng, int(i)), int(o), names[k % len(names)] if names else None)
            for k, (i, o) in enumerate(zip(*draw_lengths(args, rng)))]


def arrival_times(n: int, rate: float, seed: int) -> np.ndarray:
    """Seconds from t=0: Poisson arrivals at `rate` per second (the first at 0), all 0 if inf."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng([seed, 1]).exponential(1 / rate, n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def adapter_names(n: int) -> list[str]:
    return [f"lora{i}" for i in range(n)]


def workload(args, cfg: ModelConfig) -> tuple[list[SampleRequest], np.ndarray, int]:
    """-> (the requests, their arrival times, the engine's max_model_len: the longest request's
    length rounded up to 1024, which keeps a CPU engine's page tables small)."""
    reqs = sample_requests(args, cfg)
    longest = max(len(r.prompt) + r.output_len for r in reqs)
    if longest > cfg.max_position_embeddings:
        raise ValueError(f"a request of {longest} tokens exceeds {args.model}'s context of "
                         f"{cfg.max_position_embeddings}")
    max_model_len = min(-(-longest // 1024) * 1024, cfg.max_position_embeddings)
    return reqs, arrival_times(len(reqs), args.request_rate, args.seed), max_model_len
