"""The same workflows against a running `python -m forkjax.serve`, over HTTP.

One asyncio task per slot of the closed loop (loop.py), all started at t=0, each running its
workflow's calls through the official `openai` client (`AsyncOpenAI`) and handing the answers
back to the workflow, exactly as `driver.py` does in process, then the next workflow the slot
starts. A call is `/v1/completions` with the prompt as token ids, the agent's adapter as
`model`, greedy, EOS ignored, and the server's extensions (`return_token_ids`: the answer carries
`choices[0].token_ids`, which the next turns read; the session fields `session_id`,
`session_end`, `session_tokens`; `fanout_adapters`) in the body (`extra_body`).

Every call carries its workflow's id in SMG's `X-SMG-Routing-Key` header, so a gateway in front
of several servers (`python -m forkjax.cluster`) sends all of a workflow's agents, every turn, to
one of them. Through the gateway (`base_model` given) `model` is the base model's name, which SMG
routes on, the agent's adapter travels in `lora_path` and the prompt's token ids in
`prompt_token_ids` (SMG takes only text in `prompt`), fields SMG forwards as sent.

Engine statistics come from the server's Prometheus `/metrics`: `scrape` reads it, and
`stats_between` turns two scrapes into the keys `Engine.stats()` has (counters as differences).
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
from openai import AsyncOpenAI

from forkjax.workflows.base import Workflow
from forkjax.workflows.loop import Call, ClosedLoop
from forkjax.workflows.results import RunResult

ROUTING_KEY = "X-SMG-Routing-Key"  # SMG's consistent_hashing policy hashes it to a worker
_SAMPLE = re.compile(r"^forkjax:(\w+)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


async def run_http(base_url: str, workflows, *, fanout: bool = False, session_hints: bool = True,
                   api_key: str = "EMPTY", progress: bool = True, desc: str = "turns",
                   timeout_s: float = 3600.0, base_model: str | None = None) -> RunResult:
    """Run `workflows` (a list, all at t=0, or a loop.WorkflowSource of N slots) against the
    server or gateway at `base_url` (e.g. http://127.0.0.1:8000, no /v1); `fanout` and
    `session_hints` as in `driver.run_in_process`; `base_model`: the base model's name, for a
    gateway."""
    # No retries: a retried call would be timed twice and hide a server error.
    client = AsyncOpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key=api_key, max_retries=0,
                         timeout=timeout_s)
    with ClosedLoop(workflows, session_hints=session_hints, progress=progress, desc=desc,
                    clock=time.perf_counter) as loop:
        async def run_slot(w: Workflow | None):
            pending: dict[asyncio.Task, Call] = {}
            while w is not None:
                for call in loop.ready(w, loop.now()):
                    body = request_body(loop, call, fanout, base_model)
                    pending[asyncio.create_task(_complete(client, body))] = call
                wake = w.next_ready_at()
                if not pending:
                    if wake is None:
                        raise RuntimeError(f"{w.session_id} waits on nothing")
                    await asyncio.sleep(max(0.0, wake - loop.now()))
                    continue
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED,
                                             timeout=None if wake is None else max(0.0, wake - loop.now()))
                nxt = w
                for task in done:
                    call = pending.pop(task)
                    after = loop.complete(call, task.result(), loop.now())
                    if call.workflow.done:
                        nxt = after
                w = nxt

        async with client:
            await asyncio.gather(*(run_slot(w) for w in loop.first()))
        return loop.result()


def request_body(loop: ClosedLoop, call: Call, fanout: bool, base_model: str | None = None) -> dict:
    """The /v1/completions arguments of `call` (`extra_body`: forkjax's and vLLM's fields;
    `extra_headers`: the workflow's routing key)."""
    req = call.request
    extra = {"ignore_eos": True, "return_token_ids": True}
    prompt = req.prompt
    if base_model is not None:  # SMG takes text prompts only: the ids travel beside an empty one
        extra.update(lora_path=req.adapter, prompt_token_ids=list(req.prompt))
        prompt = ""
    extra.update({k: v for k, v in loop.fields(call).items() if v is not None and v is not False})
    # always named ([] for none): an absent list means the server's default, under forkkv every
    # adapter in a slot, which is not what a run without fan-out measures
    extra["fanout_adapters"] = list(req.fanout_adapters) if fanout else []
    if req.guided_json is not None:
        extra["guided_json"] = req.guided_json
    return dict(model=base_model or req.adapter, prompt=prompt, max_tokens=req.max_tokens, temperature=0,
                extra_body=extra, extra_headers={ROUTING_KEY: call.workflow.session_id})


async def _complete(client: AsyncOpenAI, body: dict) -> list[int]:
    resp = await client.completions.create(**body)
    ids = resp.choices[0].model_extra.get("token_ids")
    if ids is None:
        raise RuntimeError("the server's answer has no choices[0].token_ids (return_token_ids)")
    return list(ids)


async def scrape(base_url: str) -> dict[str, float]:
    """GET /metrics -> {'name' or 'name{label=value,...}': value}, model_name label dropped."""
    async with httpx.AsyncClient() as http:
        resp = await http.get(f"{base_url.rstrip('/')}/metrics")
        resp.raise_for_status()
    out = {}
    for line in resp.text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = ",".join(f"{k}={v}" for k, v in _LABEL.findall(m[2] or "") if k != "model_name")
        out[f"{m[1]}{{{labels}}}" if labels else m[1]] = float(m[3])
    return out


# Engine.stats() key -> the /metrics sample it is exported as.
_COUNTERS = {"prompt_tokens": "prompt_tokens_total",
             "base_hit_tokens": "prefix_cache_hit_tokens_total{pool=base}",
             "residual_hit_tokens": "prefix_cache_hit_tokens_total{pool=residual}",
             "prefill_tokens_computed": "prefill_tokens_computed_total",
             "generation_tokens": "generation_tokens_total",
             "preemptions": "num_preemptions_total",
             "workflows_suspended": "workflows_suspended_total",
             "host_hit_tokens": "host_hit_tokens_total",
             "host_bytes_stored": "host_bytes_transferred_total{direction=stored}",
             "host_bytes_loaded": "host_bytes_transferred_total{direction=loaded}",
             "lora_swaps": "lora_swaps_total",
             "lora_swap_bytes": "lora_swap_bytes_total",
             "guided_steps": "guided_steps_total"}
_SECONDS = {"host_load_stall_s": "host_load_stall_seconds_total",
            "lora_swap_wait_s": "lora_swap_wait_seconds_total"}
_GAUGES = {"base_bytes_used": "kv_bytes_used{pool=base}",
           "residual_bytes_used": "kv_bytes_used{pool=residual}",
           "host_bytes_used": "host_bytes_used"}
_MEAN, _STEPS, _PEAK = "decode_batch_size_mean", "decode_steps_total", "workflows_running_peak"


def stats_between(before: dict[str, float], after: dict[str, float]) -> dict:
    """Two scrapes -> Engine.stats() keys: counters over the interval, gauges at its end; a
    sample the server does not export is left out. The decode batch mean is the interval's
    (the server's mean since its start times its decode steps, before and after). The
    workflows' peak runs from the server's start (nothing resets it over HTTP): it is the
    interval's only when no decode step ran before it or it grew in the interval, else None."""
    out: dict = {k: int(after[m] - before.get(m, 0.0)) for k, m in _COUNTERS.items() if m in after}
    out.update({k: after[m] - before.get(m, 0.0) for k, m in _SECONDS.items() if m in after})
    out.update({k: int(after[m]) for k, m in _GAUGES.items() if m in after})
    if _MEAN in after and _STEPS in after:
        steps = after[_STEPS] - before.get(_STEPS, 0.0)
        seqs = after[_MEAN] * after[_STEPS] - before.get(_MEAN, 0.0) * before.get(_STEPS, 0.0)
        out[_MEAN] = seqs / steps if steps else 0.0
    if _PEAK in after:
        fresh = not before.get(_STEPS)  # no decode step yet
        out[_PEAK] = int(after[_PEAK]) if fresh or after[_PEAK] > before.get(_PEAK, 0.0) else None
    return out


def stats_across(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict:
    """`stats_between` over several servers' scrapes (a gateway's workers, in one order): counters
    and gauges summed, the decode batch mean weighted by each server's decode steps, the
    workflows' peak the sum of the servers' (None if one of them has none)."""
    each = [stats_between(b, a) for b, a in zip(before, after)]
    out: dict = {k: sum(s[k] for s in each) for k in each[0] if k not in (_MEAN, _PEAK)}
    if _MEAN in each[0]:
        steps = [a.get(_STEPS, 0.0) - b.get(_STEPS, 0.0) for b, a in zip(before, after)]
        out[_MEAN] = sum(s[_MEAN] * n for s, n in zip(each, steps)) / sum(steps) if sum(steps) else 0.0
    if _PEAK in each[0]:
        peaks = [s[_PEAK] for s in each]
        out[_PEAK] = None if None in peaks else sum(peaks)
    return out
