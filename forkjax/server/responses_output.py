"""The response body of OpenAI's Responses API and its output items, built from what the chat
machinery reads off the generated text (its content, and the tool-call deltas of tool_calls.py's
parser), and the stream events that announce them.

Content becomes a `message` item with one `output_text` part, each call a `function_call` item;
an item stays open while its text or arguments grow and is closed ("done") when another item
starts or the answer ends. A whole (non-streamed) answer goes through the same builder in one
step and keeps only its items, so both agree. Events are plain dicts in the shape of the
`openai` client's `ResponseStreamEvent` types; `sse_event` numbers and frames them.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from forkjax.server.protocol_responses import FunctionChoice, FunctionTool, TextConfig


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="input tokens whose K/V came from the cache")
    cache_write_tokens: int = Field(0, description="input tokens whose K/V this request computed, "
                                                   "which the cache keeps for later requests")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, output: int, cached: int) -> ResponseUsage:
        details = InputTokensDetails(cached_tokens=cached, cache_write_tokens=prompt - cached)
        return cls(input_tokens=prompt, input_tokens_details=details,
                   output_tokens=output, total_tokens=prompt + output)


Status = Literal["in_progress", "completed", "incomplete"]


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status = "in_progress"
    content: list[OutputTextPart] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Status = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response as OpenAI's Responses API returns it, the request's settings echoed."""
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage | OutputFunctionCall] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: None = None
    store: bool = True
    temperature: float = 1.0
    text: TextConfig
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    top_p: float = 1.0
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False
    service_tier: str = "default"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _dump(model) -> dict:
    return model.model_dump(mode="json", by_alias=True)


class OutputBuilder:
    """One answer's output items; `add` and `finish` return the events of what they changed."""

    def __init__(self):
        self.items: list[OutputMessage | OutputFunctionCall] = []
        self.open: OutputMessage | OutputFunctionCall | None = None  # the last item, still growing
        self.calls: dict[int, int] = {}  # the parser's call index -> the call's output index

    def add(self, text: str, deltas=None) -> list[dict]:
        """New content `text` and tool-call `deltas` (protocol_tools.DeltaToolCall: a call's first
        carries its id and name, the following ones more of its arguments)."""
        events = []
        if text:
            if not isinstance(self.open, OutputMessage):
                events += self._close("completed")
                events += self._start(OutputMessage(id=item_id("msg")))
            self.open.content[0].text += text
            events.append(dict(type="response.output_text.delta", item_id=self.open.id,
                               output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=[]))
        for d in deltas or ():
            if d.id is not None:
                events += self._close("completed")
                events += self._start(OutputFunctionCall(id=item_id("fc"), call_id=d.id, name=d.function.name))
                self.calls[d.index] = len(self.items) - 1
            if d.function.arguments:
                at = self.calls[d.index]
                call = self.items[at]
                call.arguments += d.function.arguments
                events.append(dict(type="response.function_call_arguments.delta", item_id=call.id,
                                   output_index=at, delta=d.function.arguments))
        return events

    def finish(self, incomplete: bool) -> list[dict]:
        """Close the last item: "incomplete" when the answer was cut by max_output_tokens. An
        answer with neither text nor calls still has its (empty) message."""
        events = [] if self.items else self._start(OutputMessage(id=item_id("msg")))
        return events + self._close("incomplete" if incomplete else "completed")

    def _start(self, item) -> list[dict]:
        at = len(self.items)
        self.items.append(item)
        self.open = item
        events = [dict(type="response.output_item.added", output_index=at, item=_dump(item))]
        if isinstance(item, OutputMessage):
            item.content.append(OutputTextPart())
            events.append(dict(type="response.content_part.added", item_id=item.id, output_index=at,
                               content_index=0, part=_dump(item.content[0])))
        return events

    def _close(self, status: str) -> list[dict]:
        item, at = self.open, len(self.items) - 1
        if item is None:
            return []
        self.open = None
        item.status = status
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [dict(type="response.output_text.done", item_id=item.id, output_index=at, content_index=0,
                           text=part.text, logprobs=[]),
                      dict(type="response.content_part.done", item_id=item.id, output_index=at,
                           content_index=0, part=_dump(part))]
        else:
            events = [dict(type="response.function_call_arguments.done", item_id=item.id, output_index=at,
                           arguments=item.arguments)]
        return events + [dict(type="response.output_item.done", output_index=at, item=_dump(item))]


def sse_event(event: dict, seq: int) -> str:
    """One server-sent event as OpenAI frames them: an `event:` line with the type, and the
    event with its sequence number as `data:`."""
    return f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': seq})}\n\n"
