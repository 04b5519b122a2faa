"""The request body of OpenAI's Responses API (`POST /v1/responses`) and the items of its
`input` (serving_responses.py runs it through the chat machinery; responses_output.py has the
response body and its stream events).

What the request may carry is what the OpenAI Agents SDK's default model sends, at the values
this server implements: text and function-call items, function tools, `text.format`, sampling,
`previous_response_id`. Every other field of OpenAI's API (built-in tools, files and images,
reasoning, background, conversations, stored prompts, ...) is refused with a 400 naming it
rather than ignored, as the chat endpoint refuses what it does not implement; within items and
tools an unknown key is refused too. Top-level fields outside OpenAI's API are ignored and
logged, as on every endpoint (validation.py). The forkjax extension fields of the chat endpoint
(`seed`, `top_k`, `repetition_penalty`, the session and cache fields) keep their chat
definitions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, ValidationError, field_validator,
                      model_validator)

from forkjax.server.protocol import ChatCompletionRequest
from forkjax.server.protocol_tools import MAX_TOOLS
from forkjax.server.validation import FieldError, OpenAIRequest

_CHAT = ChatCompletionRequest.model_fields


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# ---- input items ----------------------------------------------------------------------------

class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    """An earlier answer's text, sent back; its annotations and logprobs describe that answer
    and do not enter the prompt."""
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[InputText | OutputText, Discriminator("type")]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_MODELS = {"message": MessageItem, "function_call": FunctionCallItem,
               "function_call_output": FunctionCallOutputItem}
PART_TYPES = ("input_text", "output_text")


def parse_items(items) -> list:
    """`input` as sent -> its items (text is one user message), or FieldError naming the item at
    fault: each item is validated by its own model, so that an error says which item and field
    (a union's errors would list every member's), and a type this server has no use for (files,
    images, built-in tools' calls, reasoning) is named as unsupported."""
    if isinstance(items, str):
        return [MessageItem(role="user", content=items)]
    if not isinstance(items, list):
        raise FieldError("input", "input: expected a string or a list of items")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise FieldError("input", f"input[{i}]: expected an item (a JSON object)")
        kind = item.get("type", "message")
        model = ITEM_MODELS.get(kind)
        if model is None:
            raise FieldError("input", f"input[{i}]: items of type {kind!r} are not supported by this "
                                      f"server (only {', '.join(ITEM_MODELS)})")
        parts = item.get("content") if kind == "message" else item.get("output")
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            ptype = part.get("type") if isinstance(part, dict) else None
            if ptype not in PART_TYPES:
                raise FieldError("input", f"input[{i}].content[{j}]: content of type {ptype!r} is not "
                                          "supported by this server (text only: input_text, output_text)")
        try:
            out.append(model.model_validate(item))
        except ValidationError as e:
            err = max(e.errors(), key=lambda x: len(x["loc"]))  # the deepest: not a union's other member
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]
                            if not isinstance(p, str) or not (p == "str" or "[" in p or p in PART_TYPES))
            raise FieldError("input", f"input[{i}]{where}: {err['msg']}") from None
    return out


# ---- tools and output format ----------------------------------------------------------------

class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Discriminator("type")] | None = None
    verbosity: None = Field(None, description="refused: the model's verbosity cannot be set")


class StreamOptions(_Strict):
    include_obfuscation: Literal[False] = Field(
        False, description="false only: stream events carry no obfuscation padding")


# OpenAI fields whose features this server does not have: refused at any value but null.
UNSUPPORTED = ("access_programs", "background_options", "context_management", "conversation", "image",
               "max_tool_calls", "moderation", "prompt", "prompt_cache_key", "prompt_cache_options",
               "prompt_cache_retention")


class ResponsesRequest(OpenAIRequest):
    model: str | None = Field(None, description="an adapter name, or the base model's name")
    # validated by parse_items into a list of items, whichever was sent
    input: str | list[InputItem] = Field(
        description="text (one user message), or message, function_call and function_call_output items")
    instructions: str | None = Field(None, description="a system message before the input; not "
                                                       "carried on by previous_response_id")
    previous_response_id: str | None = Field(
        None, min_length=1, description="a stored response whose input and output items precede this input")
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = _CHAT["temperature"]
    top_p: float | None = _CHAT["top_p"]
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = Field(None, description="false: the response is not kept for previous_response_id")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="echoed in the response")
    user: str | None = None
    safety_identifier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = Field(None, description="null only: no reasoning model is served")
    background: bool | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    # the chat endpoint's extensions, as it defines them
    seed: int | None = _CHAT["seed"]
    top_k: int | None = _CHAT["top_k"]
    repetition_penalty: float | None = _CHAT["repetition_penalty"]
    session_id: str | None = _CHAT["session_id"]
    session_end: bool = _CHAT["session_end"]
    session_tokens: int | None = _CHAT["session_tokens"]
    session_next_s: float | None = _CHAT["session_next_s"]
    cache_salt: str | None = _CHAT["cache_salt"]
    fanout_adapters: list[str] | None = _CHAT["fanout_adapters"]

    neutral_values = {"truncation": ("disabled",), "include": ([],), "background": (False,),
                      "service_tier": ("auto", "default"), "top_logprobs": (0,)}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_features(cls, data):
        for name in UNSUPPORTED:
            if isinstance(data, dict) and data.get(name) is not None:
                raise FieldError(name, f"{name} is not supported by this server")
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _parse_items(cls, v):
        return parse_items(v)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, v):
        for i, tool in enumerate(v if isinstance(v, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise FieldError("tools", f"tools[{i}]: tools of type {kind!r} are not supported by this "
                                          "server (function tools only)")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, v):
        if isinstance(v, dict) and v.get("type") != "function":
            raise FieldError("tool_choice", f"tool_choice: {v.get('type')!r} is not supported by this "
                                            "server (none, auto, required or a function)")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.reasoning is not None and any(v is not None for v in self.reasoning.values()):
            raise FieldError("reasoning", "reasoning: only null is supported (no reasoning model is served)")
        if not self.input and self.previous_response_id is None:
            raise FieldError("input", "input is empty")
        return self  # the rest (tool_choice against tools, ...) as its chat request checks it

