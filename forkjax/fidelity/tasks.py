"""Fidelity tasks from JSONL: one task a line, a shared context that a writer agent prefills and a
reader agent then asks about.

    {"context": "...", "task": "...", "answer": "...", "writer": "planner", "reader": "critic",
     "check": "exact"}

`context`, `task` and `answer` are text (the model's tokenizer encodes them: the context with
BOS, the others without, so that the context's tokens are a prefix of every prompt on it) or
lists of token ids (a checkpoint without a tokenizer). `answer` is optional: without it the
positions compared are exact's greedy continuation. `check` says when an output is right:
"exact" (its first line, stripped, is the answer; with ids, it begins with the answer's ids),
"contains" (the answer occurs in it), {"regex": PATTERN} (re.search finds it; no answer
needed) or {"json": FIELD} (the first JSON object in it has FIELD, dotted for nesting, equal to
the answer; "." compares the whole object with the answer's). A bad line is a ValueError naming
the file and line.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection

@dataclasses.dataclass(frozen=True)
class FidelityTask:
    context: tuple[int, ...]  # token ids, BOS included when encoded from text
    task: tuple[int, ...]
    answer: tuple[int, ...] | None  # token ids of the expected answer, if given
    answer_text: str | None
    writer: str
    reader: str
    check: str = "exact"
    arg: str | None = None  # the regex, or the JSON field
    line: int = 0

    @property
    def prompt(self) -> list[int]:
        return [*self.context, *self.task]

    @property
    def scored(self) -> bool:
        """Whether an output can be right or wrong (an answer, or a regex to match)."""
        return self.answer is not None or self.check == "regex"


def load_tasks(path: str, tokenizer, adapters: Collection[str]) -> list[FidelityTask]:
    """Tasks of the JSONL file at `path`; `tokenizer` (encode/decode, or None) encodes text
    fields; writer and reader must be among `adapters`."""
    tasks = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    tasks.append(_task(json.loads(line), tokenizer, adapters, n))
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: {e}") from None
    if not tasks:
        raise ValueError(f"{path}: no tasks (one JSON object a line)")
    return tasks


def _task(obj, tokenizer, adapters, n: int) -> FidelityTask:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if missing := [k for k in ("context", "task", "writer", "reader") if k not in obj]:
        raise ValueError(f"missing {', '.join(missing)}")
    if unknown := set(obj) - {"context", "task", "answer", "writer", "reader", "check"}:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
    for role in ("writer", "reader"):
        if obj[role] not in adapters:
            raise ValueError(f"{role} {obj[role]!r} is not an adapter given with --lora "
                             f"({', '.join(sorted(adapters)) or 'none'})")
    check, arg = _check(obj.get("check", "exact"))
    answer = obj.get("answer")
    if check in ("regex", "json") or (check == "contains" and isinstance(answer, str)):
        if tokenizer is None:
            raise ValueError(f"check {check!r} reads text: the model has no tokenizer")
    if check == "json" and answer is None:
        raise ValueError("check 'json' needs an answer to compare the field with")
    answer_ids = None if answer is None else _ids(answer, "answer", tokenizer, bos=False)
    if answer_ids is not None and not answer_ids:
        raise ValueError("answer is empty")
    return FidelityTask(tuple(_ids(obj["context"], "context", tokenizer, bos=True)),
                        tuple(_ids(obj["task"], "task", tokenizer, bos=False)),
                        None if answer_ids is None else tuple(answer_ids),
                        answer if isinstance(answer, str) else None,
                        obj["writer"], obj["reader"], check, arg, n)


def _check(spec) -> tuple[str, str | None]:
    if isinstance(spec, str) and spec in ("exact", "contains"):
        return spec, None
    if isinstance(spec, dict) and len(spec) == 1:
        (kind, arg), = spec.items()
        if kind in ("regex", "json") and isinstance(arg, str) and arg:
            if kind == "regex":
                try:
                    re.compile(arg)
                except re.error as e:
                    raise ValueError(f"check regex {arg!r}: {e}") from None
            return kind, arg
    raise ValueError(f"check {spec!r}: expected \"exact\", \"contains\", {{\"regex\": PATTERN}} "
                     "or {\"json\": FIELD}")


def _ids(value, field: str, tokenizer, bos: bool) -> list[int]:
    if isinstance(value, str):
        if tokenizer is None:
            raise ValueError(f"{field} is text but the model has no tokenizer: give token ids")
        return tokenizer.encode(value, add_bos=bos)
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                       for i in value):
        return list(value)
    raise ValueError(f"{field} must be text or a list of token ids (non-negative integers)")


def correct(task: FidelityTask, output: list[int], tokenizer) -> bool | None:
    """Whether `output` (token ids) answers `task` right; None when the task has no answer."""
    if not task.scored:
        return None
    if task.answer_text is None and task.check in ("exact", "contains"):  # ids
        a, n = list(task.answer), len(task.answer)
        if task.check == "exact":
            return list(output[:n]) == a
        return any(list(output[i:i + n]) == a for i in range(len(output) - n + 1))
    text = tokenizer.decode(output)
    if task.check == "exact":
        return (text.strip().split("\n") or [""])[0].strip() == task.answer_text.strip()
    if task.check == "contains":
        return task.answer_text.strip() in text
    if task.check == "regex":
        return re.search(task.arg, text) is not None
    answer = task.answer_text if task.answer_text is not None else tokenizer.decode(task.answer)
    if task.arg == ".":
        return (got := _first_object(text)) is not None and got == _first_object(answer)
    return _json_field(text, task.arg) == answer.strip()


def _first_object(text: str):
    """The first JSON object in `text`; None when there is none."""
    start = text.find("{")
    while start >= 0:
        try:
            return json.JSONDecoder().raw_decode(text[start:])[0]
        except ValueError:
            start = text.find("{", start + 1)
    return None


def _json_field(text: str, field: str) -> str | None:
    """`field` (dotted) of the first JSON object in `text`, as text (a string stripped, other
    values as JSON); None when there is none."""
    value = _first_object(text)
    for key in field.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value.strip() if isinstance(value, str) else json.dumps(value)
