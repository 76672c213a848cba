"""Prefix pruning over HTTP (issue 6): `POST /v1/chains/{id}/prune` by role, message index and
token range, re-pruning, the automatic prune (`auto_prune`), `POST /v1/chains` (a prefix as a
chain), the errors, and the metrics. A chat conversation through the openai client on the embedded
default model (its byte tokenizer gives character offsets, so messages map to token ranges)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import live_server

ENGINE = {"method": "snapkv", "method_params": {"budget": 400, "window": 8, "kernel": 3}, "page_size": 4,
          "max_model_len": 2048, "kv_cache_memory": 2**25}
TOOL = "result: " + " ".join(f"line {i} of the listing, value {i * 7 % 13}" for i in range(24))


def _messages(tool: str = TOOL) -> list[dict]:
    return [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "List the files and summarise them."},
            {"role": "assistant", "content": "Calling ls."},
            {"role": "tool", "content": tool, "tool_call_id": "call-1"},
            {"role": "user", "content": "Now what is in line 3?"}]


def _chat(client, messages, extra, max_tokens=6):
    return client.chat.completions.create(model="kvc-test", messages=messages, max_tokens=max_tokens,
                                          temperature=0, extra_body={"ignore_eos": True, **extra})


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _prune(server, chain: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chains/{chain}/prune", json=body, timeout=60)


def test_prune_by_role_then_again_then_continue() -> None:
    with live_server(ENGINE) as server:
        client = _client(server)
        first = _chat(client, _messages(), {"chain": True})
        chain = first.model_extra["chain_id"]
        info = httpx.get(f"{server.url}/v1/chains/{chain}").json()
        assert info["messages"] == 6  # five sent, one generated
        pruned = _prune(server, chain, {"roles": ["tool"], "keep": 0.25})
        assert pruned.status_code == 200, pruned.text
        body = pruned.json()
        (start, end), = body["ranges"]
        assert end - start > 300  # the tool message's content
        assert body["tokens"] == info["tokens"]  # the logical history does not change
        assert body["stored_tokens"] < body["stored_tokens_before"] and body["pages"] < body["pages_before"]
        assert sum(body["dropped"]) > 0
        # pruned again: fewer still
        again = _prune(server, chain, {"messages": [3], "keep_tokens": 8}).json()
        assert again["ranges"] == body["ranges"] and again["stored_tokens"] < body["stored_tokens"]
        # the conversation continues the chain: only the suffix is prefilled
        history = info["tokens"]
        convo = _messages() + [{"role": "assistant", "content": first.choices[0].message.content},
                               {"role": "user", "content": "Thanks."}]
        second = _chat(client, convo, {"chain_id": chain})
        assert second.model_extra["chain_id"] == chain
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached <= history
        assert server.metric("kvc:chain_prunes_total") == 2
        assert server.metric("kvc:chain_pruned_tokens_total") == sum(body["dropped"]) + sum(again["dropped"])


def test_prune_errors() -> None:
    with live_server(ENGINE) as server:
        client = _client(server)
        chain = _chat(client, _messages(), {"chain": True}).model_extra["chain_id"]
        bad = [({"keep": 0.2}, "roles"),  # names nothing
               ({"roles": ["tool"]}, "keep"),  # no amount
               ({"roles": ["tool"], "keep": 0.5, "keep_tokens": 3}, "keep"),
               ({"messages": [99], "keep": 0.5}, "messages"),
               ({"token_ranges": [[10, 5]], "keep": 0.5}, "token_ranges"),
               ({"roles": ["tool"], "keep": 0.5, "scorer": "full"}, "scorer"),
               ({"roles": ["tool"], "keep": 0.5, "scorer": "nonexistent"}, "scorer"),
               ({"roles": ["tool"], "keep": 1.5}, None)]
        for body, param in bad:
            r = _prune(server, chain, body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["message"] and "Traceback" not in err["message"]
            if param is not None:
                assert err["param"] == param, (body, err)
        missing = _prune(server, "chain-doesnotexist", {"roles": ["tool"], "keep": 0.5})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "chain_not_found"
        # a raw-prompt chain has no messages, but token ranges work
        raw = client.completions.create(model="kvc-test", prompt="some raw prompt text " * 10, max_tokens=3,
                                        extra_body={"chain": True, "ignore_eos": True})
        raw_chain = raw.model_extra["chain_id"]
        r = _prune(server, raw_chain, {"roles": ["tool"], "keep": 0.5})
        assert r.status_code == 400 and "token_ranges" in r.json()["error"]["message"]
        assert _prune(server, raw_chain, {"token_ranges": [[0, 100]], "keep": 0.5}).status_code == 200


def test_create_chain_from_a_prefix_and_prune_it() -> None:
    with live_server(ENGINE) as server:
        r = httpx.post(f"{server.url}/v1/chains", json={"messages": _messages()[:4]}, timeout=60)
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["messages"] == 4 and info["state"] == "idle"
        pruned = _prune(server, info["id"], {"roles": ["tool"], "keep": 0.1}).json()
        assert pruned["stored_tokens"] < pruned["stored_tokens_before"]
        both = httpx.post(f"{server.url}/v1/chains", json={"prompt": "x", "messages": _messages()})
        assert both.status_code == 400


@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_auto_prune_prunes_old_tool_results_once(method: str) -> None:
    options = {**ENGINE, "method": method, "method_params": ENGINE["method_params"] if method == "snapkv" else None,
               "auto_prune": "role=tool,older_than=1,keep=0.2"}
    if method == "full":  # scores no tokens: the server's --prune-scorer ranks them
        options["prune_scorer"] = "snapkv"
    with live_server(options) as server:
        client = _client(server)
        first = _chat(client, _messages(), {"chain": True})
        chain = first.model_extra["chain_id"]
        # the tool result is followed by one assistant message (the call): pruned after turn 1
        assert server.wait_metric("kvc:chain_prunes_total", 1) == 1
        dropped = server.metric("kvc:chain_pruned_tokens_total")
        assert dropped > 0
        convo = _messages() + [{"role": "assistant", "content": first.choices[0].message.content},
                               {"role": "user", "content": "And line 4?"}]
        second = _chat(client, convo, {"chain_id": chain})
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        # turn 2's end prunes again only if something new qualifies: the same tool message is not
        assert server.metric("kvc:chain_pruned_tokens_total") == dropped
