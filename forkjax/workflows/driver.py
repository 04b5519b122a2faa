"""Closed-loop, in-process driver: run workflows against an Engine through its serving API.

Every workflow starts at t=0. Each pass of the loop submits what the workflows have ready
(`engine.add_request`, one `session_id` per workflow), runs one `engine.step()` while the engine
has work, and hands every finished request's tokens back to its workflow, which may make its next
call ready (at once, or after a tool latency). When the engine is idle and the workflows only
wait for tool latencies, the driver sleeps until the first one elapses. Requests are greedy
(temperature 0) and ignore EOS, so each generates exactly its `max_tokens`.
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from forkjax.engine.sequence import SamplingParams, Status
from forkjax.workflows.base import TurnRequest, Workflow
from forkjax.workflows.results import RequestRecord, RunResult


def run_in_process(engine, workflows: list[Workflow], *, fanout: bool = False,
                   progress: bool = True, desc: str = "turns") -> RunResult:
    """Run `workflows` to completion on `engine`. `fanout`: each request names its
    `fanout_adapters` (the agents of its workflow that read its prefix later, [] for none), whose
    residuals a `residual_fanout` engine then writes too; otherwise the engine's default."""
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    live: dict[int, tuple] = {}  # seq.id -> (seq, workflow, request, submit_s)
    records: list[RequestRecord] = []
    with tqdm(total=sum(w.num_turns for w in workflows), desc=desc, unit="turn",
              disable=not progress, leave=False) as bar:
        while not all(w.done for w in workflows):
            now = clock()
            for w in workflows:
                for req in w.pop_ready(now):
                    seq = _submit(engine, req, fanout)
                    live[seq.id] = (seq, w, req, now)
            if engine.scheduler.has_work:
                engine.step()
                now = clock()
                for sid, (seq, w, req, submit_s) in list(live.items()):
                    if seq.status is Status.FINISHED:
                        del live[sid]
                        if seq.error is not None:
                            raise RuntimeError(f"{req.session_id} turn {req.turn} failed") from seq.error
                        w.complete(req, list(seq.output), now)
                        records.append(RequestRecord(req.session_id, req.turn, req.adapter,
                                                     len(req.prompt), len(seq.output), submit_s, now))
                        bar.update()
            elif live:
                raise RuntimeError(f"{len(live)} requests neither run nor finished")
            else:  # only tool latencies pending
                wake = [t for w in workflows if (t := w.next_ready_at()) is not None]
                if not wake:
                    raise RuntimeError("workflows wait on nothing: a workflow did not advance")
                time.sleep(max(0.0, min(wake) - clock()))
    return RunResult(len(workflows), tuple(records))


def _submit(engine, req: TurnRequest, fanout: bool):
    params = SamplingParams(max_new_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
    return engine.add_request(req.prompt, req.adapter, params, session_id=req.session_id,
                              fanout_adapters=list(req.fanout_adapters) if fanout else None)
