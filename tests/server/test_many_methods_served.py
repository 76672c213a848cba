"""`kvc serve --methods`: one server, several KV methods (runtime/lanes.py). A request picks one through
`extra_body={"kvc": {"method": ..., "params": {...}}}`; concurrent requests of every method batch
together and each gets its one-method tokens; /v1/models lists the methods and their parameters,
/metrics counts per method; a bad choice is an OpenAI-style 400 that loses nothing."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from kvc import LLM, SamplingParams
from tests.server.conftest import TEST_KV_BYTES, live_server

PARAMS = {"snapkv": {"budget": 32, "window": 8}, "kivi": {"residual_length": 16, "group_size": 16, "bits": 4}}
METHODS = ["full", "snapkv", "quest", "kivi"]


@pytest.fixture(scope="module")
def server():
    with live_server({"method": "full", "methods": METHODS[1:], "methods_params": PARAMS}, max_waiting=256) as s:
        yield s


def _prompt(i: int) -> list[int]:
    return [3 + (i * 7 + j * 13) % 240 for j in range(70 + i)]


def test_concurrent_mixed_methods_give_single_method_tokens(server):
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    which = [METHODS[i % 4] for i in range(32)]

    async def one(i: int):
        r = await client.completions.create(model="kvc-test", prompt=_prompt(i), max_tokens=8, temperature=0,
                                            extra_body={"kvc": {"method": which[i]}, "return_token_ids": True})
        return r.choices[0].token_ids

    async def run():
        return await asyncio.gather(*(one(i) for i in range(32)))

    got = asyncio.run(run())
    for method in METHODS:
        rows = [i for i in range(32) if which[i] == method]
        ref = LLM("random:tiny", method=method, method_params=PARAMS.get(method), kv_cache_memory=TEST_KV_BYTES,
                  max_model_len=512).generate([_prompt(i) for i in rows], SamplingParams(max_tokens=8, temperature=0))
        assert [got[i] for i in rows] == [r.token_ids for r in ref], method
    for method in METHODS:
        assert server.metric("kvc:method_requests_total", method=method, model_name="kvc-test") == 8
    snapkv = sum(len(got[i]) for i in range(32) if which[i] == "snapkv")
    assert server.metric("kvc:method_generation_tokens_total", method="snapkv", model_name="kvc-test") == snapkv
    assert server.metric("kvc:method_kv_pages", method="full", model_name="kvc-test") == 0  # nothing runs now


def test_models_list_the_methods_and_their_parameters(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    (card,) = client.models.list().data
    methods = {m["name"]: m for m in card.model_extra["methods"]}
    assert card.model_extra["method"] == "full" and list(methods) == METHODS
    assert methods["full"]["default"] and not methods["snapkv"]["default"]
    assert methods["snapkv"]["parameters"]["budget"] == {"value": 32, "type": "tokens"}
    assert methods["kivi"]["parameters"]["bits"]["value"] == 4


@pytest.mark.parametrize("kvc, param, words", [
    ({"method": "h2o"}, "method", "not served here"),
    ({"method": "snapkv", "params": {"budget": -3}}, "method_params", "budget"),
    ({"method": "snapkv", "params": {"bogus": 1}}, "method_params", "has no parameter"),
    ({"method": "kivi", "params": {"bits": 2}}, "method_params", "stores K/V otherwise"),
    ({"method": ""}, None, "at least 1 character"),
    ({"params": "budget=3"}, None, "valid dictionary"),
    ({"method": "full", "extra": 1}, None, "unknown field 'kvc.extra'"),
])
def test_bad_method_choice_is_a_400_and_loses_nothing(server, kvc, param, words):
    body = {"model": "kvc-test", "prompt": "hello", "max_tokens": 2, "kvc": kvc}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]
    if param is not None:
        assert error["param"] == param
    ok = httpx.post(f"{server.url}/v1/completions", json={**body, "kvc": {"method": "snapkv"}}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


def test_request_parameters_and_chat(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="kvc-test", messages=[{"role": "user", "content": "hi " * 40}],
                                       max_tokens=4, temperature=0,
                                       extra_body={"kvc": {"method": "snapkv", "params": {"budget": 24}}})
    assert r.choices[0].message.content is not None
    assert server.metric("kvc:method_requests_total", method="snapkv(budget=24)", model_name="kvc-test") == 1


def test_a_chain_continued_with_another_method_is_a_409(server):
    body = {"model": "kvc-test", "prompt": _prompt(3), "max_tokens": 3, "temperature": 0, "chain": True,
            "kvc": {"method": "snapkv"}}
    first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    chain_id = first["chain_id"]
    again = {**body, "chain": None, "chain_id": chain_id, "prompt": _prompt(3) + [5, 6], "kvc": {"method": "full"}}
    r = httpx.post(f"{server.url}/v1/completions", json=again, timeout=60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "chain_method_mismatch"
    r = httpx.post(f"{server.url}/v1/completions", json={**again, "kvc": {"method": "snapkv"}}, timeout=60)
    assert r.status_code == 200


def test_serve_cli_methods_and_their_parameters(monkeypatch):
    """`kvc serve --methods A,B --method-param B.k=v`: the config the server starts with; bad lists refused."""
    from kvc.runtime.cli import main
    from kvc.runtime.server import launch

    seen = {}
    monkeypatch.setattr(launch, "serve", lambda cfg, **kw: seen.setdefault("cfg", cfg) and 0)
    assert main(["serve", "--model", "random:tiny", "--methods", "snapkv,full,kivi", "--method-param",
                 "snapkv.budget=64", "--method-param", "kivi.bits=4", "--method-param", "window=16"]) == 0
    cfg = seen["cfg"]
    assert (cfg.method, list(cfg.methods)) == ("snapkv", ["snapkv", "full", "kivi"])
    assert cfg.method_params == {"budget": 64, "window": 16} and cfg.methods_params == {"kivi": {"bits": 4}}
    seen.clear()
    assert main(["serve", "--model", "random:tiny", "--methods", "snapkv,full", "--method", "full"]) == 0
    assert seen["cfg"].method == "full"
    assert main(["serve", "--model", "random:tiny", "--methods", "snapkv,full", "--method", "h2o"]) != 0
    assert main(["serve", "--model", "random:tiny", "--methods", "snapkv,,full"]) != 0
