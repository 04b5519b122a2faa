"""/metrics through prometheus_client, names in vLLM's style.

The engine's counters and gauges come from the core (a GetStats call per scrape) and are
exported as they are; request latencies are the front end's own histograms, timed as outputs
reach it: what a client sees, less the network.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from forkjax.server.core_client import RequestStream
from forkjax.server.messages import Output

# The classic text format, which every scraper reads (names with colons need no escaping).
CONTENT_TYPE = prometheus_client.exposition.CONTENT_TYPE_PLAIN_0_0_4
POOLS = ("base", "residual")
REASONS = ("stop", "length", "abort", "error")
# Upper bounds in seconds (vLLM's time-to-first-token buckets, which also span its others).
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
           7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCIES = {
    "time_to_first_token_seconds": "Time from arrival to the first generated token.",
    "inter_token_latency_seconds": "Time between consecutive generated tokens of a request.",
    "e2e_request_latency_seconds": "Time from arrival to the end of the request.",
    "request_queue_time_seconds": "Time from arrival to first admission into the running batch.",
}
prometheus_client.disable_created_metrics()  # no `_created` series beside every counter

# The core's stats: (metric, kind, help, [(label, stats key)]), a label `name="value"` or ""
CORE = [
    ("num_requests_running", "gauge", "Requests in the running batch.", [("", "running")]),
    ("num_requests_waiting", "gauge", "Requests queued for admission.", [("", "waiting")]),
    ("kv_pages_used", "gauge", "KV cache pages in use (cached or locked), per pool.",
     [(f'pool="{p}"', f"{p}_pages_used") for p in POOLS]),
    ("kv_pages_total", "gauge", "KV cache pages in the pool.",
     [(f'pool="{p}"', f"{p}_pages_total") for p in POOLS]),
    ("kv_bytes_used", "gauge", "Bytes of the KV cache pages in use, per pool.",
     [(f'pool="{p}"', f"{p}_bytes_used") for p in POOLS]),
    ("prefix_cache_hit_rate", "gauge", "Prompt tokens found in the cache / prompt tokens, per "
     "pool (base: shared xW K/V; residual: per-adapter xA).",
     [('pool="base"', "base_hit_rate"), ('pool="residual"', "residual_hit_rate")]),
    ("prompt_tokens_total", "counter", "Prompt tokens admitted.", [("", "prompt_tokens")]),
    ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the cache, per pool.",
     [('pool="base"', "base_hit_tokens"), ('pool="residual"', "residual_hit_tokens")]),
    ("prefill_tokens_computed_total", "counter", "Prompt positions run through the model (cache "
     "misses, recomputation after preemption).", [("", "prefill_tokens_computed")]),
    ("kv_pages_evicted_total", "counter", "KV cache pages freed by eviction (/flush_cache "
     "included), per pool.", [(f'pool="{p}"', f"evicted_{p}_pages") for p in POOLS]),
    ("host_hit_tokens_total", "counter", "Prompt tokens loaded from the host tier instead of "
     "recomputed (--host-kv-bytes).", [("", "host_hit_tokens")]),
    ("host_bytes_used", "gauge", "Host tier bytes holding KV pages.", [("", "host_bytes_used")]),
    ("host_bytes_transferred_total", "counter", "KV bytes copied to and from the host tier.",
     [('direction="stored"', "host_bytes_stored"), ('direction="loaded"', "host_bytes_loaded")]),
    ("host_load_stall_seconds_total", "counter", "Host seconds steps waited while the host "
     "tier's loads were issued.", [("", "host_load_stall_s")]),
    ("decode_batch_size_mean", "gauge", "Mean number of requests per decode step.",
     [("", "decode_batch_size_mean")]),
    ("decode_steps_total", "counter", "Decode steps run.", [("", "decode_steps")]),
    ("num_preemptions_total", "counter", "Requests preempted to free KV pages.", [("", "preemptions")]),
    ("guided_steps_total", "counter", "Steps that held a constrained request.",
     [("", "guided_steps")]),
    ("guided_mask_seconds_total", "counter", "Host seconds spent building constrained requests' "
     "token masks.", [("", "guided_mask_s")]),
    ("workflows_running_peak", "gauge", "Most sessions with a request in the running batch at once.",
     [("", "workflows_running_peak")]),
    ("sessions_open", "gauge", "Sessions (session_id) not ended: live, or idle for less than "
     "--session-ttl.", [("", "sessions_open")]),
    ("workflows_suspended_total", "counter", "Sessions whose pages were taken (recomputed when "
     "they come back).", [("", "workflows_suspended")]),
    ("lora_adapters_loaded", "gauge", "LoRA adapters being served.", [("", "adapters")]),
    ("lora_adapters_in_slots", "gauge", "LoRA adapters in device slots (--max-loras).",
     [("", "loras_in_slots")]),
    ("lora_swaps_total", "counter", "Adapters written into a device slot for a request.",
     [("", "lora_swaps")]),
    ("lora_swap_bytes_total", "counter", "Bytes of the adapters swapped in.", [("", "lora_swap_bytes")]),
    ("lora_swap_wait_seconds_total", "counter", "Host seconds steps waited for adapter swaps.",
     [("", "lora_swap_wait_s")]),
]


class _CoreStats:
    """A collector of the core's stats as of the scrape that set them."""

    def __init__(self, model_name: str):
        self.model_name, self.stats = model_name, {}

    def collect(self):
        for name, kind, help_, samples in CORE:
            labels = [label.split("=", 1) for label, _ in samples if label]
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                f"forkjax:{name}", help_, labels=["model_name", *dict(labels)])
            for label, key in samples:
                values = [self.model_name] + ([label.split("=", 1)[1].strip('"')] if label else [])
                family.add_metric(values, float(self.stats.get(key, 0)))
            yield family


class ServerMetrics:
    """The front end's registry: the core's stats, tokens and finished requests by reason,
    and the latency histograms."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self._core = _CoreStats(model_name)
        self.registry.register(self._core)
        self.generation_tokens = Counter("forkjax:generation_tokens", "Tokens generated.",
                                         ["model_name"], registry=self.registry).labels(model_name)
        success = Counter("forkjax:request_success", "Finished requests, by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.finished = {r: success.labels(model_name, r) for r in REASONS}
        self.latency = {name: Histogram(f"forkjax:{name}", help_, ["model_name"], buckets=BUCKETS,
                                        registry=self.registry).labels(model_name)
                        for name, help_ in LATENCIES.items()}

    def observe(self, stream: RequestStream, out: Output, now: float):
        """One choice's output reached the front end at `now`. The first token's latency runs
        from arrival; each later token gets its share of the time since the choice's previous
        tokens (tokens arriving together share it)."""
        n = len(out.token_ids)
        if n:
            self.generation_tokens.inc(n)
            last = stream.last.get(out.index)
            if last is None:
                self.latency["time_to_first_token_seconds"].observe(now - stream.arrival)
                n -= 1
            for _ in range(n):
                self.latency["inter_token_latency_seconds"].observe((now - (last or now)) / n)
            stream.last[out.index] = now
        if out.finish_reason is not None:
            self.latency["e2e_request_latency_seconds"].observe(now - stream.arrival)
            if out.queued_s is not None:
                self.latency["request_queue_time_seconds"].observe(out.queued_s)
            if out.finish_reason in self.finished:
                self.finished[out.finish_reason].inc()

    def render(self, core_stats: dict) -> bytes:
        self._core.stats = core_stats
        return prometheus_client.generate_latest(self.registry)
