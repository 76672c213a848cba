"""The OpenAI server over an engine with an eviction interval (`--evict-interval`, here through
`EngineConfig.evict_interval`, as `kvc serve` builds it): the engine gets the interval, and a
completion returns the same greedy tokens as the offline API with the same interval."""

from __future__ import annotations

import httpx
import pytest

from kvc import LLM, SamplingParams
from tests.server.conftest import TEST_KV_BYTES, live_server

OPTIONS = {"method": "streamingllm", "method_params": {"sink": 4, "recent": 8}, "evict_interval": 4}
PROMPT = list(range(3, 43))


@pytest.fixture(scope="module")
def interval_server():
    with live_server(engine_options=dict(OPTIONS)) as s:
        yield s


def test_completions_follow_the_offline_engine(interval_server):
    engine = interval_server.state.engine
    assert engine.method.evict_interval == 4
    want = LLM("random:tiny", kv_cache_memory=TEST_KV_BYTES, max_model_len=512, **OPTIONS).generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].token_ids
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{interval_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want and choice["finish_reason"] == "length"
