"""What every request meets before and around a handler: tokenization off the event loop, the body
limit (413), X-Request-Id, the Allow header of a 405, strict request types and unknown fields
(400 naming them, or dropped with --allow-extra-fields), clean messages for text a tokenizer
cannot take, API keys over the schema, docs and metrics, and a client-aborted stream counted as an
abort."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from tests.server.conftest import live_server

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _post(server, path, body, **kw):
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kw)


def _raw(server, path, content: bytes, **headers):
    return httpx.post(f"{server.url}{path}", content=content, timeout=30,
                      headers={"content-type": "application/json", **headers})


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---- tokenization runs off the event loop ------------------------------------------------------
class _SlowTokenizer:
    """The engine's tokenizer, taking `delay` seconds (holding its thread) for text containing SLOW."""

    def __init__(self, inner, delay: float) -> None:
        self._inner, self._delay = inner, delay

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, text, *args, **kwargs):
        if "SLOW" in text:
            time.sleep(self._delay)
        return self._inner.encode(text, *args, **kwargs)

    def __call__(self, text, *args, **kwargs):
        if "SLOW" in text:
            time.sleep(self._delay)
        return self._inner(text, *args, **kwargs)


def test_a_slow_tokenization_does_not_stall_other_requests():
    delay = 2.0

    def slow(engine):
        engine.tokenizer = _SlowTokenizer(engine.tokenizer, delay)

    with live_server(prepare=slow) as s:
        slow_done = {}

        def slow_request():
            t0 = time.monotonic()
            body = {"messages": [{"role": "user", "content": "SLOW " * 50}], "max_tokens": 1}
            slow_done["status"] = _post(s, "/v1/chat/completions", body).status_code
            slow_done["seconds"] = time.monotonic() - t0

        t = threading.Thread(target=slow_request)
        t.start()
        time.sleep(0.3)  # the slow request is now in its tokenizer
        t0 = time.monotonic()
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
        assert _post(s, "/v1/completions", {"prompt": "quick", "max_tokens": 2}).status_code == 200
        quick = time.monotonic() - t0
        t.join(timeout=30)
        assert slow_done["status"] == 200
        assert slow_done["seconds"] >= delay  # it really was tokenizing meanwhile
        assert quick < delay / 2, f"a request waited {quick:.2f} s behind another's tokenization"


# ---- the body limit ------------------------------------------------------------------------------
def test_bodies_over_the_limit_are_413_before_they_are_parsed():
    limit = 2048
    with live_server(max_request_bytes=limit) as s:
        big = json.dumps({"prompt": "a" * limit, "max_tokens": 2}).encode()
        err = _error(_raw(s, "/v1/completions", big), 413)
        assert err["code"] == "request_too_large" and str(limit) in err["message"]

        def chunks():  # no Content-Length: counted as it streams in (and never valid JSON)
            for _ in range(8):
                yield b"[" * 512

        err = _error(httpx.post(f"{s.url}/v1/completions", content=chunks(), timeout=30,
                                headers={"content-type": "application/json"}), 413)
        assert err["code"] == "request_too_large"
        small = json.dumps({"prompt": "a", "max_tokens": 2}).encode()
        fits = small + b" " * (limit - len(small))  # exactly at the limit
        assert _raw(s, "/v1/completions", fits).status_code == 200
        assert _error(_raw(s, "/v1/completions", fits + b" "), 413)
        assert s.metric("kvc:http_errors_total", status="413") == 3


# ---- X-Request-Id ------------------------------------------------------------------------------
def test_every_response_carries_a_request_id(server):
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    generated = [httpx.get(f"{server.url}/health").headers["x-request-id"] for _ in range(2)]
    assert all(len(g) == 32 for g in generated) and generated[0] != generated[1]
    for r in (httpx.get(f"{server.url}/no/such/path"), httpx.put(f"{server.url}/v1/chains/x"),
              _post(server, "/v1/completions", {"prompt": "x", "temperature": -1}),
              httpx.get(f"{server.url}/metrics")):
        assert r.headers.get("x-request-id"), (r.status_code, r.headers)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True},
                      headers={"X-Request-Id": "stream-7"}) as st:
        assert st.headers["x-request-id"] == "stream-7"
    # not echoed when it is not a sane token (too long, or with a space): a new one instead
    for bad in ("x" * 129, "two words"):
        got = httpx.get(f"{server.url}/health", headers={"X-Request-Id": bad}).headers["x-request-id"]
        assert got != bad and len(got) == 32


def test_a_handler_bug_500_still_carries_the_request_id(server, monkeypatch, caplog):
    def boom(*a, **k):
        raise ZeroDivisionError("hidden")

    monkeypatch.setattr(server.state.ctx, "encode", boom)
    caplog.set_level(logging.ERROR)
    r = _post(server, "/v1/completions", {"prompt": "x"}, headers={"X-Request-Id": "bug-1"})
    assert _error(r, 500) and r.headers["x-request-id"] == "bug-1"
    assert "request id bug-1" in caplog.text  # the log line to look for


# ---- schema: 405 Allow, strict types, unknown fields --------------------------------------------
@pytest.mark.parametrize("method, path, allowed", [
    ("PUT", "/v1/chains/some-id", "DELETE, GET"),
    ("PATCH", "/v1/chains", "GET, POST"),
    ("DELETE", "/v1/completions", "POST"),
])
def test_405_allows_every_method_of_the_path(server, method, path, allowed):
    r = httpx.request(method, f"{server.url}{path}")
    _error(r, 405)
    assert r.headers["allow"] == allowed


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "add_generation_prompt": 0}, "add_generation_prompt"),
    ("/v1/chat/completions", {**CHAT, "stream": "true"}, "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "seed": "7"}, "seed"),
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/v1/chains", {"prompt": "x", "add_generation_prompt": 1}, "add_generation_prompt"),
])
def test_values_are_not_coerced(server, path, body, param):
    assert _error(_post(server, path, body), 400)["param"] == param


def test_unknown_fields_are_400_naming_them(server):
    err = _error(_post(server, "/v1/chat/completions", {**CHAT, "min_q": 0.1, "beam": 2}), 400)
    assert err["code"] == "unknown_field" and err["param"] == "min_q"
    assert "'min_q'" in err["message"] and "'beam'" in err["message"]
    err = _error(_post(server, "/v1/completions", {"prompt": "x", "stream": True,
                                                  "stream_options": {"include_usage": True, "extra": 1}}), 400)
    assert err["param"] == "stream_options.extra"
    for path, body in (("/tokenize", {"prompt": "x", "foo": 1}), ("/detokenize", {"tokens": [1], "foo": 1})):
        assert _error(_post(server, path, body), 400)["param"] == "foo"
    # chat messages keep their own extra keys: they go to the chat template (name, tool_call_id, ...)
    msg = {"role": "user", "content": "hi", "name": "alice"}
    assert _post(server, "/v1/chat/completions", {**CHAT, "messages": [msg]}).status_code == 200
    schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    assert schema["CompletionRequest"]["additionalProperties"] is False


def test_allow_extra_fields_drops_them():
    with live_server(allow_extra_fields=True) as s:
        r = _post(s, "/v1/completions", {"prompt": "x", "max_tokens": 3, "ignore_eos": True, "min_q": 0.1,
                                        "stream_options": None, "frobnicate": {"a": [1]}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert _post(s, "/tokenize", {"prompt": "x", "foo": 1}).status_code == 200
        # still strict about the types of the fields it knows
        assert _error(_post(s, "/v1/completions", {"prompt": "x", "max_tokens": "3", "foo": 1}), 400)["param"] \
            == "max_tokens"
        schema = httpx.get(f"{s.url}/openapi.json").json()["components"]["schemas"]
        assert "additionalProperties" not in schema["CompletionRequest"]


# ---- messages name no internal types ------------------------------------------------------------
@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "ok \\ud800 then"}', "prompt"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["fine", "\\udfff"]}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
])
def test_a_lone_surrogate_is_a_clean_400(server, path, raw, param):
    err = _error(_raw(server, path, raw), 400)
    assert err["param"] == param and "lone surrogate" in err["message"]
    for internal in ("Union", "TextEncodeInput", "Sequence", "Error", "<class"):
        assert internal not in err["message"], err["message"]


@pytest.mark.parametrize("scorer_params", [{"budget": [1, 2]}, {"budget": {"a": 1}}, {"window": [[1]]},
                                           {"budget": None}, {"nested": {"x": [1, {"y": 2}]}}])
def test_prune_with_odd_scorer_params_is_400(chain_server_snapkv, scorer_params):
    s, chain = chain_server_snapkv
    for scorer in (None, "snapkv", "h2o"):
        body = {"token_ranges": [[0, 4]], "keep": 0.5, "scorer_params": scorer_params,
                **({"scorer": scorer} if scorer else {})}
        err = _error(_post(s, f"/v1/chains/{chain}/prune", body), 400)
        assert err["param"] == "scorer"


@pytest.fixture(scope="module")
def chain_server_snapkv():
    with live_server({"method": "snapkv"}) as s:
        r = _post(s, "/v1/chains", {"prompt": "a prompt of a few dozen characters to prune"})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvc-chain-id"] == r.json()["id"]
        yield s, r.json()["id"]


# ---- API keys over everything but /health and /version -------------------------------------------
OPEN = ("/health", "/version")
GUARDED = ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models", "/v1/chains", "/no/such/path")


def test_api_keys_guard_the_schema_docs_and_metrics():
    with live_server(api_keys=("sekret",)) as s:
        ok = {"Authorization": "Bearer sekret"}
        for path in OPEN:
            assert httpx.get(f"{s.url}{path}").status_code == 200, path
        for path in GUARDED:
            assert _error(httpx.get(f"{s.url}{path}"), 401)["code"] == "invalid_api_key", path
            assert httpx.get(f"{s.url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
        for path in GUARDED[:-1]:
            assert httpx.get(f"{s.url}{path}", headers=ok).status_code == 200, path
        schema = httpx.get(f"{s.url}/openapi.json", headers=ok).json()
        assert schema["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]
        assert "security" not in schema["paths"]["/health"]["get"]


def test_public_metrics_opens_metrics_only():
    with live_server(api_keys=("sekret",), public_metrics=True) as s:
        assert httpx.get(f"{s.url}/metrics").status_code == 200
        for path in GUARDED[1:]:
            assert httpx.get(f"{s.url}{path}").status_code == 401, path


# ---- a client that closes a stream is counted as an abort ----------------------------------------
def test_a_stream_closed_by_its_client_counts_as_an_abort():
    with live_server({"max_model_len": 4096}) as s:
        def aborts() -> float:
            try:
                return s.metric("kvc:request_success_total", finished_reason="abort")
            except KeyError:
                return 0.0

        before = aborts()
        body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as st:
            lines = st.iter_lines()
            next(lines)
            next(lines)
        assert s.wait_metric("kvc:request_success_total", before + 1, finished_reason="abort") == before + 1
        assert s.metric("vllm:request_success_total", finished_reason="abort") == before + 1
        assert s.wait_metric("kvc:kv_pages_used", 0) == 0
        # a request that ends normally is not counted twice
        assert _post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
        assert s.metric("kvc:request_success_total", finished_reason="length") == 1
        assert aborts() == before + 1
