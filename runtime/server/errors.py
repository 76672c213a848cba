"""HTTP errors in OpenAI's schema: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can see goes through `error_response`: the runtime's `KvcError`s (status,
and `code` where the class has one, from the error class: e.g. the chain errors' 404/409/410/503),
FastAPI's request validation (its 422 becomes a 400 naming the field; unknown fields are named
together), Starlette's HTTP errors (404 path, 405 method with every allowed method in `Allow`, 413
body too large) and unexpected exceptions (500, logged with the traceback, which never reaches the
client). Messages name fields and values, never the server's internal types.
"""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from kvc.runtime.errors import KvcError, OutOfKVMemory, PromptTooLongError

log = logging.getLogger(__name__)

REQUEST_ID_SCOPE_KEY = "kvc.request_id"  # where middleware.RequestId leaves the request's id


class ModelNotFound(KvcError):
    status = 404


class Unauthorized(KvcError):
    status = 401


class ServerBusy(KvcError):
    """The waiting queue is full; retry later."""

    status = 503


class EngineUnavailable(KvcError):
    """The engine thread is gone (it crashed or was stopped); the server cannot serve."""

    status = 503


class EngineFailed(KvcError):
    """The engine failed while running the request (logged where it happened)."""

    status = 500


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    410: "not_found_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}
_CODES = {
    ModelNotFound: "model_not_found",
    Unauthorized: "invalid_api_key",
    PromptTooLongError: "context_length_exceeded",
    ServerBusy: "server_busy",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def kvc_error_status(e: KvcError) -> int:
    # A request that can never fit the KV pool, even alone, is the client's to change (400);
    # 503 is kept for "busy now, retry".
    return 400 if isinstance(e, OutOfKVMemory) else e.status


def kvc_error_response(e: KvcError) -> JSONResponse:
    code = getattr(e, "code", None) or next((c for cls, c in _CODES.items() if isinstance(e, cls)), None)
    status = kvc_error_status(e)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return error_response(status, e.message, e.param, code, headers)


def _counted(request: Request, response: JSONResponse) -> JSONResponse:
    state = getattr(request.app.state, "kvc", None)
    if state is not None:
        state.metrics.observe_error(response.status_code)
    return response


async def _on_kvc_error(request: Request, e: KvcError) -> JSONResponse:
    return _counted(request, kvc_error_response(e))


def _field(error: dict) -> str | None:
    return ".".join(str(p) for p in error.get("loc", ()) if p not in ("body", "query", "path", "header")) or None


async def _on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    errors = e.errors()
    unknown = [_field(err) for err in errors if err.get("type") == "extra_forbidden"]
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        message = (f"unknown field{'s' if len(unknown) > 1 else ''} {names}: not part of this API (kvc refuses "
                   "fields it would otherwise ignore; a server started with --allow-extra-fields drops them)")
        return _counted(request, error_response(400, message, unknown[0], "unknown_field"))
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _field(first)
    if first.get("type") == "json_invalid":
        param, message = None, "the request body is not valid JSON"
    else:
        message = f"{param + ': ' if param else ''}{first.get('msg', 'invalid value')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return _counted(request, error_response(400, message, param))


async def _on_http_error(request: Request, e: HTTPException) -> JSONResponse:
    message = e.detail if isinstance(e.detail, str) else str(e.detail)
    headers = dict(getattr(e, "headers", None) or {})
    if e.status_code == 405:  # Starlette names the methods of the first route matching the path only
        headers["Allow"] = ", ".join(allowed_methods(request))
    code = getattr(e, "code", None)
    return _counted(request, error_response(e.status_code, message, code=code, headers=headers or None))


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def install_error_handlers(app) -> None:
    app.add_exception_handler(KvcError, _on_kvc_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)


class CatchAllMiddleware:
    """Turns an unexpected exception into a logged 500 with no details for the client.

    A pure ASGI middleware (not an exception handler) so that the error is logged once, here, and
    a response that has already started (a stream) is simply ended.
    """

    def __init__(self, app, on_error=None) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("internal error in %s %s (request id %s)", scope.get("method"), scope.get("path"),
                          scope.get(REQUEST_ID_SCOPE_KEY))
            if self.on_error is not None:
                self.on_error(500)
            if not started:
                response = error_response(500, "internal server error; the server log has the details")
                await response(scope, receive, send)
