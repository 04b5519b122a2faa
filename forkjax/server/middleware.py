"""Checks every request passes before any route runs: the API key, the body's size limit and
its deadline (a body that has not fully arrived `body_timeout_s` after the request began gets 408;
each connection waits on its own, so a stalled client delays nobody else).

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that streaming responses and disconnect
notices pass through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from starlette.exceptions import HTTPException

from forkjax.server.protocol import APIError

# As in vLLM, the key guards the API (/v1), and here also /flush_cache, which changes what every
# client's requests cost, and /tokenize and /detokenize, which name the adapters and run the
# tokenizer on what they are sent; /health, /metrics, /version and the OpenAPI docs stay open
# for probes and scrapers, which carry no credentials.
GUARDED_PREFIXES = ("/v1", "/flush_cache", "/tokenize", "/detokenize")


class RequestGuard:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, body_timeout_s: float):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith(GUARDED_PREFIXES) \
                and not self._authorized(headers.get("authorization", "")):
            return await _reply(send, APIError(401, "Incorrect API key provided: send "
                                                    "'Authorization: Bearer <key>'.", code="invalid_api_key"))
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await _reply(send, APIError(400, "invalid Content-Length header"))
            if int(length) > self.max_body_bytes:
                await _discard_body(receive)
                return await _reply(send, self._too_large())
        await self.app(scope, self._body_checked(receive), send)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                  self.api_key.encode())

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds the server's limit of {self.max_body_bytes} bytes",
                        code="request_too_large")

    def _body_checked(self, receive):
        """Enforce the deadline, and the size limit on bodies sent without a Content-Length
        (chunked). FastAPI re-raises HTTP errors met while reading the body; app.py gives them
        the OpenAI error shape."""
        seen, complete = 0, False
        deadline = time.monotonic() + self.body_timeout_s

        async def wrapped():
            nonlocal seen, complete
            if complete:  # later reads wait for a disconnect: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within "
                                         f"{self.body_timeout_s:g} s") from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise HTTPException(413, self._too_large().message)
            return message
        return wrapped


async def _discard_body(receive):
    """Read (and drop) the body so that the client, still sending, reads our answer."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _reply(send, error: APIError):
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
