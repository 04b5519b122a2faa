"""The FastAPI app: routes, and the handlers that give every error the OpenAI shape.

Every failure a request can cause is answered here as `{"error": {message, type, param, code}}`
with a 4xx status; 503 where the engine core is stopping or gone; the last-resort handler (a
500) exists for server bugs only. The engine is reached through `CoreClient` alone.
"""

from __future__ import annotations

import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import forkjax
from forkjax.server import messages as m
from forkjax.server.core_client import CoreClient, CoreError, load_tokenizer
from forkjax.server.metrics import CONTENT_TYPE, ServerMetrics
from forkjax.server.middleware import RequestGuard
from forkjax.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, ErrorResponse,
                                     LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, shutting_down)
from forkjax.server.protocol_responses import ResponsesRequest
from forkjax.server.responses import ChatCompletionResponse, CompletionResponse, ModelCard, ModelList
from forkjax.server.responses_output import ResponseObject
from forkjax.server.serving_chat import OpenAIServingChat
from forkjax.server.serving_responses import OpenAIServingResponses
from forkjax.server.tokenize import (
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, detokenize, tokenize)
from forkjax.server.validation import describe_errors

log = logging.getLogger("forkjax.serve")

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413)}
# 503: the server stopped (--shutdown-timeout passed) before the request finished.
GENERATION_RESPONSES = {**ERRORS, 503: {"model": ErrorResponse}, 200: {"content": {"text/event-stream": {}}}}
HTTP_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
              408: "request_timeout", 413: "request_too_large"}
STATUS = {"invalid": 400, "not_found": 404, "shutdown": 503, "error": 500}


def create_app(client: CoreClient, *, model_name: str, model_root: str, api_key: str | None = None,
               max_body_bytes: int = 8 << 20, body_timeout_s: float = 30.0) -> FastAPI:
    info = client.info
    tokenizer = load_tokenizer(info.tokenizer)
    serving = OpenAIServingChat(client, model_name, tokenizer)
    serving_responses = OpenAIServingResponses(serving)
    metrics = ServerMetrics(model_name)
    client.on_output = metrics.observe
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_):
        await client.start()
        yield
        await client.stop()

    app = FastAPI(title="forkjax", summary="OpenAI-compatible multi-LoRA server; adapters are models",
                  version=forkjax.__version__, lifespan=lifespan)
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s)
    _install_error_handlers(app, client)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if client.dead is None else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics() -> Response:
        return Response(metrics.render(await client.call(m.GetStats)), media_type=CONTENT_TYPE)

    @app.post("/flush_cache", response_class=PlainTextResponse, responses={401: ERRORS[401]})
    async def flush_cache() -> PlainTextResponse:
        # SGLang's endpoint. Running requests keep their pages; everything else is freed.
        freed = await client.call(m.FlushCache)
        log.info("flushed the KV cache: %d pages freed", freed)
        return PlainTextResponse(f"Cache flushed. {freed} KV pages freed.")

    def cards() -> list[ModelCard]:
        ctx = info.max_model_len
        out = [ModelCard(id=model_name, created=created, root=model_root, max_model_len=ctx)]
        return out + [ModelCard(id=name, created=created, root=src, parent=model_name,
                                max_model_len=ctx) for name, src in sorted(client.adapters.items())]

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=cards())

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
    async def retrieve_model(model_id: str) -> ModelCard:
        card = next((c for c in cards() if c.id == model_id), None)
        if card is None:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model",
                           code="model_not_found")
        return card

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize_prompt(body: TokenizeRequest) -> TokenizeResponse:
        serving.adapter_for(body.model)
        return tokenize(tokenizer, body, info.max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize_tokens(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.adapter_for(body.model)
        return detokenize(tokenizer, body, info.vocab_size)

    @app.get("/version")
    async def version() -> dict:
        return {"version": forkjax.__version__}

    @app.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
    async def create_completion(body: CompletionRequest, raw: Request):
        return await serving.create_completion(body, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        return await serving.create_chat_completion(body, raw)

    @app.post("/v1/responses", response_model=ResponseObject, responses=GENERATION_RESPONSES)
    async def create_response(body: ResponsesRequest, raw: Request):
        return await serving_responses.create_response(body, raw)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if name == model_name:
            raise APIError(400, f"'{name}' is the base model's name", param="lora_name")
        if name in client.adapters and not body.load_inplace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded "
                                "(set load_inplace to replace it).", param="lora_name")
        try:  # the core reads the files off its step loop and installs once the name is idle
            await client.call(m.LoadAdapter, name=name, path=body.lora_path, pinned=body.pinned,
                              replace=body.load_inplace)
        except CoreError as e:
            if e.kind != "invalid":
                raise
            param = "lora_name" if "already been loaded" in str(e) else "lora_path"
            raise APIError(400, str(e), param=param) from None
        log.info("loaded LoRA adapter %r from %s", name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        missing = APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        if name not in client.adapters:
            raise missing
        try:
            await client.call(m.UnloadAdapter, name=name)
        except CoreError as e:
            if e.kind != "not_found":
                raise
            raise missing from None
        log.info("unloaded LoRA adapter %r", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return app


def _install_error_handlers(app: FastAPI, client: CoreClient):
    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(CoreError)
    async def core_error(_, e: CoreError):
        if e.kind == "shutdown":
            error = (shutting_down() if client.dead is None else
                     APIError(503, client.dead, type="server_error", code="engine_unavailable"))
        else:
            error = APIError(STATUS[e.kind], str(e), type="server_error" if e.kind == "error"
                             else "invalid_request_error")
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError):
        # OpenAI answers 400 (not FastAPI's 422), naming the first bad field; a body that is not
        # JSON by its Content-Type gets 415, as vLLM answers.
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if request.method == "POST" and kind != "application/json":
            message = f"Content-Type {kind or 'none'!r}: the request body must be application/json"
            return JSONResponse(APIError(415, message, code="unsupported_media_type").body(),
                                status_code=415)
        errors = e.errors()
        if errors and errors[0].get("type") == "json_invalid":
            error = errors[0].get("ctx", {}).get("error", "JSON decode error")
            return JSONResponse(APIError(400, f"malformed JSON body: {error}").body(), status_code=400)
        body = getattr(request.scope.get("route"), "body_field", None)  # FastAPI's ModelField
        message, param = describe_errors(errors, body.field_info.annotation if body else None)
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        error = APIError(e.status_code, str(e.detail), code=HTTP_CODES.get(e.status_code))
        headers = e.headers
        if e.status_code == 408:  # the rest of the body may still come: not a request boundary
            headers = {**(headers or {}), "Connection": "close"}
        return JSONResponse(error.body(), status_code=e.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def server_error(_, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(APIError(500, f"internal server error: {e!r}", type="server_error").body(),
                            status_code=500)
