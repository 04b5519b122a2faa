"""The client-side metrics of scripts/bench_serving.py: each request's token arrival times, and
vLLM's throughput and latency figures over them."""

from __future__ import annotations

import dataclasses

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class Timing:
    """One request as its client saw it, in seconds from t=0."""
    input_len: int
    output_len: int  # drawn
    sent: float
    events: list = dataclasses.field(default_factory=list)  # (time, tokens arriving then)
    error: str | None = None

    @property
    def generated(self) -> int:
        return sum(n for _, n in self.events)


def distribution_ms(xs) -> dict | None:
    if not len(xs):
        return None
    a = np.asarray(xs) * 1e3
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}}


def latency_metrics(timings: list[Timing], duration: float) -> dict:
    """vLLM's metrics over the requests that generated their whole output."""
    ok = [t for t in timings if t.error is None and t.generated == t.output_len]
    ttft = [t.events[0][0] - t.sent for t in ok]
    e2el = [t.events[-1][0] - t.sent for t in ok]
    tpot = [(e - f) / (t.output_len - 1) for t, f, e in zip(ok, ttft, e2el) if t.output_len > 1]
    itl = [(b - a) / n for t in ok for (a, _), (b, n) in zip(t.events, t.events[1:]) for _ in range(n)]
    inp, outp = sum(t.input_len for t in ok), sum(t.output_len for t in ok)
    return dict(completed=len(ok), failed=len(timings) - len(ok), duration_s=duration,
                total_input_tokens=inp, total_output_tokens=outp,
                request_throughput=len(ok) / duration, input_throughput=inp / duration,
                output_throughput=outp / duration, total_token_throughput=(inp + outp) / duration,
                ttft_ms=distribution_ms(ttft), tpot_ms=distribution_ms(tpot),
                itl_ms=distribution_ms(itl), e2el_ms=distribution_ms(e2el),
                requests=[dict(input_len=t.input_len, output_len=t.output_len, generated=t.generated,
                               sent_s=t.sent, first_token_s=t.events[0][0] if t.events else None,
                               last_token_s=t.events[-1][0] if t.events else None, error=t.error)
                          for t in timings])
