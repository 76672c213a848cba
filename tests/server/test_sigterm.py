"""SIGTERM under load: `kvc serve` (a real subprocess) stops taking requests (503), lets short
in-flight requests finish, aborts the long ones after --shutdown-timeout (their streams end
cleanly with finish_reason "abort"), and exits 0 within a bounded time."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

SHUTDOWN_TIMEOUT = 5.0
SHORT, LONG = 100, 4000  # tokens: well inside the drain window on a loaded CPU; far beyond it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(url: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    body = {"prompt": "drain me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                started.set()
                if line == "data: [DONE]":
                    out["done"] = True
                    continue
                choice = json.loads(line[6:])["choices"][0]
                out["reason"] = choice["finish_reason"] or out.get("reason")
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    finally:
        started.set()


def test_sigterm_under_load_drains_and_exits_0():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvc.runtime.cli", "serve", "--model", "random:tiny", "--port", str(port),
         "--max-model-len", "4096",
         "--kv-cache-memory", str(64 * 2**20), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
         "--served-model-name", "drain"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)

        # short requests can finish inside the drain window; long ones cannot
        plan = [SHORT] * 4 + [LONG] * 4
        outs = [{} for _ in plan]
        started = [threading.Event() for _ in plan]
        threads = [threading.Thread(target=_stream, args=(url, n, o, e)) for n, o, e in zip(plan, outs, started)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(30)

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503

        for t in threads:
            t.join(timeout=SHUTDOWN_TIMEOUT + 20)
            assert not t.is_alive(), "a client was left hanging"
        assert proc.wait(timeout=SHUTDOWN_TIMEOUT + 20) == 0
        assert time.monotonic() - t0 < SHUTDOWN_TIMEOUT + 15
        for n, out in zip(plan, outs):
            assert out.get("done") and "error" not in out, out
            assert out["reason"] == ("length" if n == SHORT else "abort"), (n, out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
