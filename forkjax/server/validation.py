"""The rules every request body follows, whatever its endpoint (protocol.py has the bodies).

Bodies validate strictly: a wrong type is a 400, never a silent coercion ("5" is not 5, though
2.0 is the integer 2), and strings must be valid Unicode. Unknown fields are ignored and named in a warning in the log, as
vLLM does (clients send their own extensions); known OpenAI fields whose feature forkjax does not
implement are accepted only at their neutral value, so a client never gets a silently different
answer than it asked for. Sizes are bounded, so one request cannot queue unbounded work.
"""

from __future__ import annotations

import logging
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

log = logging.getLogger("forkjax.serve")

# One request fans out to at most this many sequences (prompts x n): it bounds the work one
# HTTP request can queue.
MAX_CHOICES = 64
# Stop strings are matched against the text after every token: bound their count and length.
MAX_STOP, MAX_STOP_CHARS = 16, 256
# Bounds on the cache fields (session_id, cache_salt, fanout_adapters): looked up per request
# and per choice.
MAX_ID_CHARS, MAX_FANOUT = 256, 256
# logit_bias entries a request may carry (OpenAI's own bound).
MAX_LOGIT_BIAS = 300


class FieldError(ValueError):
    """A check of a body that concerns one field, whichever validator runs it: the error
    response names `field` as its `param`."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_unicode(data):
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer or encoder accepts: refuse
    them up front. Iterative, so any nesting depth the JSON parser allowed is fine."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("strings must be valid Unicode (a lone surrogate was found)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


class StrictBody(BaseModel):
    """A request body: strict types, unknown fields ignored (and logged), valid Unicode only."""
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        if not isinstance(data, dict):
            check_unicode(data)
        else:
            check_unicode(list(data))  # the names first: a bad one is no field to name
            for name, value in data.items():
                try:
                    check_unicode(value)
                except ValueError as e:
                    raise FieldError(name, str(e)) from None
            # JSON has one number type: 2.0 is the integer 2 (Python's json writes it so)
            data = {k: int(v) if isinstance(v, float) and v.is_integer() and _integer_field(cls, k)
                    else v for k, v in data.items()}
            unknown = sorted(k for k in data if k not in cls.model_fields)
            if unknown:
                log.warning("%s: ignored fields the server does not know: %s", cls.__name__,
                            ", ".join(map(repr, unknown))[:500])
        return data


def _integer_field(model: type[BaseModel], name: str) -> bool:
    """Whether field `name` of `model` takes an int and no float."""
    field = model.model_fields.get(name)
    if field is None:
        return False
    types = typing.get_args(field.annotation) or (field.annotation,)
    return int in types and float not in types


class OpenAIRequest(StrictBody):
    """A body of an OpenAI generation endpoint: the OpenAI fields this server does not implement
    (`neutral_values`: field -> the values that mean "off") are refused at any other value."""
    neutral_values: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, neutral in self.neutral_values.items():
            value = getattr(self, name)
            if value is not None and value not in neutral:  # the value may be long: not quoted
                accepted = " or ".join(map(repr, neutral))
                raise FieldError(name, f"{name}: only {accepted} or null is supported by this server")
        return self


def describe_errors(errors: list[dict], body: type[BaseModel] | None) -> tuple[str, str | None]:
    """A body's validation errors (FastAPI's, located under "body") -> (the message, naming up to
    three; the top-level field at fault first, OpenAI's `param`). `body`: the route's body model,
    whose required fields an empty body lacks."""
    paths = [_path(err) for err in errors]
    if paths == [""] and errors[0].get("type") == "missing" and body is not None:
        required = [name for name, f in body.model_fields.items() if f.is_required()]
        if required:
            return (f"the request body is empty: expected a JSON object with {', '.join(required)}",
                    required[0])
    if paths == [""] and errors[0].get("type") in ("missing", "model_attributes_type", "dict_type"):
        return "the request body must be a JSON object sent as Content-Type: application/json", None
    messages = [err["msg"].removeprefix("Value error, ") for err in errors[:3]]
    message = "; ".join(f"{path}: {text}" if path and not text.startswith(path) else text
                        for path, text in zip(paths, messages))
    return message, (paths[0].split(".")[0] or None) if paths else None


def _raised(err: dict) -> BaseException | None:
    """The exception a validator raised for this error, if one did."""
    return (err.get("ctx") or {}).get("error")


def _path(err: dict) -> str:
    """The dotted path of the field at fault below the body ("": the body itself)."""
    raised = _raised(err)
    if isinstance(raised, FieldError):
        return raised.field
    loc = tuple(err.get("loc", ()))
    return ".".join(str(p) for p in (loc[1:] if loc[:1] == ("body",) else loc))
