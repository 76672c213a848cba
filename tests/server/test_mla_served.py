"""GLM-4.7-Flash (MLA, the latent KV cache) behind the OpenAI-compatible server: a tiny random
`glm4_moe_lite` with kvc's byte tokenizer, served with SnapKV, answers chat completions (whole and
streamed) with the offline API's greedy tokens, keeps a chain across turns, and lists itself in /v1/models."""

from __future__ import annotations

import json

import httpx
import pytest

from kvc.runtime.llm import LLM
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_glm4_moe_lite
from tests.server.conftest import live_server

PARAMS = {"budget": 24, "window": 8}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_glm4_moe_lite(tmp_path_factory.mktemp("glm"), seed=2, tokenizer=True, vocab_size=320)


def test_chat_over_the_latent_cache(model_dir):
    options = {"model": str(model_dir), "method": "snapkv", "method_params": PARAMS, "max_model_len": 400}
    messages = [{"role": "user", "content": "Tell me about the latent cache. " * 6}]
    offline = LLM(str(model_dir), method="snapkv", method_params=PARAMS, max_model_len=400)
    prompt = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    with live_server(engine_options=options, served_model_name="glm-tiny") as server:
        assert server.state.engine.attention.stores[0].spec.latent
        body = {"model": "glm-tiny", "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        out = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
        assert out["choices"][0]["message"]["content"] == want.text
        assert out["usage"]["completion_tokens"] == 12
        streamed = ""
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        streamed += choice.get("delta", {}).get("content") or ""
        assert streamed == want.text
        first = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "chain": True}, timeout=120).json()
        chain = first["chain_id"]
        history = messages + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                              {"role": "user", "content": "And then?"}]
        second = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "messages": history,
                                                                       "chain_id": chain}, timeout=120)
        assert second.status_code == 200, second.text
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["glm-tiny"]
