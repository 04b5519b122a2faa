"""Fidelity of the cache policies on your own model, agents and prompts (`python -m
forkjax.fidelity`, __main__.py): tasks from JSONL (tasks.py), each run alone (exact) and under
every policy as served (runner.py), compared task by task with bootstrap intervals (metrics.py);
runs over other task files merged into one result (`python -m forkjax.fidelity.merge`)."""

from forkjax.fidelity.metrics import compare, paired_difference
from forkjax.fidelity.runner import run_policy, targets_of
from forkjax.fidelity.tasks import FidelityTask, correct, load_tasks

__all__ = ["FidelityTask", "compare", "correct", "load_tasks", "paired_difference", "run_policy",
           "targets_of"]
