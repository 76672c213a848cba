"""The server's ASGI middlewares: what happens to every HTTP request before a route sees it.

From the outside in (`app.py` installs them):

    RequestId -> CatchAll (errors.py) -> BodyLimit -> Gate -> ExtraFieldsPolicy -> routes

- `RequestId`: every response carries `X-Request-Id`, the client's (when it is a sane token) or a
  new one; the id is in the scope for the logs.
- `BodyLimit`: a 413 for a body over `--max-request-bytes`, before it is parsed: at once from
  `Content-Length`, else as soon as the streamed bytes pass the limit.
- `Gate`: 503 while draining; with API keys, 401 without a valid one on everything but
  `/health`, `/version` (and `/metrics` with `--public-metrics`); the key's owner goes in the scope.
- `ExtraFieldsPolicy`: whether request models drop unknown fields (`--allow-extra-fields`) or
  refuse them, for this request (protocol.ALLOW_EXTRA_FIELDS).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

from starlette.exceptions import HTTPException

from kvc.runtime.server.auth import OWNER_SCOPE_KEY, ApiKeys
from kvc.runtime.server.errors import REQUEST_ID_SCOPE_KEY, error_response
from kvc.runtime.server.protocol import ALLOW_EXTRA_FIELDS

REQUEST_ID_HEADER = "x-request-id"
_SANE_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # visible ASCII: safe to echo in a header and a log


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value
    return None


class RequestId:
    """Echoes the client's `X-Request-Id` (1-128 visible ASCII characters), else sends a new one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = (_header(scope, REQUEST_ID_HEADER.encode()) or b"").decode("latin-1")
        request_id = given if _SANE_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope = {**scope, REQUEST_ID_SCOPE_KEY: request_id}

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers") or () if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyTooLarge(HTTPException):
    """Raised from `receive` when a streamed body passes the limit: FastAPI re-raises HTTP errors
    met while it reads a body, so the app's handler turns it into the 413."""

    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return (f"the request body is larger than this server's limit of {limit} bytes "
            "(kvc serve --max-request-bytes)")


class BodyLimit:
    """413 for request bodies over `max_bytes`, read neither into memory nor into JSON."""

    def __init__(self, app, max_bytes: int | None, on_reject: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.max_bytes is None:
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await self._reject(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:  # read outside FastAPI's body parsing (no handler turned it into the 413)
            if started:
                raise
            await self._reject(scope, receive, send)

    async def _reject(self, scope, receive, send) -> None:
        if self.on_reject is not None:
            self.on_reject(413)
        response = error_response(413, too_large_message(self.max_bytes), code="request_too_large",
                                  headers={"Connection": "close"})  # the unread body stays on the socket
        await response(scope, receive, send)


_DRAIN_OPEN = ("/health", "/metrics", "/version")  # also answered while draining


def unguarded_paths(public_metrics: bool) -> frozenset[str]:
    """The paths answered without an API key when keys are set; everything else needs one (the
    API, the schema and its pages, unknown paths)."""
    return frozenset(("/health", "/version") + (("/metrics",) if public_metrics else ()))


class Gate:
    """503 while draining, 401 without a valid API key; records the key's owner in the scope."""

    def __init__(self, app, state, public_metrics: bool = False) -> None:
        self.app = app
        self.state = state  # app.ServerState: `draining`, `keys`, `metrics`
        self.keys: ApiKeys = state.keys
        self.open_paths = unguarded_paths(public_metrics)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = scope.get("path", "")
            response = None
            if self.state.draining and path not in _DRAIN_OPEN:
                response = error_response(503, "the server is shutting down", code="shutting_down")
            elif self.keys and path not in self.open_paths:
                owner = self.keys.owner((_header(scope, b"authorization") or b"").decode("latin-1"))
                if owner is None:
                    response = error_response(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                scope = {**scope, OWNER_SCOPE_KEY: owner}
            if response is not None:
                self.state.metrics.observe_error(response.status_code)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ExtraFieldsPolicy:
    """Sets, for each request, whether its body's unknown fields are dropped or refused."""

    def __init__(self, app, allow: bool) -> None:
        self.app = app
        self.allow = allow

    async def __call__(self, scope, receive, send) -> None:
        token = ALLOW_EXTRA_FIELDS.set(self.allow)
        try:
            await self.app(scope, receive, send)
        finally:
            ALLOW_EXTRA_FIELDS.reset(token)
