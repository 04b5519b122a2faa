"""What a closed-loop run measured, whichever driver ran it: one record per LLM call, the
throughput of the whole run (makespan) and of its steady state.

A run of N slots and M workflows (loop.py) starts N workflows at t=0 and a new one whenever one
finishes, until M have started. Let s_1 <= ... <= s_M be the workflows' start times (a
workflow's first submit) and f_1 <= ... <= f_M their finish times (its last call's finish).

    tasks_per_s            = M / (f_M - s_1)                  the makespan figure (ForkKV Fig. 11)
    tasks_per_s_steady     = #{i : s_N < f_i <= f_{M-N}} / (f_{M-N} - s_N)
    tasks_per_s_sustained  = #{calls finishing in (f_N, f_{M-N}]} / (calls a workflow makes)
                             / (f_{M-N} - f_N)

The steady window opens when the N-th workflow starts (every slot is busy) and closes at the
(M-N)-th finish, the one that starts the M-th workflow: from then on slots go idle as the last
workflows drain. It still holds the start, when all N workflows begin together and none can
finish for a workflow's whole duration, and it counts whole workflows, which an engine that runs
admitted workflows in step finishes in bursts: the figure moves by up to a burst's gap with where
f_{M-N} falls. The sustained window opens at the N-th finish instead, when the first workflows
have made way for the next, and counts finished calls in workflows' worth, so a burst of
finishes falling on either side of its end moves it little. Each is None where its window is
empty (steady: unless M > N; sustained: unless M > 2N).
"""

from __future__ import annotations

import dataclasses

import numpy as np


def _no_ids() -> np.ndarray:
    return np.zeros(0, np.int32)


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    session_id: str
    turn: int
    adapter: str
    prompt_tokens: int
    output_tokens: int
    submit_s: float  # seconds since the run started
    finish_s: float  # when the driver learned the last token
    order: int = 0  # its place in the run's submit order
    fanout_adapters: tuple[str, ...] = ()  # the agents whose residuals it asked to write
    # the call's tokens, for replays of the run's cache use (minimal.py)
    prompt_ids: np.ndarray = dataclasses.field(default_factory=_no_ids, repr=False, compare=False)
    output_ids: np.ndarray = dataclasses.field(default_factory=_no_ids, repr=False, compare=False)

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.submit_s


@dataclasses.dataclass(frozen=True)
class RunResult:
    workflows: int  # M, all finished
    records: tuple[RequestRecord, ...]
    slots: int | None = None  # N (None: M, every workflow started at t=0)

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
        """Workflows finished per second of the whole run (ForkKV Fig. 11's tasks/s)."""
        return self.workflows / self.window_s

    @property
    def tokens_per_s(self) -> float:
        return sum(r.output_tokens for r in self.records) / self.window_s

    def spans(self) -> dict[str, tuple[float, float]]:
        """{session_id: (start, finish)}: its first submit and its last call's finish."""
        out: dict[str, tuple[float, float]] = {}
        for r in self.records:
            s, f = out.get(r.session_id, (r.submit_s, r.finish_s))
            out[r.session_id] = (min(s, r.submit_s), max(f, r.finish_s))
        return out

    @property
    def steady_window(self) -> tuple[float, float] | None:
        """(s_N, f_{M-N}) as the module docstring says, or None when it is undefined."""
        n, m = self.slots or self.workflows, self.workflows
        if m <= n:
            return None
        spans = self.spans().values()
        starts, finishes = sorted(s for s, _ in spans), sorted(f for _, f in spans)
        a, b = starts[n - 1], finishes[m - n - 1]
        return (a, b) if b > a else None

    @property
    def tasks_per_s_steady(self) -> float | None:
        """Workflows finished per second of the steady window (None when it is undefined)."""
        window = self.steady_window
        if window is None:
            return None
        a, b = window
        return sum(1 for _, f in self.spans().values() if a < f <= b) / (b - a)

    @property
    def sustained_window(self) -> tuple[float, float] | None:
        """(f_N, f_{M-N}) as the module docstring says, or None when it is undefined."""
        n, m = self.slots or self.workflows, self.workflows
        if m - n <= n:
            return None
        finishes = sorted(f for _, f in self.spans().values())
        a, b = finishes[n - 1], finishes[m - n - 1]
        return (a, b) if b > a else None

    @property
    def tasks_per_s_sustained(self) -> float | None:
        """Workflows' worth of calls finished per second of the sustained window (None when it
        is undefined)."""
        window = self.sustained_window
        if window is None:
            return None
        a, b = window
        calls = sum(1 for r in self.records if a < r.finish_s <= b)
        return calls / (len(self.records) / self.workflows) / (b - a)

    def summary(self) -> dict:
        lat = np.array([r.latency_s for r in self.records])
        steady, sustained = self.steady_window, self.sustained_window
        return {"tasks_per_s": self.tasks_per_s, "tokens_per_s": self.tokens_per_s,
                "tasks_per_s_steady": self.tasks_per_s_steady,
                "steady_window_s": None if steady is None else list(steady),
                "tasks_per_s_sustained": self.tasks_per_s_sustained,
                "sustained_window_s": None if sustained is None else list(sustained),
                "slots": self.slots or self.workflows, "total": self.workflows,
                "first_submit_s": self.first_submit_s, "last_finish_s": self.last_finish_s,
                "requests": len(self.records),
                "generated_tokens": sum(r.output_tokens for r in self.records),
                "latency_mean_s": float(lat.mean()), "latency_p50_s": float(np.percentile(lat, 50)),
                "latency_p99_s": float(np.percentile(lat, 99)),
                "latencies_s": [round(float(x), 6) for x in lat]}
