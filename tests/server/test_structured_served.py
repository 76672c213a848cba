"""vLLM's `structured_outputs` field on both endpoints, served by the random tiny model (whose tokens
are noise, so only the grammar makes them valid), streamed or not, and its clear 400s."""

from __future__ import annotations

import json
import re

import httpx
import pytest


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


@pytest.mark.parametrize("so, check", [
    ({"regex": "[0-9]{4}-[a-z]{3}"}, lambda t: re.fullmatch("[0-9]{4}-[a-z]{3}", t)),
    ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}}, lambda t: json.loads(t) in ({"ok": True}, {"ok": False})),
    ({"grammar": 'start: "x" ("y" | "z")~2'}, lambda t: re.fullmatch("x[yz]{2}", t)),
])
def test_completions_follow_structured_outputs(server, so, check):
    body = {"prompt": "some prompt", "max_tokens": 40, "temperature": 1.0, "seed": 4, "n": 3,
            "structured_outputs": so}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice
    streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True, "n": 1}, timeout=120)
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert check(text), text


def test_chat_follows_structured_outputs(server):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
                                               "structured_outputs": {"regex": "(ab)+c"}})
    assert r.status_code == 200, r.text
    assert re.fullmatch("(ab)+c", r.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}),
    ("/v1/completions", {"structured_outputs": {}}),
    ("/v1/completions", {"structured_outputs": {"regex": "[a-"}}),
    ("/v1/completions", {"structured_outputs": {"json": "{oops"}}),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}),
])
def test_bad_structured_outputs_are_400(server, path, extra):
    base = {"prompt": "p"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = _post(server, path, {**base, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs"


def test_unknown_structured_outputs_keys_are_named(server):
    r = _post(server, "/v1/completions", {"prompt": "p", "structured_outputs": {"regexp": "a"}})
    assert r.status_code == 400 and "regexp" in r.json()["error"]["message"]
