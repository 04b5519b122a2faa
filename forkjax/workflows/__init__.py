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


def agent_names(pattern: str, *, agents: int = 3, mappers: int = 4, group: int | None = None) -> list[str]:
    """Adapter names of one workflow's agents: ReAct and parallel agent0..; MapReduce mapper0..
    + reducer; with `group` g (workflows with agents of their own), suffixed `.g<g>`."""
    if pattern in ("react", "parallel"):
        names = [f"agent{i}" for i in range(agents)]
    elif pattern == "mapreduce":
        names = [f"mapper{i}" for i in range(mappers)] + ["reducer"]
    else:
        raise ValueError(f"pattern {pattern!r}: expected one of {PATTERNS}")
    return names if group is None else [f"{n}.g{group}" for n in names]


def workflow_maker(pattern: str, profile: Profile, tokens: TokenSampler, *, seed: int = 0,
                   agents: int = 3, rounds: int = 4, mappers: int = 4, groups: int = 0,
                   tool_latency: float = 0.0, tool_format: str = "text",
                   invocations: dict | None = None) -> Callable[[int], Workflow]:
    """i -> workflow `wf{i}` of one shape, drawn from Generator((seed, i)): workflow i is the
    same however many run and whenever it starts. `groups` G > 0: workflow i's agents are
    group i % G's own adapters (`agent_names(..., group=i % G)`). `invocations` {agent: token
    ids}: Activated LoRA agents, whose cues open with their invocations."""
    named = lambda i: agent_names(pattern, agents=agents, mappers=mappers,  # noqa: E731
                                  group=i % groups if groups else None)
    rng = lambda i: np.random.default_rng((seed, i))  # noqa: E731
    if pattern == "react":
        return lambda i: ReActWorkflow(i, named(i), rounds, profile, tokens, rng(i), tool_latency, tool_format,
                                       invocations)
    if tool_latency or tool_format != "text":
        raise ValueError("tool_latency and tool_format apply to ReAct only (the other patterns call no "
                         "tools)")
    if pattern == "parallel":
        return lambda i: ParallelWorkflow(i, named(i), rounds, profile, tokens, rng(i), invocations)
    return lambda i: MapReduceWorkflow(i, named(i)[:-1], named(i)[-1], profile, tokens, rng(i), invocations)


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
