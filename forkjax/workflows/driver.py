"""Closed-loop, in-process driver: run workflows against an Engine through its serving API.

The slots start their workflows at t=0 (loop.py). Each pass of the loop submits what the running
workflows have ready (`engine.add_request`, one session per workflow: loop.py says which session
fields a call carries), runs one `engine.step()` while the engine has work, and hands every
finished request's tokens back to its workflow, which may make its next call ready (at once, or
after a tool latency); a finished workflow's slot starts the next one. When the engine is idle
and the workflows only wait for tool latencies, the driver sleeps until the first one elapses.
Requests are greedy (temperature 0) and ignore EOS, so each generates exactly its `max_tokens`
(one with a JSON schema, `TurnRequest.guided_json`: until its JSON is complete, at most that).

`clock` and `sleep` are the driver's time: the wall clock by default; a model-free replay
(replay.py) passes its virtual clock, which its steps advance.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from forkjax.engine.sequence import SamplingParams, Status
from forkjax.structured_output import json_schema_grammar
from forkjax.workflows.loop import Call, ClosedLoop
from forkjax.workflows.results import RunResult


def run_in_process(engine, workflows, *, fanout: bool = False, session_hints: bool = True,
                   progress: bool = True, desc: str = "turns",
                   clock: Callable[[], float] = time.perf_counter,
                   sleep: Callable[[float], None] = time.sleep) -> RunResult:
    """Run `workflows` (a list, all at t=0, or a loop.WorkflowSource of N slots) to completion
    on `engine`. `fanout`: each request names its `fanout_adapters` (the agents of its workflow
    that read its prefix later, [] for none), whose residuals a `residual_fanout` engine then
    writes too; otherwise none. `session_hints`: each request carries its
    workflow's final length (`session_tokens`)."""
    live: dict[int, tuple] = {}  # seq.id -> (seq, call)
    with ClosedLoop(workflows, session_hints=session_hints, progress=progress, desc=desc,
                    clock=clock) as loop:
        running = loop.first()
        while running:
            now = loop.now()
            for w in running:
                for call in loop.ready(w, now):
                    seq = _submit(engine, loop, call, fanout)
                    live[seq.id] = (seq, call)
            if engine.scheduler.has_work:
                engine.step()
                now = loop.now()
                for sid, (seq, call) in list(live.items()):
                    if seq.status is not Status.FINISHED:
                        continue
                    del live[sid]
                    if seq.error is not None:
                        req = call.request
                        raise RuntimeError(f"{req.session_id} turn {req.turn} failed") from seq.error
                    nxt = loop.complete(call, list(seq.output), now)
                    if call.workflow.done:
                        running.remove(call.workflow)
                        if nxt is not None:
                            running.append(nxt)
            elif live:
                raise RuntimeError(f"{len(live)} requests neither run nor finished")
            else:  # only tool latencies pending
                wake = [t for w in running if (t := w.next_ready_at()) is not None]
                if not wake:
                    raise RuntimeError("workflows wait on nothing: a workflow did not advance")
                sleep(max(0.0, min(wake) - loop.now()))
        return loop.result()


def _submit(engine, loop: ClosedLoop, call: Call, fanout: bool):
    req = call.request
    guided = None if req.guided_json is None else json_schema_grammar(req.guided_json)
    params = SamplingParams(max_new_tokens=req.max_tokens, temperature=0.0, ignore_eos=True, guided=guided)
    return engine.add_request(req.prompt, req.adapter, params, **loop.fields(call),
                              fanout_adapters=list(req.fanout_adapters) if fanout else [])
