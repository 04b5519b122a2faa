"""The running choices of one HTTP request, and how their outputs reach the client.

The choices' outputs arrive on one asyncio queue (`Generation.events`), are detokenized per
choice, cut at stop strings, and either collected into one response (`gather`) or streamed as
server-sent events (`sse`). A client that goes away aborts its choices, which frees their
pages: a stream through Starlette's watcher of the connection, a plain request through ours
(`unless_disconnected`), as does a prompt being scored before either (`until_disconnected`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from forkjax.server.core_client import CoreClient, RequestStream
from forkjax.server.detokenizer import IncrementalDetokenizer
from forkjax.server.messages import Output
from forkjax.server.protocol import APIError, shutting_down

SSE_DONE = "data: [DONE]\n\n"
log = logging.getLogger("forkjax.serve")


@dataclasses.dataclass
class Event:
    """New output of one choice: text, token ids, (logprob, top ids, top logprobs) per token
    when asked for, and the finish reason on its last."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None


class Generation:
    """The running choices of one HTTP request (request `rid` of `client`)."""

    def __init__(self, client: CoreClient, rid: int, stream: RequestStream, tokenizer,
                 stop: list[str], include_stop: bool = False):
        self.client, self.rid, self.queue, self.choices = client, rid, stream.queue, stream.choices
        self.detok = [IncrementalDetokenizer(tokenizer, stop, include_stop) for _ in range(self.choices)]
        self.open = set(range(self.choices))
        self.cached = [0] * self.choices  # per choice: prompt tokens whose K/V came from the cache

    def cached_tokens(self, per_prompt: int) -> int:
        """Prompt tokens read from the cache, for `usage`: per prompt (its `per_prompt` choices
        in a row), the fewest any of its choices read (a choice that computed the prompt while
        another waited on its pages counts it as computed), summed over the prompts."""
        c = self.cached
        return sum(min(c[i:i + per_prompt]) for i in range(0, len(c), per_prompt))

    async def events(self) -> AsyncIterator[Event]:
        """The choices' new outputs until every choice ends."""
        while self.open:
            out = await self.queue.get()
            i = out.index
            if out.cached_tokens is not None:
                self.cached[i] = out.cached_tokens
            if i not in self.open:
                continue  # a choice cut by a stop string: the tail of its abort
            if out.finish_reason == "shutdown":
                raise shutting_down()
            if out.finish_reason in ("error", "abort"):
                raise _engine_error(out)
            d = self.detok[i]
            text = d.add(out.token_ids, final=out.finish_reason is not None)
            reason = out.finish_reason
            if d.stopped and reason is None:
                reason = "stop"
                self.client.abort(self.rid, [i], stop=True)
            if reason is not None:
                self.open.discard(i)
            yield Event(i, text, out.token_ids, reason, out.logprobs)

    def close(self):
        """Abort the choices still running (the client left, or the request failed)."""
        if self.open:
            self.client.abort(self.rid, sorted(self.open))
            self.open.clear()


class PromptOnly:
    """A Generation with nothing to generate (a prompt scored alone: max_tokens 0 with echo):
    each choice ends at once."""

    def __init__(self, choices: int):
        self.choices = choices

    def cached_tokens(self, per_prompt: int) -> int:
        return 0

    async def events(self) -> AsyncIterator[Event]:
        for i in range(self.choices):
            yield Event(i, "", [], "length", [])

    def close(self):
        pass


def _engine_error(out: Output) -> APIError:
    if out.kind == "invalid":  # e.g. the request stopped fitting the KV cache
        return APIError(400, out.error)
    if out.kind == "shutdown":  # the engine core died
        return APIError(503, out.error, type="server_error", code="engine_unavailable")
    return APIError(500, f"the engine failed while serving this request: {out.error}", type="server_error")


async def gather(gen: Generation) -> list[Event]:
    """Run a non-streaming request to the end -> per choice, all of its outputs as one Event."""
    out = [Event(i, "", [], None, []) for i in range(gen.choices)]
    async for e in gen.events():
        c = out[e.index]
        c.text += e.text
        c.token_ids += e.token_ids
        c.finish_reason = e.finish_reason
        c.logprobs += e.logprobs or []
    return out


def sse(chunks: AsyncIterator, gen: Generation) -> StreamingResponse:
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


class ClientLeft(Exception):
    """The client disconnected before its answer was ready."""


async def until_disconnected(raw: Request, work):
    """Await `work`; if the client disconnects first, cancel it and raise ClientLeft."""
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
    if task in done:
        return task.result()
    raise ClientLeft


async def unless_disconnected(raw: Request, work, gen: Generation):
    """Await `work` unless the client disconnects first; then abort its choices."""
    try:
        return await until_disconnected(raw, work)
    except ClientLeft:
        return client_left()
    finally:
        gen.close()


def client_left() -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def _disconnect(raw: Request):
    while (await raw.receive())["type"] != "http.disconnect":
        pass
