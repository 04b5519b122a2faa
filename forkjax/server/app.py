"""The FastAPI app: routes, and the handlers that give every error the OpenAI shape.

Every failure a request can cause is answered here as `{"error": {message, type, param, code}}`
with a 4xx status; the last-resort handler (a 500) exists for server bugs only.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import forkjax
from forkjax.engine.loading import read_adapters
from forkjax.server import metrics
from forkjax.server.engine_loop import EngineLoop
from forkjax.server.middleware import RequestGuard
from forkjax.server.protocol import (
    APIError, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
    ErrorResponse, LoadLoRAAdapterRequest, ModelCard, ModelList, UnloadLoRAAdapterRequest)
from forkjax.server.serving import OpenAIServing
from forkjax.server.tokenize import (
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, detokenize, tokenize)

log = logging.getLogger("forkjax.serve")

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413)}
# 503: the server stopped (--shutdown-timeout passed) before the request finished.
GENERATION_RESPONSES = {**ERRORS, 503: {"model": ErrorResponse}, 200: {"content": {"text/event-stream": {}}}}
HTTP_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
              408: "request_timeout", 413: "request_too_large"}


def create_app(loop: EngineLoop, *, model_name: str, model_root: str, api_key: str | None = None,
               max_body_bytes: int = 8 << 20, body_timeout_s: float = 30.0,
               max_lora_rank: int | None = None) -> FastAPI:
    engine = loop.engine
    stats = engine.stats()
    pool_pages = min(n for n in (stats["base_pages_total"], stats["residual_pages_total"]) if n > 0)
    serving = OpenAIServing(loop, model_name, engine.tokenizer, max_model_len=engine.max_model_len,
                            pool_tokens=(pool_pages - 2) * engine.config.page_size,
                            vocab_size=engine.model_cfg.vocab_size)
    created = int(time.time())
    app = FastAPI(title="forkjax", summary="OpenAI-compatible multi-LoRA server; adapters are models",
                  version=forkjax.__version__)
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if loop.alive else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics() -> Response:
        snap = await asyncio.wrap_future(loop.call(lambda: metrics.snapshot(loop)))
        return Response(metrics.render(snap, model_name), media_type=metrics.CONTENT_TYPE)

    @app.post("/flush_cache", response_class=PlainTextResponse, responses={401: ERRORS[401]})
    async def flush_cache() -> PlainTextResponse:
        # SGLang's endpoint. Running requests keep their pages; everything else is freed.
        freed = await asyncio.wrap_future(loop.call(engine.flush_cache))
        log.info("flushed the KV cache: %d pages freed", freed)
        return PlainTextResponse(f"Cache flushed. {freed} KV pages freed.")

    def cards() -> list[ModelCard]:
        ctx = engine.max_model_len
        out = [ModelCard(id=model_name, created=created, root=model_root, max_model_len=ctx)]
        return out + [ModelCard(id=name, created=created, root=src, parent=model_name,
                                max_model_len=ctx) for name, src in sorted(loop.adapters.items())]

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
        return tokenize(engine.tokenizer, body, engine.max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize_tokens(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.adapter_for(body.model)
        return detokenize(engine.tokenizer, body, engine.model_cfg.vocab_size)

    @app.get("/version")
    async def version() -> dict:
        return {"version": forkjax.__version__}

    @app.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
    async def create_completion(body: CompletionRequest, raw: Request):
        return await serving.create_completion(body, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        return await serving.create_chat_completion(body, raw)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if name == model_name:
            raise APIError(400, f"'{name}' is the base model's name", param="lora_name")
        if name in loop.adapters and not body.load_inplace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded "
                                "(set load_inplace to replace it).", param="lora_name")
        try:  # parsing and checking the files needs no engine: off the engine thread
            adapter, = await asyncio.to_thread(read_adapters, {name: body.lora_path}, engine.model_cfg)
        except Exception as e:  # whatever is wrong with the files, it came with the request
            why = str(e).removeprefix(f"adapter {name!r}: ")  # the loader's messages name it too
            raise APIError(400, f"cannot load adapter '{name}': {why}", param="lora_path") from None
        if max_lora_rank is not None and adapter.rank > max_lora_rank:
            raise APIError(400, f"adapter '{name}' has rank {adapter.rank} > the server's max LoRA "
                                f"rank {max_lora_rank} (--max-lora-rank)", param="lora_path")

        def install():
            if name in engine.slots.by_name and not body.load_inplace:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            engine.load_adapter(name, adapter, pinned=body.pinned)
        try:
            await asyncio.wrap_future(loop.after_drain(name, install))
        except ValueError as e:
            raise APIError(400, str(e), param="lora_name") from None
        log.info("loaded LoRA adapter %r from %s", name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        missing = APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        if name not in loop.adapters:
            raise missing
        try:
            await asyncio.wrap_future(loop.after_drain(name, lambda: engine.unload_adapter(name)))
        except KeyError:
            raise missing from None
        log.info("unloaded LoRA adapter %r", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return app


def _install_error_handlers(app: FastAPI):
    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

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
        paths = [".".join(str(p) for p in err.get("loc", ()) if p != "body") for err in errors]
        if paths == [""] and errors[0].get("type") in ("model_attributes_type", "dict_type"):
            message = "the request body must be a JSON object sent as Content-Type: application/json"
        else:
            message = "; ".join((f"{path}: " if path else "") + err["msg"].removeprefix("Value error, ")
                                for path, err in zip(paths[:3], errors))
        param = paths[0].split(".")[0] if paths and paths[0] else None
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
