"""Real servers for the server tests: the app under uvicorn on 127.0.0.1 (a free port), in a
thread of the test process, over the embedded default model on CPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

TEST_KV_BYTES = 8 * 2**20  # 1024 pages of 16 tokens: plenty, and cheap to allocate


class LiveServer:
    def __init__(self, app) -> None:
        import uvicorn

        from kvc.runtime.server.launch import DrainingServer

        self.app = app
        self.state = app.state.kvc
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
        self.server = DrainingServer(config, self.state)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    def metric(self, name: str, headers: dict | None = None, **labels: str) -> float:
        """One sample of /metrics by name: the first series carrying `labels`."""
        return metric_sample(httpx.get(f"{self.url}/metrics", headers=headers).text, name, **labels)

    def wait_metric(self, name: str, value: float, timeout: float = 10.0, **labels: str) -> float:
        deadline = time.monotonic() + timeout
        while (got := self._metric_or_none(name, **labels)) != value and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def _metric_or_none(self, name: str, **labels: str) -> float | None:
        try:
            return self.metric(name, **labels)
        except KeyError:
            return None


def metric_sample(text: str, name: str, **labels: str) -> float:
    """The value of the first sample of `name` in Prometheus text whose labels include `labels`."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, value = line.rsplit(" ", 1)
            if all(w in series for w in wanted):
                return float(value)
    raise KeyError(name)


def make_engine(**options):
    from kvc.runtime.config import EngineConfig
    from kvc.runtime.engine import Engine

    options.setdefault("model", "random:tiny")  # the byte-tokenizer test model: shapes, not answers
    options.setdefault("kv_cache_memory", TEST_KV_BYTES)
    options.setdefault("max_model_len", 512)
    return Engine(EngineConfig(**options))


@contextmanager
def live_server(engine_options: dict | None = None, prepare=None, **server_options) -> Iterator[LiveServer]:
    """A server over a fresh engine; `prepare(engine)` may change the engine first."""
    from kvc.runtime.server.app import ServerConfig, build_app

    server_options.setdefault("served_model_name", "kvc-test")
    engine = make_engine(**(engine_options or {}))
    if prepare is not None:
        prepare(engine)
    app = build_app(engine, ServerConfig(**server_options))
    server = LiveServer(app).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server() -> Iterator[LiveServer]:
    """The shared server: the tiny test model, max_model_len 512, no API key."""
    with live_server(max_waiting=256) as s:
        yield s


@pytest.fixture(scope="session")
def llm():
    """The offline API on the same model, the reference for greedy outputs."""
    from kvc import LLM

    return LLM("random:tiny", kv_cache_memory=TEST_KV_BYTES, max_model_len=512)


@contextmanager
def served_process(*args: str, timeout: float = 120) -> Iterator[tuple[subprocess.Popen, str]]:
    """`kvc serve ARGS` in a subprocess on a free port (the tiny model, unless ARGS name another),
    once /health answers; killed afterwards if still running. Its output is the process's stdout.
    Without TRITON_INTERPRET, as users run it (the tests' conftest sets it for kernel tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    model = () if "--model" in args else ("--model", "random:tiny")
    proc = subprocess.Popen([sys.executable, "-m", "kvc.runtime.cli", "serve", *model, "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
