"""The running choices of one HTTP request, and how their outputs reach the client.

The choices' outputs arrive on one asyncio queue (`Generation.events`), are detokenized per
choice, cut at stop strings, and either collected into one response (`gather`) or streamed as
server-sent events (`sse`). A client that goes away aborts its choices, which frees their
pages: a stream notices on its next write, a plain request through a watcher of the connection
(`unless_disconnected`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from forkjax.server.detokenizer import IncrementalDetokenizer
from forkjax.server.engine_loop import EngineLoop, RequestHandle
from forkjax.server.protocol import APIError

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


def _engine_error(error: Exception | None) -> APIError:
    if isinstance(error, ValueError):  # e.g. the request stopped fitting the KV cache
        return APIError(400, str(error))
    return APIError(500, f"the engine failed while serving this request: {error!r}", type="server_error")


async def gather(gen: Generation):
    """Run a non-streaming request to the end -> (texts, token ids, finish reasons) per choice."""
    n = len(gen.handles)
    texts, ids, reasons = [""] * n, [[] for _ in range(n)], [None] * n
    async for i, text, new, reason in gen.events():
        texts[i] += text
        ids[i] += new
        reasons[i] = reason
    return texts, ids, reasons


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


async def unless_disconnected(raw: Request, work, gen: Generation):
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
