"""The same workflows against a running `python -m forkjax.serve`, over HTTP.

One asyncio task per workflow, all started at t=0 (closed loop), each submitting its ready calls
through the official `openai` client (`AsyncOpenAI`) and handing the answers back to the
workflow, exactly as `driver.py` does in process. A call is `/v1/completions` with the prompt as
token ids, the agent's adapter as `model`, greedy, EOS ignored, and the server's extensions
(`return_token_ids`: the answer carries `choices[0].token_ids`, which the next turns read;
`session_id`; `fanout_adapters`).

Engine statistics come from the server's Prometheus `/metrics`: `scrape` reads it, and
`stats_between` turns two scrapes into the keys `Engine.stats()` has (counters as differences).
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
from openai import AsyncOpenAI
from tqdm.auto import tqdm

from forkjax.workflows.base import TurnRequest, Workflow
from forkjax.workflows.results import RequestRecord, RunResult

_SAMPLE = re.compile(r"^forkjax:(\w+)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


async def run_http(base_url: str, workflows: list[Workflow], *, fanout: bool = False,
                   api_key: str = "EMPTY", progress: bool = True, desc: str = "turns",
                   timeout_s: float = 3600.0) -> RunResult:
    """Run `workflows` against the server at `base_url` (e.g. http://127.0.0.1:8000, no /v1)."""
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    records: list[RequestRecord] = []
    # No retries: a retried call would be timed twice and hide a server error.
    client = AsyncOpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key=api_key, max_retries=0,
                         timeout=timeout_s)
    with tqdm(total=sum(w.num_turns for w in workflows), desc=desc, unit="turn",
              disable=not progress, leave=False) as bar:
        async def run_one(w: Workflow):
            pending: dict[asyncio.Task, tuple[TurnRequest, float]] = {}
            while not w.done:
                now = clock()
                for req in w.pop_ready(now):
                    pending[asyncio.create_task(_complete(client, req, fanout))] = (req, now)
                wake = w.next_ready_at()
                if not pending:
                    if wake is None:
                        raise RuntimeError(f"{w.session_id} waits on nothing")
                    await asyncio.sleep(max(0.0, wake - clock()))
                    continue
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED,
                                             timeout=None if wake is None else max(0.0, wake - clock()))
                for task in done:
                    req, submit_s = pending.pop(task)
                    output = task.result()
                    now = clock()
                    w.complete(req, output, now)
                    records.append(RequestRecord(req.session_id, req.turn, req.adapter, len(req.prompt),
                                                 len(output), submit_s, now))
                    bar.update()

        async with client:
            await asyncio.gather(*(run_one(w) for w in workflows))
    return RunResult(len(workflows), tuple(records))


async def _complete(client: AsyncOpenAI, req: TurnRequest, fanout: bool) -> list[int]:
    extra = {"ignore_eos": True, "return_token_ids": True, "session_id": req.session_id}
    if fanout:  # [] for none: an absent list means the server's default (every adapter)
        extra["fanout_adapters"] = list(req.fanout_adapters)
    resp = await client.completions.create(model=req.adapter, prompt=req.prompt, max_tokens=req.max_tokens,
                                           temperature=0, extra_body=extra)
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
             "preemptions": "num_preemptions_total"}
_GAUGES = {"decode_batch_size_mean": "decode_batch_size_mean",
           "base_bytes_used": "kv_bytes_used{pool=base}",
           "residual_bytes_used": "kv_bytes_used{pool=residual}"}


def stats_between(before: dict[str, float], after: dict[str, float]) -> dict:
    """Two scrapes -> Engine.stats() keys: counters over the interval, gauges at its end; a
    sample the server does not export is left out."""
    out: dict = {k: int(after[m] - before.get(m, 0.0)) for k, m in _COUNTERS.items() if m in after}
    out.update({k: after[m] if k == "decode_batch_size_mean" else int(after[m])
                for k, m in _GAUGES.items() if m in after})
    return out
