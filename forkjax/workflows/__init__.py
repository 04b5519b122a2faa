"""Agent workflows (ReAct, MapReduce) over length profiles of real datasets, and the drivers that
run them closed-loop against an Engine in process or a server over HTTP."""

from __future__ import annotations

import numpy as np

from forkjax.workflows.base import TokenSampler, TurnRequest, Workflow
from forkjax.workflows.mapreduce import MapReduceWorkflow
from forkjax.workflows.profiles import PROFILES, LengthDist, Profile, fixed_profile, get_profile
from forkjax.workflows.react import ReActWorkflow
from forkjax.workflows.results import RequestRecord, RunResult

PATTERNS = ("react", "mapreduce")


def agent_names(pattern: str, *, agents: int = 3, mappers: int = 4) -> list[str]:
    """Adapter names of one workflow's agents: ReAct agent0..; MapReduce mapper0.. + reducer."""
    if pattern == "react":
        return [f"agent{i}" for i in range(agents)]
    if pattern == "mapreduce":
        return [f"mapper{i}" for i in range(mappers)] + ["reducer"]
    raise ValueError(f"pattern {pattern!r}: expected one of {PATTERNS}")


def make_workflows(pattern: str, n: int, profile: Profile, tokens: TokenSampler, *, seed: int = 0,
                   agents: int = 3, rounds: int = 4, mappers: int = 4,
                   tool_latency: float = 0.0) -> list[Workflow]:
    """`n` workflows `wf0..` of one shape; workflow i draws from Generator((seed, i)), so
    workflow 0 is the same whatever `n`."""
    names = agent_names(pattern, agents=agents, mappers=mappers)
    rng = lambda i: np.random.default_rng((seed, i))  # noqa: E731
    if pattern == "react":
        return [ReActWorkflow(i, names, rounds, profile, tokens, rng(i), tool_latency) for i in range(n)]
    if tool_latency:
        raise ValueError("tool_latency applies to ReAct only (MapReduce calls no tools)")
    return [MapReduceWorkflow(i, names[:-1], names[-1], profile, tokens, rng(i)) for i in range(n)]


def longest_request(pattern: str, profile: Profile, *, agents: int = 3, rounds: int = 4,
                    mappers: int = 4) -> int:
    """Prompt + generated tokens of the longest call a workflow of this shape can make."""
    if pattern == "react":
        return ReActWorkflow.longest_request(profile, agents, rounds)
    if pattern == "mapreduce":
        return MapReduceWorkflow.longest_request(profile, mappers)
    raise ValueError(f"pattern {pattern!r}: expected one of {PATTERNS}")


__all__ = ["PATTERNS", "PROFILES", "LengthDist", "MapReduceWorkflow", "Profile", "ReActWorkflow",
           "RequestRecord", "RunResult", "TokenSampler", "TurnRequest", "Workflow", "agent_names",
           "fixed_profile", "get_profile", "longest_request", "make_workflows"]
