"""vLLM's POST /tokenize and POST /detokenize: the server's tokenizer and chat template, as the
generation endpoints apply them, for clients that count or inspect tokens."""

from __future__ import annotations

from pydantic import BaseModel, Field

from forkjax.server.chat_template import chat_prompt_ids
from forkjax.server.protocol import APIError, ChatMessage
from forkjax.server.protocol_tools import MAX_TOOLS, ChatTool, tool_dicts
from forkjax.server.validation import StrictBody

MAX_TOKENS = 1 << 20  # a body of 8 MB holds about this many ids


class TokenizeRequest(StrictBody):
    model: str | None = Field(None, description="an adapter name, or the base model's name")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = Field(True, description="prompt: prepend the BOS token")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS,
                                         description="messages: rendered as a chat completion does")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TOKENS)


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(tokenizer, req: TokenizeRequest, max_model_len: int) -> TokenizeResponse:
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", param="prompt")
    if req.prompt is not None and (req.tools or req.continue_final_message):
        raise APIError(400, "tools and continue_final_message go with messages", param="prompt")
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param="model")
    try:
        if req.prompt is not None:
            ids = tokenizer.encode(req.prompt, add_bos=req.add_special_tokens)
        else:
            ids = chat_prompt_ids(tokenizer, req.messages, req.add_generation_prompt,
                                  tool_dicts(req.tools), req.continue_final_message)
    except Exception as e:  # whatever the tokenizer or the template refuses came with the request
        raise APIError(400, f"cannot tokenize: {e}",
                       param="prompt" if req.prompt is not None else "messages") from None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=list(ids))


def detokenize(tokenizer, req: DetokenizeRequest, vocab_size: int) -> DetokenizeResponse:
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param="model")
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})",
                       param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))
