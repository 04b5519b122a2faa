"""What a closed-loop run measured, whichever driver ran it: one record per LLM call, and the
throughput of the window from the first submit to the last finish."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    session_id: str
    turn: int
    adapter: str
    prompt_tokens: int
    output_tokens: int
    submit_s: float  # seconds since the run started
    finish_s: float  # when the driver learned the last token

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.submit_s


@dataclasses.dataclass(frozen=True)
class RunResult:
    workflows: int
    records: tuple[RequestRecord, ...]

    @property
    def first_submit_s(self) -> float:
        return min(r.submit_s for r in self.records)

    @property
    def last_finish_s(self) -> float:
        return max(r.finish_s for r in self.records)

    @property
    def window_s(self) -> float:
        return self.last_finish_s - self.first_submit_s

    @property
    def tasks_per_s(self) -> float:
        """Workflows finished per second of the window (ForkKV Fig. 11's tasks/s)."""
        return self.workflows / self.window_s

    @property
    def tokens_per_s(self) -> float:
        return sum(r.output_tokens for r in self.records) / self.window_s

    def summary(self) -> dict:
        lat = np.array([r.latency_s for r in self.records])
        return {"tasks_per_s": self.tasks_per_s, "tokens_per_s": self.tokens_per_s,
                "first_submit_s": self.first_submit_s, "last_finish_s": self.last_finish_s,
                "requests": len(self.records),
                "generated_tokens": sum(r.output_tokens for r in self.records),
                "latency_mean_s": float(lat.mean()), "latency_p50_s": float(np.percentile(lat, 50)),
                "latency_p99_s": float(np.percentile(lat, 99)),
                "latencies_s": [round(float(x), 6) for x in lat]}
