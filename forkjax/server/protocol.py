"""Request bodies of the OpenAI API subset forkjax serves, and its error shape (responses.py has
its responses).

Requests validate as validation.py says (strict types, bounded sizes, unimplemented fields only
at their neutral value). vLLM's extensions (top_k, ignore_eos, stop_token_ids,
return_token_ids, add_generation_prompt, continue_final_message, load_inplace, cache_salt, the
guided_* family, structured_outputs) keep vLLM's names;
forkjax's own (session_id, fanout_adapters) steer its KV cache.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from forkjax.sampling_params import MAX_LOGPROBS
from forkjax.server.protocol_tools import (MAX_TOOLS, ChatTool, MessageToolCall, NamedToolChoice,
                                           OutputConstraints)
from forkjax.server.validation import (MAX_CHOICES, MAX_FANOUT, MAX_ID_CHARS, MAX_LOGIT_BIAS,
                                       MAX_STOP, MAX_STOP_CHARS, FieldError, OpenAIRequest,
                                       StrictBody)
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error to answer with `status` and the OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code)).model_dump()


def shutting_down() -> APIError:
    """The answer to a request the server stopped before it finished: 503, which clients may
    retry elsewhere."""
    return APIError(503, "the server is shutting down: the request was aborted before it finished",
                    type="server_error", code="server_shutting_down")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class _Sampling(OpenAIRequest, OutputConstraints):
    model: str | None = Field(None, description="an adapter name, or the base model's name")
    lora_path: str | None = Field(
        None, min_length=1, max_length=MAX_ID_CHARS,
        description="SGLang's field: the adapter to run, by name; it wins over `model`. A gateway "
                    "that knows a worker by its base model (SMG) routes on `model` and forwards it")
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, description="vLLM: -1 or 0 is off")
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=1024)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, le=100, allow_inf_nan=False,
                                             description="vLLM: 1 is off")
    logit_bias: dict[str, float] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (a string) -> a bias in [-100, 100]")
    min_tokens: int = Field(0, ge=0, description="vLLM: stop tokens are masked until this many are out")
    include_stop_str_in_output: bool = Field(False, description="vLLM: keep the stop string")
    session_id: str | None = Field(
        None, min_length=1, max_length=MAX_ID_CHARS,
        description="forkjax: the requests of one workflow share it: the server admits whole "
                    "workflows as they fit and keeps a workflow's KV pages between its turns, until "
                    "a request with session_end finishes or it has been idle for --session-ttl")
    session_end: bool = Field(
        False, description="forkjax: this request is its workflow's last: the session's pages are "
                           "released as soon as it finishes (needs session_id)")
    session_tokens: int | None = Field(
        None, ge=1, le=2**31 - 1,
        description="forkjax: the tokens the workflow expects to hold at its end (its final length), "
                    "a hint for admitting whole workflows (needs session_id)")
    session_next_s: float | None = Field(
        None, ge=0, le=1e9,
        description="forkjax: seconds from this request's end to the workflow's next request (a "
                    "tool call's expected time): with a host KV tier, the workflow's pages that "
                    "went to host memory are loaded back shortly before (needs session_id)")
    cache_salt: str | None = Field(
        None, min_length=1, max_length=MAX_ID_CHARS,
        description="requests share cached KV pages (base and residual) only with requests of the "
                    "same salt; under forkkv agents of one salt read each other's base cache, so "
                    "use one salt per trust domain")
    fanout_adapters: list[str] | None = Field(
        None, max_length=MAX_FANOUT,
        description="forkjax (forkkv policy): adapters whose residual KV this request also writes, so "
                    "their later requests on this prefix hit; null: the server's --residual-fanout, "
                    "[]: none")

    @model_validator(mode="after")
    def _check_stop(self):
        stops = self.stop_strings
        if len(stops) > MAX_STOP or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise FieldError("stop", f"stop: at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} "
                                     "characters")
        return self

    @model_validator(mode="after")
    def _adapter_by_lora_path(self):
        if self.lora_path is not None:
            self.model = self.lora_path
        return self

    @model_validator(mode="after")
    def _check_session(self):
        if self.session_id is None:
            for name, given in (("session_end", self.session_end),
                                ("session_tokens", self.session_tokens is not None),
                                ("session_next_s", self.session_next_s is not None)):
                if given:
                    raise FieldError(name, f"{name} needs a session_id")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, token ids, or a batch of either")
    echo: bool = Field(False, description="the prompt precedes the completion in text and logprobs")
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo: the prompt scored alone")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="vLLM: each prompt token's logprob and its "
                                                 "most likely alternatives, in the choice")
    best_of: int | None = None
    suffix: str | None = None
    prompt_token_ids: list[int] | None = Field(
        None, min_length=1, description="the prompt as token ids, in place of `prompt` (then \"\"): "
                                        "for a gateway that takes only text prompts (SMG), which "
                                        "forwards this field as sent")

    neutral_values = {"best_of": (1,), "suffix": ("",)}

    @model_validator(mode="after")
    def _prompt_from_token_ids(self):
        if self.prompt_token_ids is not None:
            if self.prompt != "":
                raise FieldError("prompt_token_ids", "prompt_token_ids replaces the prompt: send "
                                                     "prompt \"\" with it")
            self.prompt = self.prompt_token_ids
        return self

    @field_validator("max_tokens")
    @classmethod
    def _zero_with_echo(cls, v, info: ValidationInfo):
        if v == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens=0 needs echo: true (the prompt's logprobs alone)")
        return v

    @property
    def scores_prompt(self) -> int | None:
        """Alternatives each prompt token's logprob lists, or None: the prompt is not scored."""
        if self.prompt_logprobs is not None:
            return max(self.prompt_logprobs, self.logprobs or 0)
        return self.logprobs if self.echo else None


class TextContent(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContent] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, sent back
    tool_call_id: str | None = None  # a tool message: the call it answers

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI; see max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="vLLM: the prompt ends inside the last "
                                                            "(assistant) message, which the output continues")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call")

    @model_validator(mode="after")
    def _check_format(self):
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise FieldError("tool_choice", "tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
                t.function.name for t in self.tools}:
            raise FieldError("tool_choice", f"tool_choice: no tool is named "
                                            f"{self.tool_choice.function.name!r}")
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise FieldError("continue_final_message", "continue_final_message needs add_generation_prompt: "
                                                       "false and an assistant message last")
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class LoadLoRAAdapterRequest(StrictBody):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096,
                           description="a PEFT directory: adapter_config.json + adapter_model.safetensors")
    load_inplace: bool = Field(False, description="replace an adapter already loaded under this name")
    pinned: bool = Field(False, description="keep it in a device slot (adapters beyond the slots wait "
                                            "on the host and swap in when a request needs them)")


class UnloadLoRAAdapterRequest(StrictBody):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
