"""Response bodies of the OpenAI API subset forkjax serves (protocol.py has its requests)."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from forkjax.server.protocol_tools import ChatDelta, ToolCall


def _omitted_if_none(default=None, **kw):
    """A response field left out when None (OpenAI sends no `role` in later stream deltas)."""
    return Field(default, exclude_if=lambda v: v is None, **kw)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens whose K/V came from the cache")


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape: per token, its text, its offset in the choice's text,
    its logprob and the most likely alternatives (text -> logprob)."""
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = _omitted_if_none(
        description="vLLM: with prompt_logprobs, per prompt token (the first: null)")
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = _omitted_if_none(description="vLLM: with return_token_ids")
    prompt_token_ids: list[int] | None = _omitted_if_none(description="vLLM: with return_token_ids")


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _omitted_if_none()


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None  # null beside tool_calls, as OpenAI sends it
    tool_calls: list[ToolCall] | None = _omitted_if_none()


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    token_ids: list[int] | None = _omitted_if_none(description="vLLM: with return_token_ids")


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    token_ids: list[int] | None = _omitted_if_none(description="vLLM: with return_token_ids")


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = _omitted_if_none(description="vLLM: with return_token_ids")


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = _omitted_if_none()


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "forkjax"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
