"""Request latency histograms (Prometheus cumulative buckets), as vLLM names and buckets them."""

from __future__ import annotations

import bisect

# Upper bounds in seconds (vLLM's time-to-first-token buckets, which also span its others).
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
           7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
HELP = {
    "time_to_first_token_seconds": "Time from arrival to the first generated token.",
    "inter_token_latency_seconds": "Time between consecutive generated tokens of a request.",
    "e2e_request_latency_seconds": "Time from arrival to the end of the request.",
    "request_queue_time_seconds": "Time from arrival to first admission into the running batch.",
}


class Histogram:
    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, seconds: float, times: int = 1):
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += times
        self.sum += seconds * times

    def copy(self) -> Histogram:
        h = Histogram()
        h.counts, h.sum = list(self.counts), self.sum
        return h

    def samples(self):
        """-> [(le label, cumulative count)], then (sum, count)."""
        out, total = [], 0
        for bound, n in zip((*map(repr, BUCKETS), "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out, self.sum, total


def latencies() -> dict[str, Histogram]:
    return {name: Histogram() for name in HELP}
