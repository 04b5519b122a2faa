"""Checks every request passes before any route runs: the API key and the body size limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that streaming responses and disconnect
notices pass through untouched.
"""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException

from forkjax.server.protocol import APIError

# As in vLLM, the key guards the API (/v1), and here also /flush_cache, which changes what every
# client's requests cost; /health, /metrics and the OpenAPI docs stay open for probes and
# scrapers, which carry no credentials.
GUARDED_PREFIXES = ("/v1", "/flush_cache")


class RequestGuard:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

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
        await self.app(scope, self._counting(receive), send)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                  self.api_key.encode())

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds the server's limit of {self.max_body_bytes} bytes",
                        code="request_too_large")

    def _counting(self, receive):
        """Enforce the limit on bodies sent without a Content-Length (chunked)."""
        seen = 0

        async def wrapped():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    # FastAPI re-raises HTTP errors met while reading the body; app.py gives
                    # them the OpenAI error shape.
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
