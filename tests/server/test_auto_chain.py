"""`kvc serve --auto-chain` through the openai client, with no client change (no `extra_body`):
each turn of a chat continues the chain of the previous one (`cached_tokens`, `x-kvc-chain-id`),
another API key's conversation never does, and `--chain-ttl` / `--max-chains` drop idle chains
and free their pages. `GET /v1/chains` lists the caller's chains."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.server.conftest import live_server

SNAPKV = {"method": "snapkv", "method_params": {"budget": 24, "window": 6, "kernel": 3}, "page_size": 4,
          "kv_cache_memory": 2**24}
SYSTEM = {"role": "system", "content": "You are a terse assistant that answers in one line."}


def _client(server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def _chat(client, messages):
    raw = client.chat.completions.with_raw_response.create(model="kvc-test", messages=messages, max_tokens=8,
                                                           temperature=0)
    return raw.parse(), raw.headers.get("x-kvc-chain-id")


def test_a_four_turn_chat_continues_its_chain_with_no_client_change():
    with live_server(SNAPKV, auto_chain_min_tokens=32) as s:
        client = _client(s)
        messages = [SYSTEM, {"role": "user", "content": "Tell me how a KV cache works, step by step."}]
        chain, previous_prompt = None, None
        for k in range(4):
            r, header = _chat(client, messages)
            assert header and header == r.model_extra["chain_id"]
            cached = r.usage.prompt_tokens_details.cached_tokens
            if k == 0:
                chain = header
                assert cached == 0
            else:
                assert header == chain, f"turn {k + 1} opened another chain"
                assert cached >= 0.9 * previous_prompt, (k + 1, cached, previous_prompt)
            previous_prompt = r.usage.prompt_tokens
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"And what happens at step {k + 2}?"}]
        listed = httpx.get(f"{s.url}/v1/chains").json()["data"]
        assert [c["id"] for c in listed] == [chain] and listed[0]["state"] == "idle"
        assert listed[0]["tokens"] >= previous_prompt and listed[0]["pages"] > 0
        # a stream of the next turn continues it too, and names it in its headers
        with client.chat.completions.with_streaming_response.create(
                model="kvc-test", messages=messages, max_tokens=4, stream=True) as st:
            assert st.headers["x-kvc-chain-id"] == chain
            assert any(line.startswith("data: [DONE]") for line in st.iter_lines())


def test_without_auto_chain_nothing_is_chained(server):
    r, header = _chat(_client(server), [SYSTEM, {"role": "user", "content": "hello " * 10}])
    assert header is None and "chain_id" not in (r.model_extra or {})
    assert httpx.get(f"{server.url}/v1/chains").json()["data"] == []


def test_explicit_chains_carry_the_header_too(server):
    client = _client(server)
    raw = client.completions.with_raw_response.create(model="kvc-test", prompt="x" * 20, max_tokens=2,
                                                      extra_body={"chain": True})
    chain = raw.headers["x-kvc-chain-id"]
    assert chain == raw.parse().model_extra["chain_id"]
    again = client.completions.with_raw_response.create(model="kvc-test", prompt="x" * 30, max_tokens=2,
                                                        extra_body={"chain_id": chain})
    assert again.headers["x-kvc-chain-id"] == chain
    client.delete(f"/chains/{chain}", cast_to=object)


def test_another_api_key_never_continues_the_chain():
    with live_server(SNAPKV, auto_chain_min_tokens=32, api_keys=("alice-key", "bob-key")) as s:
        alice, bob = _client(s, "alice-key"), _client(s, "bob-key")
        messages = [SYSTEM, {"role": "user", "content": "Summarize the plot of a long novel for me."}]
        r, alice_chain = _chat(alice, messages)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "Shorter, please."}]
        r, bob_chain = _chat(bob, messages)  # the same conversation, another owner
        assert bob_chain != alice_chain and r.usage.prompt_tokens_details.cached_tokens == 0
        r, again = _chat(alice, messages)
        assert again == alice_chain and r.usage.prompt_tokens_details.cached_tokens > 0
        for key, chain in (("alice-key", alice_chain), ("bob-key", bob_chain)):
            listed = httpx.get(f"{s.url}/v1/chains", headers={"Authorization": f"Bearer {key}"}).json()["data"]
            assert [c["id"] for c in listed] == [chain]


def test_idle_chains_expire_after_the_ttl_and_free_their_pages():
    with live_server(SNAPKV, auto_chain_min_tokens=32, chain_ttl=1.0) as s:
        _chat(_client(s), [SYSTEM, {"role": "user", "content": "Explain paging in one sentence, please."}])
        assert len(httpx.get(f"{s.url}/v1/chains").json()["data"]) == 1
        assert s.metric("kvc:chain_pages") > 0
        time.sleep(1.0)
        # dropped while the server idles: no request is needed to sweep them
        assert s.wait_metric("kvc:chains_expired_total", 1) == 1
        assert s.metric("kvc:chain_pages") == 0 and s.metric("kvc:kv_pages_used") == 0
        assert httpx.get(f"{s.url}/v1/chains").json()["data"] == []


def test_max_chains_keeps_the_most_recent_and_frees_the_rest():
    with live_server(SNAPKV, auto_chain_min_tokens=32, max_chains=2) as s:
        client = _client(s)
        chains = [_chat(client, [SYSTEM, {"role": "user", "content": f"Question number {k}: what is {k} + {k}?"}])[1]
                  for k in range(3)]
        assert len(set(chains)) == 3
        listed = httpx.get(f"{s.url}/v1/chains").json()["data"]
        assert [c["id"] for c in listed] == chains[:0:-1]  # most recent first; the first one was dropped
        assert s.metric("kvc:chain_pages") == sum(c["pages"] for c in listed)
        assert s.metric("kvc:chains_expired_total") == 1
        gone = httpx.get(f"{s.url}/v1/chains/{chains[0]}")
        assert gone.status_code == 410 and gone.json()["error"]["code"] == "chain_evicted"


@pytest.mark.parametrize("flag, value", [("chain_ttl", 0), ("max_chains", 0)])
def test_bad_chain_limits_are_refused_at_startup(flag, value):
    from kvc.runtime.errors import KvcError

    with pytest.raises(KvcError):
        with live_server(**{flag: value}):
            pass


def test_the_serve_flags_reach_the_server():
    """`kvc serve` itself, with every new flag: automatic chains and their bounds, extra fields
    dropped, the body limit, public metrics (the schema's pages stay behind the key)."""
    from tests.server.conftest import served_process

    flags = ["--auto-chain", "--auto-chain-min-tokens", "8", "--chain-ttl", "60", "--max-chains", "1",
             "--allow-extra-fields", "--max-request-bytes", "4096", "--api-key", "k", "--public-metrics",
             "--max-model-len", "512", "--served-model-name", "kvc-test"]
    with served_process(*flags) as (_, url):
        key = {"Authorization": "Bearer k"}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=120)
        messages = [SYSTEM, {"role": "user", "content": "Name three colours."}]
        r, first = _chat(client, messages)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "Two more."}]
        r, second = _chat(client, messages)
        assert first and second == first and r.usage.prompt_tokens_details.cached_tokens > 0
        _chat(client, [SYSTEM, {"role": "user", "content": "Something else entirely, at length."}])
        chains = httpx.get(f"{url}/v1/chains", headers=key).json()["data"]
        assert len(chains) == 1 and chains[0]["id"] != first  # --max-chains 1 dropped the first
        body = {"prompt": "x", "max_tokens": 2, "frobnicate": True}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=key).status_code == 200
        big = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 5000}, headers=key)
        assert big.status_code == 413
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.get(f"{url}/docs").status_code == 401


@pytest.mark.parametrize("flags", [["--chain-ttl", "0"], ["--max-chains", "0"], ["--auto-chain-min-tokens", "0"],
                                   ["--max-request-bytes", "-1"]])
def test_bad_serve_flags_are_refused_before_the_model_loads(flags):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "kvc.runtime.cli", "serve", "--model", "random:tiny", *flags],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "kvc: error:" in run.stderr and "Traceback" not in run.stderr
