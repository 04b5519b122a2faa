"""/v1/completions and /v1/chat/completions over the engine loop.

One HTTP request becomes prompts x n engine sequences (its choices), queued atomically. Their
outputs arrive on one asyncio queue, are detokenized per choice and either collected into one
response or streamed as server-sent events. A client that goes away aborts its sequences, which
frees their pages: a stream notices on its next write, a plain request through a watcher of the
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from forkjax.engine.sequence import SamplingParams
from forkjax.server.chat_template import chat_prompt_ids
from forkjax.server.detokenizer import IncrementalDetokenizer
from forkjax.server.engine_loop import EngineLoop, RequestHandle
from forkjax.server.protocol import (
    MAX_CHOICES, APIError, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatResponseMessage, ChatStreamChoice, CompletionChoice,
    CompletionRequest, CompletionResponse, UsageInfo)

SSE_DONE = "data: [DONE]\n\n"
log = logging.getLogger("forkjax.serve")


class Generation:
    """The running choices of one HTTP request."""

    def __init__(self, loop: EngineLoop, handles: list[RequestHandle], queue: asyncio.Queue,
                 tokenizer, stop: list[str]):
        self.loop, self.handles, self.queue = loop, handles, queue
        self.detok = [IncrementalDetokenizer(tokenizer, stop) for _ in handles]
        self.open = set(range(len(handles)))

    async def events(self) -> AsyncIterator[tuple[int, str, list[int], str | None]]:
        """(choice, new text, new token ids, finish reason | None) until every choice ends."""
        while self.open:
            out = await self.queue.get()
            i = out.index
            if i not in self.open:
                continue  # a choice cut by a stop string: the tail of its abort
            if out.finish_reason in ("error", "abort"):
                raise _engine_error(out.error)
            d = self.detok[i]
            text = d.add(out.token_ids, final=out.finish_reason is not None)
            reason = out.finish_reason
            if d.stopped and reason is None:
                reason = "stop"
                self.loop.abort([self.handles[i]], stop=True)
            if reason is not None:
                self.open.discard(i)
            yield i, text, out.token_ids, reason

    def close(self):
        """Abort the choices still running (the client left, or the request failed)."""
        if self.open:
            self.loop.abort([self.handles[i] for i in self.open])
            self.open.clear()


def _unknown_fanout(name: str) -> APIError:
    return APIError(404, f"fanout_adapters: the adapter `{name}` does not exist.",
                    param="fanout_adapters", code="model_not_found")


def _engine_error(error: Exception | None) -> APIError:
    if isinstance(error, ValueError):  # e.g. the request stopped fitting the KV cache
        return APIError(400, str(error))
    return APIError(500, f"the engine failed while serving this request: {error!r}", type="server_error")


class OpenAIServing:
    def __init__(self, loop: EngineLoop, model_name: str, tokenizer, *, max_model_len: int,
                 pool_tokens: int, vocab_size: int):
        self.loop, self.model_name, self.tokenizer = loop, model_name, tokenizer
        self.max_model_len, self.pool_tokens, self.vocab_size = max_model_len, pool_tokens, vocab_size

    # ---- shared ---------------------------------------------------------------------------

    def adapter_for(self, model: str | None) -> str | None:
        """`model` -> adapter name (None: the base model), or 404 as OpenAI answers."""
        if model is None or model == self.model_name:
            return None
        if model not in self.loop.adapters:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model

    def check_fanout(self, names: list[str] | None):
        """`fanout_adapters` before anything is queued: 400 off forkkv, 404 for a name that is
        no adapter (the base model has no residual to write)."""
        if names and self.loop.engine.config.cache_policy != "forkkv":
            raise APIError(400, "fanout_adapters needs the forkkv cache policy; this server runs "
                                f"{self.loop.engine.config.cache_policy!r} (--cache-policy)",
                           param="fanout_adapters")
        for name in names or ():
            if name not in self.loop.adapters:
                raise _unknown_fanout(name)

    def max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        """The completion budget: `requested`, or (None) all the context and the KV pool allow."""
        if requested is None:
            requested = min(self.max_model_len, self.pool_tokens) - prompt_len
            if requested >= 1:
                return requested
            requested = 1
        if prompt_len + requested > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in "
                                f"the {param}, {requested} for the completion). Please reduce the length "
                                f"of the {param} or completion.", param=param, code="context_length_exceeded")
        return requested

    def sampling(self, req, max_tokens: int, sample: int) -> SamplingParams:
        top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
        seed = random.getrandbits(32) if req.seed is None else req.seed + sample
        try:
            return SamplingParams(
                max_new_tokens=max_tokens,
                temperature=float(1.0 if req.temperature is None else req.temperature),
                top_p=float(1.0 if req.top_p is None else req.top_p),
                top_k=min(top_k, self.vocab_size), seed=seed & 0xFFFFFFFF,
                stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def start(self, req, adapter: str | None, prompts: list[list[int]],
                    max_tokens: list[int]) -> Generation:
        fanout = req.fanout_adapters
        self.check_fanout(fanout)
        aio, queue = asyncio.get_running_loop(), asyncio.Queue()
        sink = lambda out: aio.call_soon_threadsafe(queue.put_nowait, out)  # noqa: E731
        handles = [RequestHandle(i * req.n + j, ids, adapter, self.sampling(req, budget, j), sink,
                                 session_id=req.session_id, cache_salt=req.cache_salt,
                                 fanout_adapters=fanout)
                   for i, (ids, budget) in enumerate(zip(prompts, max_tokens)) for j in range(req.n)]
        gen = Generation(self.loop, handles, queue, self.tokenizer, req.stop_strings)
        try:
            await asyncio.wrap_future(self.loop.add(handles))
        except KeyError:  # unloaded between our checks and the engine's
            if not fanout or (adapter is not None and adapter not in self.loop.adapters):
                raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                               code="model_not_found") from None
            gone = [n for n in fanout if n not in self.loop.adapters]
            raise _unknown_fanout((gone or fanout)[0]) from None
        except ValueError as e:
            param = "prompt" if isinstance(req, CompletionRequest) else "messages"
            raise APIError(400, str(e), param=param) from None
        return gen

    # ---- /v1/completions ------------------------------------------------------------------

    def completion_prompts(self, prompt, n: int) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        if len(prompt) * n > MAX_CHOICES:
            raise APIError(400, f"{len(prompt)} prompts x n={n} exceeds {MAX_CHOICES} choices per request",
                           param="n" if n > 1 else "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send the prompt as token ids",
                                   param="prompt")
                try:
                    p = self.tokenizer.encode(p)
                except Exception as e:  # whatever the tokenizer refuses came with the request
                    raise APIError(400, f"cannot tokenize the prompt: {e}", param="prompt") from None
            if not p:
                raise APIError(400, "prompt is empty", param="prompt")
            out.append(list(p))
        return out

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        adapter = self.adapter_for(req.model)
        prompts = self.completion_prompts(req.prompt, req.n)
        budgets = [self.max_tokens(req.max_tokens, len(p), "prompt") for p in prompts]
        gen = await self.start(req, adapter, prompts, budgets)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        token_ids = req.return_token_ids or self.tokenizer is None
        usage = lambda n: UsageInfo(prompt_tokens=sum(map(len, prompts)), completion_tokens=n,  # noqa: E731
                                    total_tokens=sum(map(len, prompts)) + n)

        def response(choices, usage=None):
            return CompletionResponse(id=rid, created=created, model=req.model or self.model_name,
                                      choices=choices, usage=usage)

        if req.stream:
            async def chunks():
                n = 0
                async for i, text, ids, reason in gen.events():
                    n += len(ids)
                    if text or reason or token_ids:
                        yield response([CompletionChoice(index=i, text=text, finish_reason=reason,
                                                         token_ids=ids if token_ids else None)])
                if req.stream_options and req.stream_options.include_usage:
                    yield response([], usage(n))
            return _sse(chunks(), gen)

        async def collect():
            texts, ids, reasons = await _gather(gen)
            choices = [CompletionChoice(index=i, text=texts[i], finish_reason=reasons[i],
                                        token_ids=ids[i] if token_ids else None,
                                        prompt_token_ids=h.prompt if req.return_token_ids else None)
                       for i, h in enumerate(gen.handles)]
            return response(choices, usage(sum(map(len, ids))))
        return await _unless_disconnected(raw, collect(), gen)

    # ---- /v1/chat/completions -------------------------------------------------------------

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        adapter = self.adapter_for(req.model)
        try:
            prompt = chat_prompt_ids(self.tokenizer, req.messages, req.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        budget = self.max_tokens(req.max_new_tokens, len(prompt), "messages")
        gen = await self.start(req, adapter, [prompt], [budget])
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model or self.model_name
        usage = lambda n: UsageInfo(prompt_tokens=len(prompt), completion_tokens=n,  # noqa: E731
                                    total_tokens=len(prompt) + n)

        if req.stream:
            def chunk(choices, usage=None):
                return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage)

            async def chunks():
                for i in range(len(gen.handles)):
                    first = ChatResponseMessage(role="assistant", content="")
                    yield chunk([ChatStreamChoice(index=i, delta=first)])
                n = 0
                async for i, text, ids, reason in gen.events():
                    n += len(ids)
                    if text or reason or req.return_token_ids:
                        delta = ChatResponseMessage(content=text if text else None)
                        yield chunk([ChatStreamChoice(index=i, delta=delta, finish_reason=reason,
                                                      token_ids=ids if req.return_token_ids else None)])
                if req.stream_options and req.stream_options.include_usage:
                    yield chunk([], usage(n))
            return _sse(chunks(), gen)

        async def collect():
            texts, ids, reasons = await _gather(gen)
            choices = [ChatChoice(index=i, message=ChatResponseMessage(role="assistant", content=texts[i]),
                                  finish_reason=reasons[i],
                                  token_ids=ids[i] if req.return_token_ids else None)
                       for i in range(len(gen.handles))]
            return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                          usage=usage(sum(map(len, ids))),
                                          prompt_token_ids=prompt if req.return_token_ids else None)
        return await _unless_disconnected(raw, collect(), gen)


async def _gather(gen: Generation):
    """Run a non-streaming request to the end -> (texts, token ids, finish reasons) per choice."""
    n = len(gen.handles)
    texts, ids, reasons = [""] * n, [[] for _ in range(n)], [None] * n
    async for i, text, new, reason in gen.events():
        texts[i] += text
        ids[i] += new
        reasons[i] = reason
    return texts, ids, reasons


def _sse(chunks: AsyncIterator, gen: Generation) -> StreamingResponse:
    """Server-sent events; an error after the stream began is sent as an event, as vLLM does."""
    async def events():
        try:
            async for c in chunks:
                yield f"data: {c.model_dump_json()}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:  # a bug: the stream already said 200, so say it in the stream
            log.exception("stream failed")
            yield f"data: {json.dumps(APIError(500, repr(e), type='server_error').body())}\n\n"
        finally:
            gen.close()  # runs on disconnect too: the response closes this generator
        yield SSE_DONE
    return StreamingResponse(events(), media_type="text/event-stream")


async def _unless_disconnected(raw: Request, work, gen: Generation):
    """Await `work` unless the client disconnects first; then abort its choices."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        gen.close()
    if task in done:
        return task.result()
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def _disconnect(raw: Request):
    while (await raw.receive())["type"] != "http.disconnect":
        pass
