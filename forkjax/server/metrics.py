"""/metrics in the Prometheus text format (version 0.0.4), names in vLLM's style.

`snapshot` runs on the engine thread (the engine's counters are not thread-safe to read);
`render` turns the snapshot into text on the HTTP side.
"""

from __future__ import annotations

from forkjax.server.engine_loop import EngineLoop
from forkjax.server.latency import HELP

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
POOLS = ("base", "residual")
REASONS = ("stop", "length", "abort", "error")


def snapshot(loop: EngineLoop) -> dict:
    s = dict(loop.engine.stats())
    s["waiting"] += loop.num_held
    s["generation_tokens"] = loop.generation_tokens
    s["finished"] = dict(loop.finished)
    s["adapters"] = len(loop.adapters)
    s["latency"] = {name: h.copy() for name, h in loop.latency.items()}
    return s


def _hit_rate(hits: int, total: int) -> float:
    return hits / total if total else 0.0


def render(s: dict, model_name: str) -> str:
    label = f'model_name="{_escape(model_name)}"'
    lines: list[str] = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP forkjax:{name} {help_}")
        lines.append(f"# TYPE forkjax:{name} {kind}")
        for extra, value in samples:
            labels = ",".join([label] + ([extra] if extra else []))
            lines.append(f"forkjax:{name}{{{labels}}} {float(value)!r}")

    metric("num_requests_running", "gauge", "Requests in the running batch.", [("", s["running"])])
    metric("num_requests_waiting", "gauge", "Requests queued for admission.", [("", s["waiting"])])
    metric("kv_pages_used", "gauge", "KV cache pages in use (cached or locked), per pool.",
           [(f'pool="{p}"', s[f"{p}_pages_used"]) for p in POOLS])
    metric("kv_pages_total", "gauge", "KV cache pages in the pool.",
           [(f'pool="{p}"', s[f"{p}_pages_total"]) for p in POOLS])
    metric("kv_bytes_used", "gauge", "Bytes of the KV cache pages in use, per pool.",
           [(f'pool="{p}"', s[f"{p}_bytes_used"]) for p in POOLS])
    metric("prefix_cache_hit_rate", "gauge",
           "Prompt tokens found in the cache / prompt tokens, per pool (base: shared xW K/V; "
           "residual: per-adapter xA).",
           [('pool="base"', _hit_rate(s["base_hit_tokens"], s["prompt_tokens"])),
            ('pool="residual"', _hit_rate(s["residual_hit_tokens"], s["prompt_tokens"]))])
    metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", [("", s["prompt_tokens"])])
    metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the cache, per pool.",
           [('pool="base"', s["base_hit_tokens"]), ('pool="residual"', s["residual_hit_tokens"])])
    metric("prefill_tokens_computed_total", "counter",
           "Prompt positions run through the model (cache misses, recomputation after preemption).",
           [("", s["prefill_tokens_computed"])])
    metric("kv_pages_evicted_total", "counter",
           "KV cache pages freed by eviction (/flush_cache included), per pool.",
           [(f'pool="{p}"', s[f"evicted_{p}_pages"]) for p in POOLS])
    metric("host_hit_tokens_total", "counter",
           "Prompt tokens loaded from the host tier instead of recomputed (--host-kv-bytes).",
           [("", s["host_hit_tokens"])])
    metric("host_bytes_used", "gauge", "Host tier bytes holding KV pages.", [("", s["host_bytes_used"])])
    metric("host_bytes_transferred_total", "counter", "KV bytes copied to and from the host tier.",
           [('direction="stored"', s["host_bytes_stored"]), ('direction="loaded"', s["host_bytes_loaded"])])
    metric("host_load_stall_seconds_total", "counter",
           "Host seconds steps waited while the host tier's loads were issued.",
           [("", s["host_load_stall_s"])])
    metric("generation_tokens_total", "counter", "Tokens generated.", [("", s["generation_tokens"])])
    metric("decode_batch_size_mean", "gauge", "Mean number of requests per decode step.",
           [("", s["decode_batch_size_mean"])])
    metric("num_preemptions_total", "counter", "Requests preempted to free KV pages.",
           [("", s["preemptions"])])
    metric("workflows_running_peak", "gauge",
           "Most sessions with a request in the running batch at once.",
           [("", s["workflows_running_peak"])])
    metric("sessions_open", "gauge",
           "Sessions (session_id) not ended: live, or idle for less than --session-ttl.",
           [("", s["sessions_open"])])
    metric("workflows_suspended_total", "counter",
           "Sessions whose pages were taken (recomputed when they come back).",
           [("", s["workflows_suspended"])])
    metric("request_success_total", "counter", "Finished requests, by finish reason.",
           [(f'finished_reason="{r}"', s["finished"].get(r, 0)) for r in REASONS])
    metric("lora_adapters_loaded", "gauge", "LoRA adapters being served.", [("", s["adapters"])])
    metric("lora_adapters_in_slots", "gauge", "LoRA adapters in device slots (--max-loras).",
           [("", s["loras_in_slots"])])
    metric("lora_swaps_total", "counter", "Adapters written into a device slot for a request.",
           [("", s["lora_swaps"])])
    metric("lora_swap_bytes_total", "counter", "Bytes of the adapters swapped in.", [("", s["lora_swap_bytes"])])
    metric("lora_swap_wait_seconds_total", "counter", "Host seconds steps waited for adapter swaps.",
           [("", s["lora_swap_wait_s"])])
    for name, hist in s["latency"].items():
        buckets, total, count = hist.samples()
        lines.append(f"# HELP forkjax:{name} {HELP[name]}")
        lines.append(f"# TYPE forkjax:{name} histogram")
        lines += [f'forkjax:{name}_bucket{{{label},le="{le}"}} {float(n)!r}' for le, n in buckets]
        lines.append(f"forkjax:{name}_sum{{{label}}} {float(total)!r}")
        lines.append(f"forkjax:{name}_count{{{label}}} {float(count)!r}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
