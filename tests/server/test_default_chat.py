"""The embedded default model behind the server, as a new user meets it: a chat question gets a
real answer (greedy), a multi-turn chat through the openai client stays on topic, and the turn ends
at the model's end-of-turn token."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.server.conftest import live_server

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def default_server():
    with live_server(engine_options={"model": None, "max_model_len": 2048, "kv_cache_memory": 2**28},
                     served_model_name="SmolLM2-135M-Instruct") as s:
        yield s


def test_chat_answers_the_capital_of_france(default_server) -> None:
    r = httpx.post(f"{default_server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"  # ended by <|im_end|>, not by a token limit


def test_multi_turn_chat_through_the_openai_client(default_server) -> None:
    client = OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0)
    assert "Paris" in first.choices[0].message.content
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "What language do people speak there?"}]
    second = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
                                            extra_body={"chain": True})
    assert "French" in second.choices[0].message.content and second.choices[0].finish_reason == "stop"
