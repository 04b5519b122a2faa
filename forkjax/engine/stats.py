"""The engine's counters: where a step's time goes, decode batch sizes, and `Engine.stats()`.

The cache counts hits, evictions and pool use (`DualRadixCache.stats`), the scheduler prefill
tokens computed and preemptions; this module counts the rest and puts them together. Counters
run from start-up or from the last `reset`; step times run from start-up.
"""

from __future__ import annotations

# The parts of `Engine.step()`: host bookkeeping (schedule, inputs, postprocess), dispatch (the
# jit call: argument transfer and kernel launches), waiting for the device; and the step count.
STEP_PARTS = ("schedule_s", "inputs_s", "dispatch_s", "device_s", "postprocess_s", "steps")


class EngineStats:
    def __init__(self):
        self.step_times = dict.fromkeys(STEP_PARTS, 0)  # cumulative seconds per part
        self.decode_steps = self.decode_seqs = 0
        # steps that held a guided request, and the host seconds their masks took
        self.guided_steps, self.guided_mask_s = 0, 0.0
        # per step, when a list (`record_steps`): [decode 1 / extend 0, requests, tokens computed,
        # tokens attended (sum of the rows' ends), device seconds]; a step's device seconds run
        # from its dispatch or the previous step's results, whichever is later, to its results
        self.step_log: list | None = None
        self._launch_t = self._done_t = 0.0

    def record_steps(self, on: bool = True) -> list | None:
        """Start a fresh step log (or stop logging); returns the log that ends."""
        log, self.step_log = self.step_log, [] if on else None
        return log

    def time(self, part: str, dt: float) -> None:
        self.step_times[part] += dt

    def guided(self, mask_s: float) -> None:
        """A step held a guided request; its masks took `mask_s` host seconds."""
        self.guided_steps += 1
        self.guided_mask_s += mask_s

    def launched(self, batch, t: float) -> None:
        """A step of `batch` (a ScheduledBatch) was dispatched at perf-counter time `t`."""
        if batch.kind == "decode":
            self.decode_steps += 1
            self.decode_seqs += len(batch.seqs)
        self._launch_t = t

    def fetched(self, batch, t: float) -> None:
        """The results of the step last dispatched, `batch`, reached the host at time `t`."""
        if self.step_log is not None:
            self.step_log.append([int(batch.kind == "decode"), len(batch.seqs),
                                  sum(e - s for s, e in batch.chunks), sum(e for _, e in batch.chunks),
                                  t - max(self._launch_t, self._done_t)])
        self._done_t = t

    def snapshot(self, cache, scheduler, slots) -> dict:
        """The keys of docs/design.md, Public contracts, and more: the cache's counters with
        agents named by adapter (`slots`: the engine's AdapterSlots), hit rates, the decode
        batch and the queues."""
        s = cache.stats()
        names = {a.content_hash: n for n, a in slots.by_name.items()}
        s["agent_bytes"] = {names.get(k, k): v for k, v in s["agent_bytes"].items()}
        s["decode_batch_size_mean"] = self.decode_seqs / self.decode_steps if self.decode_steps else 0.0
        s["decode_steps"] = self.decode_steps
        s["guided_steps"], s["guided_mask_s"] = self.guided_steps, self.guided_mask_s
        s["prefill_tokens_computed"] = scheduler.prefill_tokens_computed
        prompt = s["prompt_tokens"]
        s["base_hit_rate"] = s["base_hit_tokens"] / prompt if prompt else 0.0
        s["residual_hit_rate"] = s["residual_hit_tokens"] / prompt if prompt else 0.0
        s["running"] = len(scheduler.running)
        s["waiting"] = len(scheduler.waiting)
        s["preemptions"] = scheduler.num_preemptions
        s["workflows_running_peak"] = scheduler.workflows_running_peak
        s["workflows_suspended"] = scheduler.sessions.num_suspended
        s["sessions_open"] = len(scheduler.sessions.by_id)
        s["loras_loaded"], s["loras_in_slots"] = len(slots.by_name), len(slots.slot_by_name)
        s["lora_swaps"], s["lora_swap_bytes"], s["lora_swap_wait_s"] = slots.swaps, slots.swap_bytes, slots.swap_s
        return s

    def reset(self, cache, scheduler, slots) -> None:
        """Set the counters of `snapshot` back to zero (the pools and step times are untouched)."""
        cache.reset_stats()
        slots.swaps = slots.swap_bytes = slots.swap_s = 0
        self.decode_steps = self.decode_seqs = 0
        self.guided_steps, self.guided_mask_s = 0, 0.0
        scheduler.prefill_tokens_computed = scheduler.num_preemptions = 0
        scheduler.workflows_running_peak = scheduler.sessions.num_suspended = 0
