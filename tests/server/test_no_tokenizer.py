"""A model without a tokenizer (like `random:NAME` for benchmarks): token-id prompts work and
return token ids; everything that needs text is a clear 400."""

from __future__ import annotations

import json

import httpx
import pytest

from kvc import SamplingParams
from tests.server.conftest import live_server


@pytest.fixture(scope="module")
def bare_server():
    with live_server(prepare=lambda engine: setattr(engine, "tokenizer", None)) as s:
        yield s


def test_token_id_prompts_stream_token_ids(bare_server, llm):
    ref = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    body = {"prompt": [7, 8, 9], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{bare_server.url}/v1/completions", json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    ids = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert ids == ref.token_ids
    assert all(c["text"] == "" for e in events for c in e["choices"])
    assert events[-1]["usage"]["completion_tokens"] == 6 and events[-1]["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "text"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/tokenize", {"prompt": "text"}, "prompt"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens"),
])
def test_text_needs_a_tokenizer(bare_server, path, body, param):
    r = httpx.post(f"{bare_server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
