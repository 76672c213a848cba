"""`kvc serve`: builds the engine, then runs the app under uvicorn until SIGTERM or Ctrl-C.

The first SIGTERM/SIGINT drains: new requests get 503, in-flight ones get `--shutdown-timeout`
seconds to finish and are aborted after that (their clients receive finish_reason "abort"), then
the server stops and the process exits 0. A second signal stops within a second, exit status 1:
every request is aborted at once (streams still end with finish_reason "abort" and [DONE] when they
can), the server shuts down, and the process ends without the interpreter's teardown (a second
of torch's on a busy CPU); a watchdog ends it if anything still holds the shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading

import uvicorn

from kvc.runtime.config import EngineConfig
from kvc.runtime.default_model import SERVED_NAME
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.server.app import ServerConfig, ServerState, build_app

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = SERVED_NAME  # the embedded default model: SmolLM2-135M-Instruct
_ABORT_GRACE = 0.5  # seconds, after a second signal, for aborted streams to send their last events
_FORCE_EXIT_AFTER = 0.9  # seconds after a second signal: the watchdog ends the process


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain before the stop on the first signal."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self.stopped_now = False  # by a second signal

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Not recorded in uvicorn's captured signals: uvicorn would re-raise them after shutdown
        # and the process would die by the signal (SIGINT: a KeyboardInterrupt traceback).
        if self._loop is None:  # not serving yet
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        if self._draining:
            self.stopped_now = True
            log.warning("received %s again: stopping now", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._stop_now()))
            threading.Thread(target=_exit_after, args=(_FORCE_EXIT_AFTER,), name="kvc-force-exit", daemon=True).start()
            return
        self._draining = True
        log.warning("received %s: draining (a second one stops now)", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.state.drain()
        finally:
            self.should_exit = True

    async def _stop_now(self) -> None:
        """Aborts everything and lets the handlers end their responses for a moment; then the
        usual shutdown, which has nothing left to wait for (uvicorn's forced exit would skip the
        app's shutdown and log the cancelled lifespan's traceback)."""
        self.state.aengine.abort_all()
        await self.state.aengine.wait_idle(_ABORT_GRACE)
        self.should_exit = True


def _exit_after(seconds: float) -> None:
    """The second signal's bound: whatever still holds the shutdown (a long device step, a
    tokenizer thread) does not keep the process past `seconds`."""
    threading.Event().wait(seconds)
    log.warning("the shutdown took over %.1f s: exiting", seconds)
    _exit_stopped()


def _exit_stopped() -> None:
    logging.shutdown()  # flushes the log
    os._exit(1)


def engine_config(model: str | None, method: str, method_params: dict[str, str], options: dict) -> EngineConfig:
    return EngineConfig(model=model, method=method, method_params=method_params or None, **options)


def parse_method_params(items: list[str] | None) -> dict[str, object]:
    """`["budget=512", "pooling=max", "filters=[8,18]"]` -> {"budget": 512, "pooling": "max",
    "filters": [8, 18]}: numbers, booleans and bracketed lists of them are converted, anything else
    (enum values) stays text; the method's checker judges the rest."""
    params: dict[str, object] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--method-param takes key=value, got {item!r}", param="method_params")
        params[key.strip()] = _literal(value.strip())
    return params


def _literal(text: str) -> object:
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [_literal(item.strip()) for item in inner.split(",")] if inner else []
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
    log_level: str = "info",
    **server_options,
) -> int:
    """Serves until a signal; `server_options` are `ServerConfig` fields (max_waiting, chain_ttl, ...)."""
    engine = Engine(engine_cfg)
    try:
        return _serve(engine, engine_cfg, host, port, served_model_name, api_keys, log_level, server_options)
    finally:
        engine.close()


def _serve(engine: Engine, engine_cfg: EngineConfig, host: str, port: int, served_model_name: str | None,
           api_keys, log_level: str, server_options: dict) -> int:
    engine.capture_graphs()  # now, rather than in the first requests' latency
    name = served_model_name or engine_cfg.model or DEFAULT_MODEL_NAME
    app = build_app(engine, ServerConfig(served_model_name=name, api_keys=tuple(api_keys), **server_options))
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = DrainingServer(config, app.state.kvc)
    log.info("serving %r (method %s, %s) on http://%s:%d", name, engine_cfg.method, engine.device, host, port)
    server.run()
    if server.stopped_now:
        _exit_stopped()
    return 0
