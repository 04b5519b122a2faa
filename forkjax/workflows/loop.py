"""What both drivers share: the closed loop's slots, what each request tells the engine about its
workflow, and the records of a run.

A closed loop of N slots runs M >= N workflows: every slot starts one workflow at t=0, and when a
slot's workflow finishes, the slot starts the next one at once (a new index, so a new history
and seed), until M have been started; the run ends when all M have finished. `WorkflowSource`
hands the workflows out, `ClosedLoop` does the rest of the bookkeeping, so the in-process driver
(driver.py) and the HTTP one (http_driver.py) differ only in how a call reaches the engine.

Each call carries its workflow's session (engine: sessions.py): `session_id`, `session_end` on
the workflow's last call (its holds drop when it finishes) and, with `session_hints`,
`session_tokens`, the workflow's final length (`Workflow.final_tokens`), which lets the engine
admit whole workflows against their peak, and `session_next_s`, the time to its next call (its
tool latency), which lets a host tier load the workflow's pages back before that call comes.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable

import numpy as np
from tqdm.auto import tqdm

from forkjax.workflows.base import TurnRequest, Workflow
from forkjax.workflows.results import RequestRecord, RunResult


class WorkflowSource:
    """Workflows for a closed loop of `slots` slots: `next()` builds workflow 0, 1, ... (`make(i)`)
    until `total` have been handed out, then returns None."""

    def __init__(self, make: Callable[[int], Workflow], slots: int, total: int | None = None):
        total = slots if total is None else total
        if slots < 1 or total < slots:
            raise ValueError(f"slots={slots}, total={total}: expected 1 <= slots <= total")
        self.make, self.slots, self.total = make, slots, total
        self.started = 0

    @classmethod
    def of(cls, workflows: Iterable[Workflow]) -> "WorkflowSource":
        """A fixed list of workflows, one slot each (all start at t=0, none refills)."""
        workflows = list(workflows)
        return cls(workflows.__getitem__, len(workflows))

    def next(self) -> Workflow | None:
        if self.started == self.total:
            return None
        self.started += 1
        return self.make(self.started - 1)


@dataclasses.dataclass(eq=False)
class Call:
    """A submitted call: its workflow, its request, when and in which order it was submitted."""
    workflow: Workflow
    request: TurnRequest
    submit_s: float
    order: int


class ClosedLoop:
    """Slots, session fields, records and progress of one closed-loop run."""

    def __init__(self, workflows, *, session_hints: bool = True, progress: bool = True,
                 desc: str = "turns", clock: Callable[[], float] = time.perf_counter):
        """`workflows`: a WorkflowSource, or a list (one slot each); `clock()`: seconds, any
        origin (the run's times count from its value now)."""
        self.source = workflows if isinstance(workflows, WorkflowSource) else WorkflowSource.of(workflows)
        self.session_hints = session_hints
        self._clock, self._t0 = clock, clock()
        self._order = itertools.count()
        self.records: list[RequestRecord] = []
        self.finished = 0
        self.bar = tqdm(total=None, desc=desc, unit="turn", disable=not progress, leave=False)

    def __enter__(self) -> "ClosedLoop":
        return self

    def __exit__(self, *exc):
        self.bar.close()

    def now(self) -> float:
        """Seconds since the run started."""
        return self._clock() - self._t0

    def start(self) -> Workflow | None:
        """The workflow a free slot runs next; None when all have been started."""
        w = self.source.next()
        if w is not None and self.bar.total is None:
            self.bar.total = self.source.total * w.num_turns  # every workflow has one shape
        return w

    def first(self) -> list[Workflow]:
        """The workflows the slots start at t=0."""
        return [w for _ in range(self.source.slots) if (w := self.start()) is not None]

    def ready(self, w: Workflow, now: float) -> list[Call]:
        """`w`'s calls ready at `now`, to be submitted in this order."""
        return [Call(w, req, now, next(self._order)) for req in w.pop_ready(now)]

    def fields(self, call: Call) -> dict:
        """The session keywords of `call`'s request (engine.add_request's names)."""
        req = call.request
        hints = self.session_hints
        return {"session_id": req.session_id, "session_end": req.last,
                "session_tokens": call.workflow.final_tokens if hints else None,
                "session_next_s": call.workflow.tool_latency if hints and not req.last else None}

    def complete(self, call: Call, output: list[int], now: float) -> Workflow | None:
        """`call` finished at `now` with `output`: its workflow takes it, the run records it.
        Returns the workflow the slot starts next when this call ended its workflow (None if
        it did not, or when every workflow has been started)."""
        w, req = call.workflow, call.request
        w.complete(req, output, now)
        self.records.append(RequestRecord(
            req.session_id, req.turn, req.adapter, len(req.prompt), len(output), call.submit_s, now,
            order=call.order, fanout_adapters=req.fanout_adapters,
            prompt_ids=np.asarray(req.prompt, np.int32), output_ids=np.asarray(output, np.int32)))
        self.bar.update()
        if not w.done:
            return None
        self.finished += 1
        return self.start()

    def result(self) -> RunResult:
        if self.finished != self.source.total:
            raise RuntimeError(f"{self.finished} of {self.source.total} workflows finished")
        return RunResult(self.finished, tuple(self.records), slots=self.source.slots)
