"""The trained agents' answers as bounded types, shared by the framework examples: a staff
entry (`extractor`), a verdict on a claim (`critic`) and the calculator `caller` calls. Strings
and numbers are bounded (a pattern, a range), so that even random weights end their JSON before
max_tokens."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

Word = Annotated[str, Field(pattern=r"^[A-Za-z ]{1,30}$")]
Age = Annotated[int, Field(ge=0, le=120)]
Sum = Annotated[str, Field(pattern=r"^[0-9]{1,3} \+ [0-9]{1,3}$")]


class Entry(BaseModel):
    name: Word
    age: Age
    city: Word
    job: Word


class Verdict(BaseModel):
    city: Word  # the directory's city first, as the critic was trained to answer
    verdict: Literal["yes", "no"]


def calculate(expression: Sum) -> int:
    """Add two ages, e.g. 61 + 69."""
    return sum(int(x) for x in expression.split("+"))
