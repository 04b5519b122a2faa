"""The bodies of structured outputs and tool calls in the OpenAI API (protocol.py has the rest):
`response_format`, vLLM's `guided_*` and `structured_outputs`, `tools` and `tool_choice` in
requests, `tool_calls` in responses and stream deltas.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# A JSON schema (or a grammar) is compiled per request: bound its size.
MAX_TOOLS = 128


# Unknown keys in these objects are refused, not ignored: each may change the output.
class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """text: unconstrained; json_object: any JSON object; json_schema: JSON that validates
    against `json_schema.schema` (enforced whether `strict` or not)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of json (a schema), regex, choice, grammar (Lark or
    GBNF), json_object."""
    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # enforced where the output is constrained to calls (tool_choice required or this function);
    # with auto the model may not call at all, so its arguments are parsed as written (vLLM's)
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"] = "function"
    function: FunctionDefinition


def tool_dicts(tools: list[ChatTool] | None) -> list[dict] | None:
    """A request's tools as OpenAI sends them, for the chat template (None when it has none)."""
    return [t.model_dump(exclude_none=True) for t in tools or ()] or None


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(None, exclude_if=lambda v: v is None)
    arguments: str | None = Field(None, exclude_if=lambda v: v is None)


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: its first carries `id`, `type` and the name, the
    following ones more of its arguments (concatenated by the client)."""
    index: int
    id: str | None = Field(None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda v: v is None)
    function: DeltaFunctionCall


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant message, sent back in the next turn."""
    model_config = ConfigDict(strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class OutputConstraints(BaseModel):
    """The output constraint fields of both generation endpoints (at most one a request:
    structured.py)."""
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = Field(None, description="vLLM: the output is JSON that validates "
                                                             "against this schema")
    guided_regex: str | None = Field(None, description="vLLM: the output matches this regex")
    guided_choice: list[str] | None = Field(None, min_length=1, description="vLLM: the output is one of these")
    guided_grammar: str | None = Field(None, description="vLLM: the output follows this Lark or GBNF grammar")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM: one of json, regex, choice, grammar, json_object")
    guided_whitespace_pattern: str | None = Field(
        None, description="vLLM: refused here: JSON is generated without free whitespace")


class ChatDelta(BaseModel):
    """A chat stream chunk's delta."""
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=lambda v: v is None)
