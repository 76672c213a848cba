"""`kvc serve`: builds the engine, then runs the app under uvicorn until SIGTERM or Ctrl-C.

The first SIGTERM/SIGINT drains: new requests get 503, in-flight ones get `--shutdown-timeout`
seconds to finish and are aborted after that (their clients receive finish_reason "abort"), then
the server stops and the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvicorn

from kvc.runtime.config import EngineConfig
from kvc.runtime.default_model import SERVED_NAME
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.server.app import ServerConfig, ServerState, build_app

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = SERVED_NAME  # the embedded default model: SmolLM2-135M-Instruct


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain before the stop on the first signal."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Not recorded in uvicorn's captured signals: uvicorn would re-raise them after shutdown
        # and the process would die by the signal instead of exiting 0.
        if self._draining or self._loop is None:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self._draining = True
        log.warning("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.state.drain()
        finally:
            self.should_exit = True


def engine_config(model: str | None, method: str, method_params: dict[str, str], options: dict) -> EngineConfig:
    return EngineConfig(model=model, method=method, method_params=method_params or None, **options)


def parse_method_params(items: list[str] | None) -> dict[str, object]:
    """`["budget=512", "pooling=max"]` -> {"budget": 512, "pooling": "max"}: numbers and booleans
    are converted, anything else (enum values) stays text; the method's checker judges the rest."""
    params: dict[str, object] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--method-param takes key=value, got {item!r}", param="method_params")
        params[key.strip()] = _literal(value.strip())
    return params


def _literal(text: str) -> object:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def serve(
    engine_cfg: EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    api_keys: list[str] | tuple[str, ...] = (),
    max_waiting: int = 1024,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
) -> int:
    engine = Engine(engine_cfg)
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None:  # now, rather than in the first requests' latency
        log.info("capturing CUDA graphs for decode batches %s", graphs.buckets)
        graphs.capture_all()
    name = served_model_name or engine_cfg.model or DEFAULT_MODEL_NAME
    app = build_app(engine, ServerConfig(served_model_name=name, api_keys=tuple(api_keys),
                                         max_waiting=max_waiting, shutdown_timeout=shutdown_timeout))
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = DrainingServer(config, app.state.kvc)
    log.info("serving %r (method %s, %s) on http://%s:%d", name, engine_cfg.method, engine.device, host, port)
    server.run()
    return 0
