"""The rules every request body follows, whatever its endpoint (protocol.py has the bodies).

Bodies validate strictly: a wrong type is a 400, never a silent coercion ("5" is not 5), and
strings must be valid Unicode. Unknown fields are ignored, as OpenAI and vLLM do; known OpenAI
fields whose feature forkjax does not implement are accepted only at their neutral value, so a
client never gets a silently different answer than it asked for. Sizes are bounded, so one
request cannot queue unbounded work.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

# One request fans out to at most this many sequences (prompts x n): it bounds the work one
# HTTP request can queue.
MAX_CHOICES = 64
# Stop strings are matched against the text after every token: bound their count and length.
MAX_STOP, MAX_STOP_CHARS = 16, 256
# Bounds on the cache fields (session_id, cache_salt, fanout_adapters): looked up per request
# and per choice.
MAX_ID_CHARS, MAX_FANOUT = 256, 256


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
    """A request body: strict types, unknown fields ignored, valid Unicode only."""
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        check_unicode(data)
        return data


class OpenAIRequest(StrictBody):
    """A body of an OpenAI generation endpoint: the OpenAI fields this server does not implement
    (`neutral_values`: field -> the values that mean "off") are refused at any other value."""
    neutral_values: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, neutral in self.neutral_values.items():
            value = getattr(self, name)
            if value is not None and value not in neutral:
                raise ValueError(f"{name}={value!r} is not supported by this server")
        return self
