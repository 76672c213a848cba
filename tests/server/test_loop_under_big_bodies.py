"""The event loop keeps streaming while big bodies arrive: a 10 MB body is refused with 413 at the
limit (before it is parsed), and a 1 MB prompt under the limit is tokenized off the loop, while
in-flight streams' largest gap between chunks stays under 200 ms (a real `kvc serve` subprocess,
as users run it; the tiny model's steps take milliseconds, so a stalled loop shows)."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.server.conftest import served_process

GAP_LIMIT_S = 0.2


def _stream_until(url: str, stop: threading.Event, started: threading.Event, gaps: list[float],
                  spans: list[tuple[float, float]]) -> None:
    """Streams completions back to back until `stop`: the gaps between each stream's chunks (after
    its first), and each stream's (first chunk, last chunk) times."""
    body = {"prompt": "The quick brown fox", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        times = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])
                    times.append(time.monotonic())
                    started.set()
        gaps += [b - a for a, b in zip(times[1:], times[2:])]
        spans.append((times[0], times[-1]))


def test_big_bodies_do_not_stall_streams():
    with served_process("--max-request-bytes", str(4 * 2**20)) as (_, url):
        httpx.post(f"{url}/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=60)
        stop, started, gaps, spans = threading.Event(), threading.Event(), [], []
        streams = threading.Thread(target=_stream_until, args=(url, stop, started, gaps, spans))
        streams.start()
        assert started.wait(60)
        t0 = time.monotonic()
        huge = b'{"prompt": "' + b"x" * (10 * 2**20) + b'", "max_tokens": 1}'
        refused = httpx.post(f"{url}/v1/completions", content=huge, headers={"content-type": "application/json"},
                             timeout=60)
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"]["message"]
        big = {"prompt": "word " * (2**20 // 5), "max_tokens": 1}  # ~1 MB: under the limit, tokenized
        accepted = httpx.post(f"{url}/v1/completions", json=big, timeout=120)
        assert accepted.status_code == 400 and accepted.json()["error"]["param"] == "prompt"  # too long, once tokenized
        t1 = time.monotonic()
        time.sleep(0.3)
        stop.set()
        streams.join(timeout=120)
        first, last = min(a for a, _ in spans), max(b for _, b in spans)
        assert first < t0 < t1 < last, "no stream overlapped the bodies: the test saw nothing"
        assert max(gaps) < GAP_LIMIT_S, f"largest gap {max(gaps) * 1000:.0f} ms over {len(gaps)} chunks"
