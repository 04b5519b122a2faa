"""Agent workflows (ReAct, MapReduce, parallel rounds) over length profiles of real datasets, and
the drivers that run them closed-loop (N slots, M workflows) against an Engine in process, a
server over HTTP, or a model-free replay of the scheduler (replay.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from forkjax.workflows.base import TokenSampler, TurnRequest, Workflow
from forkjax.workflows.loop import ClosedLoop, WorkflowSource
from forkjax.workflows.mapreduce import MapReduceWorkflow
from forkjax.workflows.parallel import ParallelWorkflow
from forkjax.workflows.profiles import PROFILES, LengthDist, Profile, fixed_profile, get_profile
from forkjax.workflows.react import ReActWorkflow
from forkjax.workflows.results import RequestRecord, RunResult

PATTERNS = ("react", "mapreduce", "parallel")


def agent_names(pattern: str, *, agents: int = 3, mappers: int = 4) -> list[str]:
    """Adapter names of one workflow's agents: ReAct and parallel agent0..; MapReduce mapper0..
    + reducer."""
    if pattern in ("react", "parallel"):
        return [f"agent{i}" for i in range(agents)]
    if pattern == "mapreduce":
        return [f"mapper{i}" for i in range(mappers)] + ["reducer"]
    raise ValueError(f"pattern {pattern!r}: expected one of {PATTERNS}")


def workflow_maker(pattern: str, profile: Profile, tokens: TokenSampler, *, seed: int = 0,
                   agents: int = 3, rounds: int = 4, mappers: int = 4,
                   tool_latency: float = 0.0) -> Callable[[int], Workflow]:
    """i -> workflow `wf{i}` of one shape, drawn from Generator((seed, i)): workflow i is the
    same however many run and whenever it starts."""
    names = agent_names(pattern, agents=agents, mappers=mappers)
    rng = lambda i: np.random.default_rng((seed, i))  # noqa: E731
    if pattern == "react":
        return lambda i: ReActWorkflow(i, names, rounds, profile, tokens, rng(i), tool_latency)
    if tool_latency:
        raise ValueError("tool_latency applies to ReAct only (the other patterns call no tools)")
    if pattern == "parallel":
        return lambda i: ParallelWorkflow(i, names, rounds, profile, tokens, rng(i))
    return lambda i: MapReduceWorkflow(i, names[:-1], names[-1], profile, tokens, rng(i))


def make_workflows(pattern: str, n: int, profile: Profile, tokens: TokenSampler, **shape) -> list[Workflow]:
    """Workflows `wf0..wf{n-1}` (`workflow_maker`'s keywords)."""
    make = workflow_maker(pattern, profile, tokens, **shape)
    return [make(i) for i in range(n)]


def workflow_source(pattern: str, slots: int, total: int | None, profile: Profile,
                    tokens: TokenSampler, **shape) -> WorkflowSource:
    """A closed loop of `slots` slots over `total` workflows wf0, wf1, ... (loop.py)."""
    return WorkflowSource(workflow_maker(pattern, profile, tokens, **shape), slots, total)


def longest_request(pattern: str, profile: Profile, *, agents: int = 3, rounds: int = 4,
                    mappers: int = 4) -> int:
    """Prompt + generated tokens of the longest call a workflow of this shape can make."""
    if pattern == "react":
        return ReActWorkflow.longest_request(profile, agents, rounds)
    if pattern == "mapreduce":
        return MapReduceWorkflow.longest_request(profile, mappers)
    if pattern == "parallel":
        return ParallelWorkflow.longest_request(profile, agents, rounds)
    raise ValueError(f"pattern {pattern!r}: expected one of {PATTERNS}")


__all__ = ["PATTERNS", "PROFILES", "ClosedLoop", "LengthDist", "MapReduceWorkflow",
           "ParallelWorkflow", "Profile", "ReActWorkflow", "RequestRecord", "RunResult", "TokenSampler", "TurnRequest", "Workflow",
           "WorkflowSource", "agent_names", "fixed_profile", "get_profile", "longest_request",
           "make_workflows", "workflow_maker", "workflow_source"]
