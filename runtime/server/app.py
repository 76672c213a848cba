"""The FastAPI application: routes, auth, draining, errors, and the OpenAPI schema.

`build_app(engine, ServerConfig(...))` wraps an `Engine` into an ASGI app; `launch.py` runs it
under uvicorn. The app starts the engine thread in its lifespan and stops it on shutdown; what every
request passes through first (request ids, the body limit, draining, API keys) is middleware.py.
With API keys, each request's owner (the sha256 of its key, `auth.py`) travels in the ASGI scope;
chains belong to it (`GET /v1/chains`: the caller's; `/v1/chains/{id}`: describe, drop;
`/v1/chains/{id}/prune`; `POST /v1/chains` opens one over a prompt without generating).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import FastAPI, Path, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema

import kvc
from kvc.runtime.chains import ChainLimits
from kvc.runtime.engine import Engine
from kvc.runtime.server import openai_api
from kvc.runtime.server.async_engine import AsyncEngine
from kvc.runtime.server.auth import ApiKeys, request_owner
from kvc.runtime.server.errors import (
    CatchAllMiddleware,
    ModelNotFound,
    error_response,
    install_error_handlers,
)
from kvc.runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from kvc.runtime.server.middleware import BodyLimit, ExtraFieldsPolicy, Gate, RequestId, unguarded_paths
from kvc.runtime.server.protocol import (
    MAX_CHAIN_ID_LEN,
    ChainCreateRequest,
    ChainDeleted,
    ChainInfo,
    ChainList,
    ChainPruned,
    ChainPruneRequest,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
ChainIdPath = Annotated[str, Path(min_length=1, max_length=MAX_CHAIN_ID_LEN,
                                  description="a chain id, from a response's chain_id")]


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None  # one key (kept for callers that have one) ...
    api_keys: tuple[str, ...] = field(default_factory=tuple)  # ... and/or several; each key is an owner
    max_waiting: int = 1024  # sequences in the waiting queue before new requests get 503
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413; None: no limit
    public_metrics: bool = False  # /metrics without an API key even when keys are set
    allow_extra_fields: bool = False  # drop unknown request fields instead of refusing them (400)
    # tokenization and chat templates run in this many threads, off the event loop
    tokenizer_threads: int = field(default_factory=lambda: min(4, os.cpu_count() or 1))
    # chats continue the owner's idle chain they extend (ChainStore.find), with at least this many
    # tokens in common; None: only explicit chains
    auto_chain_min_tokens: int | None = None
    chain_ttl: float | None = None  # seconds an idle chain is kept; None: until evicted
    max_chains: int | None = None  # chains kept at most (least recently used idle ones dropped)


class ServerState:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.keys = ApiKeys(([config.api_key] if config.api_key else []) + list(config.api_keys))
        self.aengine = AsyncEngine(engine, max_waiting=config.max_waiting)
        self.metrics = ServerMetrics(self.aengine, config.served_model_name)
        self.draining = False
        # before the engine thread starts; only that thread touches the store afterwards
        engine.set_chain_limits(ChainLimits(ttl=config.chain_ttl, max_chains=config.max_chains))
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=max(1, config.tokenizer_threads),
                                                 thread_name_prefix="kvc-tokenize")
        self.ctx = openai_api.ServingContext(
            aengine=self.aengine,
            metrics=self.metrics,
            tokenizer=engine.tokenizer,
            model_name=config.served_model_name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.spec.vocab_size,
            eos_token_ids=tuple(engine.spec.eos_token_ids),
            tokenizer_pool=self.tokenizer_pool,
            auto_chain_min_tokens=config.auto_chain_min_tokens,
        )

    async def drain(self) -> None:
        """Stop taking requests, give in-flight ones `shutdown_timeout` seconds, abort the rest."""
        self.draining = True
        n = len(self.aengine.active)
        log.info("draining: %d request(s) in flight, %.0f s to finish", n, self.config.shutdown_timeout)
        if not await self.aengine.wait_idle(self.config.shutdown_timeout):
            log.warning("aborting %d request(s) still running after %.0f s",
                        len(self.aengine.active), self.config.shutdown_timeout)
            self.aengine.abort_all()
            if not await self.aengine.wait_idle(5.0):
                log.error("%d request(s) did not end after their abort", len(self.aengine.active))


_WHY = {
    400: "invalid request (`param` names the field)",
    401: "bad or missing API key (only with --api-key)",
    404: "unknown model; unknown chain (`chain_not_found`, also another key's chain)",
    409: "the chain is busy (`chain_busy`) or the prompt does not extend it (`chain_diverged`)",
    410: "the chain was evicted or deleted (`chain_evicted`)",
    500: "internal error (details only in the server log)",
    503: "the waiting queue is full, no memory for a chain (`chain_capacity`), or shutting down",
}


def _error_ref(description: str) -> dict:
    """An OpenAPI response object: OpenAI's error JSON."""
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _errors(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": _WHY[s]} for s in statuses}


_ERRORS = _errors(400, 401, 404, 500, 503)
_GENERATION_ERRORS = _errors(400, 401, 404, 409, 410, 500, 503)
_CHAIN_ERRORS = _errors(400, 401, 404, 409, 410, 500, 503)


def _stream_of(chunk_model) -> dict:
    """The 200 of a streaming endpoint: server-sent events (OpenAPI < 3.2: the schema is one event)."""
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string", "description": f"a {chunk_model.__name__} as JSON; the last event is [DONE]"},
            "event": {"type": "string"},
        },
    }
    return {200: {"content": {"text/event-stream": {"schema": event}},
                  "description": f"JSON, or with stream=true server-sent {chunk_model.__name__} events"}}


def build_app(engine: Engine, config: ServerConfig) -> FastAPI:
    state = ServerState(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.aengine.start()
        log.info("serving %s (%s, method %s)", config.served_model_name, engine.device, engine.config.method)
        try:
            yield
        finally:
            state.aengine.abort_all()
            await state.aengine.stop()
            state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvc", version=kvc.__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the kvc engine")
    app.state.kvc = state
    install_error_handlers(app)
    # added innermost first (middleware.py draws the order)
    app.add_middleware(ExtraFieldsPolicy, allow=config.allow_extra_fields)
    app.add_middleware(Gate, state=state, public_metrics=config.public_metrics)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes, on_reject=state.metrics.observe_error)
    app.add_middleware(CatchAllMiddleware, on_error=state.metrics.observe_error)
    app.add_middleware(RequestId)
    ctx = state.ctx

    def card() -> ModelCard:
        return ModelCard(id=config.served_model_name, created=0, root=str(engine.config.model or "default"),
                         max_model_len=engine.max_model_len, vocab_size=engine.spec.vocab_size,
                         method=engine.method.name, methods=engine.method_cards())

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if state.aengine.failure is not None:
            return JSONResponse({"status": "engine_failed"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return {"version": kvc.__version__}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def list_models():
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={401: _ERRORS[401], 404: _ERRORS[404]})
    async def get_model(model: str):
        if model != config.served_model_name:
            raise ModelNotFound(f"the model {model!r} does not exist", param="model")
        return card()

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=_GENERATION_ERRORS | _stream_of(CompletionChunk))
    async def completions(body: CompletionRequest, request: Request):
        return await openai_api.create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_GENERATION_ERRORS | _stream_of(ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await openai_api.create_chat_completion(ctx, body, request)

    @app.get("/v1/chains/{chain_id}", response_model=ChainInfo, responses=_CHAIN_ERRORS)
    async def get_chain(request: Request, chain_id: ChainIdPath):
        owner = request_owner(request.scope)
        info = await state.aengine.call(lambda e: e.chain_info(chain_id, owner))
        return ChainInfo(**{**info, "id": chain_id})

    @app.get("/v1/chains", response_model=ChainList, responses=_errors(401, 500, 503))
    async def list_chains(request: Request):
        owner = request_owner(request.scope)
        return ChainList(data=[ChainInfo(**info) for info in await state.aengine.call(lambda e: e.list_chains(owner))])

    @app.post("/v1/chains", response_model=ChainInfo, responses=_CHAIN_ERRORS)
    async def create_chain(body: ChainCreateRequest, request: Request):
        info = ChainInfo(**await openai_api.create_chain(ctx, body, request))
        return JSONResponse(info.model_dump(mode="json"), headers={openai_api.CHAIN_ID_HEADER: info.id})

    @app.post("/v1/chains/{chain_id}/prune", response_model=ChainPruned, responses=_CHAIN_ERRORS)
    async def prune_chain(body: ChainPruneRequest, request: Request, chain_id: ChainIdPath):
        return ChainPruned(**await openai_api.prune_chain(ctx, chain_id, body, request))

    @app.delete("/v1/chains/{chain_id}", response_model=ChainDeleted, responses=_CHAIN_ERRORS)
    async def delete_chain(request: Request, chain_id: ChainIdPath):
        owner = request_owner(request.scope)
        await state.aengine.call(lambda e: e.drop_chain(chain_id, owner))
        return ChainDeleted(id=chain_id)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest):
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            return error_response(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            tokens = await ctx.offload(ctx.render_chat, body.messages, body.add_generation_prompt is not False)
        else:
            tokens = await ctx.offload(ctx.encode, body.prompt, "prompt", bool(body.add_special_tokens))
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        if ctx.tokenizer is None:
            return error_response(400, "this model has no tokenizer", "tokens")
        if any(not 0 <= t < engine.spec.vocab_size for t in body.tokens):
            return error_response(400, f"token ids must be in [0, {engine.spec.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=await ctx.offload(ctx.tokenizer.decode, body.tokens))

    app.openapi = lambda: _openapi(app, state.keys, config)
    return app


def _openapi(app: FastAPI, keys: ApiKeys, config: ServerConfig) -> dict:
    """FastAPI's schema, with its 422 replaced by the 400 the server really sends, and the API
    keys, 413 and X-Request-Id it sends on every operation."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    open_paths = unguarded_paths(config.public_metrics)
    request_id = {"description": "the client's X-Request-Id (1-128 visible ASCII characters), else a new one",
                  "schema": {"type": "string"}}
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if keys and path not in open_paths:
                op["security"] = [{"bearer": []}]
                responses.setdefault("401", _error_ref(_WHY[401]))
            else:
                responses.pop("401", None)
            if "requestBody" in op and config.max_request_bytes is not None:
                responses["413"] = _error_ref("the body is over the server's --max-request-bytes")
            for response in responses.values():
                response.setdefault("headers", {})["X-Request-Id"] = request_id
    components = schema.setdefault("components", {})
    _, chunk_schemas = models_json_schema([(m, "serialization") for m in (CompletionChunk, ChatCompletionChunk)],
                                          ref_template="#/components/schemas/{model}")
    components.setdefault("schemas", {}).update(chunk_schemas.get("$defs", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if config.allow_extra_fields:  # unknown fields are dropped, not refused
        for model in components.get("schemas", {}).values():
            if model.get("additionalProperties") is False:
                del model["additionalProperties"]
    if keys:
        components.setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
    app.openapi_schema = schema
    return schema
