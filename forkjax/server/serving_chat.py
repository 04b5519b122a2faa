"""/v1/chat/completions over the engine-core process: the messages through the model's chat
template (chat_template.py), the output constraint (structured.py) and the tool calls read back
from the output (tool_calls.py), whole or streamed.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from forkjax.server.chat_template import chat_prompt_ids
from forkjax.server.logprobs import chat_logprobs
from forkjax.server.protocol import APIError, ChatCompletionRequest
from forkjax.server.protocol_tools import ChatDelta, tool_dicts
from forkjax.server.responses import (ChatChoice, ChatCompletionChunk, ChatCompletionResponse,
                                      ChatResponseMessage, ChatStreamChoice, UsageInfo)
from forkjax.server.serving import OpenAIServing
from forkjax.server.streaming import gather, sse, unless_disconnected
from forkjax.server.structured import request_grammar
from forkjax.server.tool_calls import parser_for, tool_constraint


def _finish_reason(reason: str | None, parser) -> str | None:
    """A choice that called tools and stopped ends "tool_calls" (OpenAI's)."""
    return "tool_calls" if reason == "stop" and parser is not None and parser.called else reason


class OpenAIServingChat(OpenAIServing):
    async def start_chat(self, req: ChatCompletionRequest):
        """Queue `req`'s choices -> (their Generation, the prompt's token ids, a factory of one
        choice's output parser: `parser_for`'s, None without tools). What every chat request
        does before its answer takes its shape: the Responses API (serving_responses.py) shapes
        the same choices its own way."""
        adapter = self.adapter_for(req.model)
        try:
            prompt = chat_prompt_ids(self.tokenizer, req.messages, req.add_generation_prompt,
                                     tool_dicts(req.tools), req.continue_final_message)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        guided = tool_constraint(req, request_grammar(req))
        budget = self.max_tokens(req.max_new_tokens, len(prompt), "messages")
        gen = await self.start(req, adapter, [prompt], [budget], guided)
        return gen, prompt, lambda: parser_for(req)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        gen, prompt, new_parser = await self.start_chat(req)
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model or self.model_name
        usage = lambda n: UsageInfo.of(len(prompt), n, gen.cached_tokens(req.n))  # noqa: E731
        logprobs = lambda e: (chat_logprobs(self.tokenizer, e.token_ids, e.logprobs)  # noqa: E731
                              if req.logprobs else None)

        if req.stream:
            def chunk(choices, usage=None):
                return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage)

            async def chunks():
                parsers = [new_parser() for _ in range(gen.choices)]
                for i in range(gen.choices):
                    yield chunk([ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                n = 0
                async for e in gen.events():
                    n += len(e.token_ids)
                    parser = parsers[e.index]
                    text, calls = (e.text, None) if parser is None else parser.add(
                        e.text, final=e.finish_reason is not None)
                    if text or calls or e.finish_reason or req.return_token_ids or (e.token_ids and req.logprobs):
                        delta = ChatDelta(content=text or None, tool_calls=calls or None)
                        yield chunk([ChatStreamChoice(
                            index=e.index, delta=delta, finish_reason=_finish_reason(e.finish_reason, parser),
                            logprobs=logprobs(e), token_ids=e.token_ids if req.return_token_ids else None)])
                if req.stream_options and req.stream_options.include_usage:
                    yield chunk([], usage(n))
            return sse(chunks(), gen)

        def choice(e) -> ChatChoice:
            parser = new_parser()
            text = e.text if parser is None else parser.add(e.text, final=True)[0]
            calls = parser.calls if parser is not None and parser.called else None
            return ChatChoice(index=e.index, message=ChatResponseMessage(
                content=text if text or calls is None else None, tool_calls=calls),
                finish_reason=_finish_reason(e.finish_reason, parser), logprobs=logprobs(e),
                token_ids=e.token_ids if req.return_token_ids else None)

        async def collect():
            done = await gather(gen)
            return ChatCompletionResponse(id=rid, created=created, model=model,
                                          choices=[choice(e) for e in done],
                                          usage=usage(sum(len(e.token_ids) for e in done)),
                                          prompt_token_ids=prompt if req.return_token_ids else None)
        return await unless_disconnected(raw, collect(), gen)
