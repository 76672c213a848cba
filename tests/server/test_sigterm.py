"""SIGTERM under load: `kvc serve` (a real subprocess) stops taking requests (503), lets short
in-flight requests finish, aborts the long ones after --shutdown-timeout (their streams end
cleanly with finish_reason "abort"), and exits 0 within a bounded time. A second signal stops it
within a second, with no traceback in its output."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import served_process

SHUTDOWN_TIMEOUT = 5.0
SHORT, LONG = 100, 4000  # tokens: well inside the drain window on a loaded CPU; far beyond it


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


def _serve(shutdown_timeout: float):
    return served_process("--max-model-len", "4096", "--kv-cache-memory", str(64 * 2**20),
                          "--shutdown-timeout", str(shutdown_timeout), "--served-model-name", "drain")


def test_sigterm_under_load_drains_and_exits_0():
    with _serve(SHUTDOWN_TIMEOUT) as (proc, url):
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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_stops_within_a_second_without_a_traceback(sig):
    with _serve(shutdown_timeout=60) as (proc, url):  # the drain alone would wait a minute for the streams
        outs = [{} for _ in range(4)]
        started = [threading.Event() for _ in outs]
        threads = [threading.Thread(target=_stream, args=(url, LONG, o, e)) for o, e in zip(outs, started)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(30)
        proc.send_signal(sig)
        time.sleep(0.5)  # draining: the streams go on
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=10)
        elapsed = time.monotonic() - t0
        output = proc.stdout.read()
        assert elapsed < 1.0, (elapsed, output)
        assert rc == 1, output  # stopped, not drained
        assert not any(word in output for word in ("Traceback", "Error", "ERROR")), output
        for t in threads:
            t.join(timeout=10)
        for out in outs:  # the aborted streams still ended properly
            assert out.get("done") and out.get("reason") == "abort" and "error" not in out, out
