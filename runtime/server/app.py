"""The FastAPI application: routes, auth, draining, errors, and the OpenAPI schema.

`build_app(engine, ServerConfig(...))` wraps an `Engine` into an ASGI app; `launch.py` runs it
under uvicorn. The app starts the engine thread in its lifespan and stops it on shutdown. With API
keys, each request's owner (the sha256 of its key, `auth.py`) travels in the ASGI scope; chains
belong to it (`/v1/chains/{id}`: describe, drop; `/v1/chains/{id}/prune`; `POST /v1/chains` opens
one over a prompt without generating).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import FastAPI, Path, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema

import kvc
from kvc.runtime.engine import Engine
from kvc.runtime.server import openai_api
from kvc.runtime.server.async_engine import AsyncEngine
from kvc.runtime.server.auth import OWNER_SCOPE_KEY, ApiKeys, request_owner
from kvc.runtime.server.errors import (
    CatchAllMiddleware,
    ModelNotFound,
    error_response,
    install_error_handlers,
)
from kvc.runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from kvc.runtime.server.protocol import (
    MAX_CHAIN_ID_LEN,
    ChainCreateRequest,
    ChainDeleted,
    ChainInfo,
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

_PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # what the API keys guard
_ALWAYS_OPEN = ("/health", "/metrics", "/version")  # also answered while draining
ChainIdPath = Annotated[str, Path(min_length=1, max_length=MAX_CHAIN_ID_LEN,
                                  description="a chain id, from a response's chain_id")]


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None  # one key (kept for callers that have one) ...
    api_keys: tuple[str, ...] = field(default_factory=tuple)  # ... and/or several; each key is an owner
    max_waiting: int = 1024  # sequences in the waiting queue before new requests get 503
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM


class _Gate:
    """ASGI middleware: 503 while draining, 401 without a valid API key; records the key's owner."""

    def __init__(self, app, state: "ServerState") -> None:
        self.app = app
        self.state = state
        self.keys = state.keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = scope.get("path", "")
            response = None
            if self.state.draining and not path.startswith(_ALWAYS_OPEN):
                response = error_response(503, "the server is shutting down", code="shutting_down")
            elif self.keys and path.startswith(_PROTECTED):
                owner = self._owner(scope)
                if owner is None:
                    response = error_response(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                scope = {**scope, OWNER_SCOPE_KEY: owner}
            if response is not None:
                self.state.metrics.observe_error(response.status_code)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _owner(self, scope) -> str | None:
        headers = dict(scope.get("headers") or [])
        return self.keys.owner(headers.get(b"authorization", b"").decode("latin-1"))


class ServerState:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.keys = ApiKeys(([config.api_key] if config.api_key else []) + list(config.api_keys))
        self.aengine = AsyncEngine(engine, max_waiting=config.max_waiting)
        self.metrics = ServerMetrics(self.aengine, config.served_model_name)
        self.draining = False
        self.ctx = openai_api.ServingContext(
            aengine=self.aengine,
            metrics=self.metrics,
            tokenizer=engine.tokenizer,
            model_name=config.served_model_name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.spec.vocab_size,
            eos_token_ids=tuple(engine.spec.eos_token_ids),
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

    app = FastAPI(title="kvc", version=kvc.__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the kvc engine")
    app.state.kvc = state
    install_error_handlers(app)
    app.add_middleware(_Gate, state=state)
    app.add_middleware(CatchAllMiddleware, on_error=state.metrics.observe_error)
    ctx = state.ctx

    def card() -> ModelCard:
        return ModelCard(id=config.served_model_name, created=0, root=str(engine.config.model or "default"),
                         max_model_len=engine.max_model_len, vocab_size=engine.spec.vocab_size,
                         method=engine.config.method)

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

    @app.post("/v1/chains", response_model=ChainInfo, responses=_CHAIN_ERRORS)
    async def create_chain(body: ChainCreateRequest, request: Request):
        return ChainInfo(**await openai_api.create_chain(ctx, body, request))

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
            tokens = ctx.render_chat(body.messages, body.add_generation_prompt is not False)
        else:
            tokens = ctx.encode(body.prompt, "prompt", add_special_tokens=bool(body.add_special_tokens))
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        if ctx.tokenizer is None:
            return error_response(400, "this model has no tokenizer", "tokens")
        if any(not 0 <= t < engine.spec.vocab_size for t in body.tokens):
            return error_response(400, f"token ids must be in [0, {engine.spec.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))

    app.openapi = lambda: _openapi(app, state.keys)
    return app


def _openapi(app: FastAPI, keys: ApiKeys) -> dict:
    """FastAPI's schema, with its 422 replaced by the 400 the server really sends."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
            if keys and path.startswith(_PROTECTED):
                op["security"] = [{"bearer": []}]
            if not keys:
                op.get("responses", {}).pop("401", None)
    components = schema.setdefault("components", {})
    _, chunk_schemas = models_json_schema([(m, "serialization") for m in (CompletionChunk, ChatCompletionChunk)],
                                          ref_template="#/components/schemas/{model}")
    components.setdefault("schemas", {}).update(chunk_schemas.get("$defs", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if keys:
        components.setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
    app.openapi_schema = schema
    return schema
