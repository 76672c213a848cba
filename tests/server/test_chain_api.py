"""The chain API over HTTP (issue 6), against the real app over the fake chain engine
(test_chain_api_fake.py): field validation, chain_id in responses and in the last stream chunk,
the chain errors as OpenAI JSON, GET/DELETE /v1/chains/{id}, chain metrics, the openai client
with extra_body; and cached_tokens from the real engine's prefix cache."""

from __future__ import annotations

import json
import random
from contextlib import contextmanager

import httpx
import openai
import pytest

from tests.server.test_chain_api_fake import chain_server

IDS = list(range(10, 30))  # 20 prompt tokens


@pytest.fixture(scope="module")
def cs():
    with chain_server(max_chains=64) as s:
        yield s


@contextmanager
def _running(server, body):
    """A streamed request, held running (slow steps) until the block ends; then the client leaves,
    and the steps stay slow until the server has aborted it (so the tokens it adds meanwhile stay
    few, whatever the machine's load: a continuation may roll back over them)."""
    server.fake.step_delay = 0.05  # under a loaded CI the abort took ~10 steps of 20 ms: over the 8-token rollback
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept alive: a dropped iterator closes the response
            while not next(lines).startswith("data: "):  # admitted and decoding once an event came
                pass
            yield
        server.wait_metric("kvc:num_requests_running", 0)
    finally:
        server.fake.step_delay = 0.0


def _post(server, body, path="/v1/completions", key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _body(prompt=IDS, max_tokens=4, **kw):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}


def _error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def _open(server, prompt=IDS, key=None, **kw):
    r = _post(server, _body(prompt, chain=True, **kw), key=key)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["chain_id"], prompt + body["choices"][0]["token_ids"]


def _events(server, body, path="/v1/completions"):
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


# ---- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"chain": True, "chain_id": "x"}, "chain_id"),
    ({"chain_id": "x", "chain_fork": "y"}, "chain_fork"),
    ({"chain": True, "chain_fork": "y"}, "chain_fork"),
    ({"chain": True, "n": 2}, "n"),
    ({"chain_id": "x", "n": 3}, "n"),
    ({"chain": True, "n": 2, "best_of": 2}, "n"),
    ({"chain_fork": "x", "best_of": 2}, "best_of"),
    ({"chain_id": ""}, "chain_id"),
    ({"chain_id": "x" * 129}, "chain_id"),
    ({"chain": "yes please"}, "chain"),
])
def test_invalid_chain_fields_are_400(cs, extra, param):
    _error(_post(cs, _body(**extra)), 400, param=param)


def test_a_chain_takes_one_prompt_not_a_batch(cs):
    err = _error(_post(cs, _body([IDS, IDS], chain=True)), 400, param="prompt")
    assert "one prompt" in err["message"]


def test_chat_validates_the_chain_fields_too(cs):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chain": True, "n": 2}
    err = _error(_post(cs, body, "/v1/chat/completions"), 400, param="n")
    assert "n must be 1" in err["message"]


def test_chain_false_is_a_plain_request(cs):
    r = _post(cs, _body(chain=False))
    assert r.status_code == 200 and "chain_id" not in r.json()


# ---- responses --------------------------------------------------------------------------------
def test_open_then_continue_reports_the_chain_and_reused_tokens(cs):
    cid, history = _open(cs)
    assert cid.startswith("chain-") and len(history) == 24
    r = _post(cs, _body(history + [40, 41, 42], chain_id=cid))
    body = r.json()
    assert r.status_code == 200 and body["chain_id"] == cid
    assert body["usage"]["prompt_tokens"] == 27
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 24


def test_fork_gets_a_new_chain_id(cs):
    cid, history = _open(cs)
    body = _post(cs, _body(history + [7], chain_fork=cid)).json()
    assert body["chain_id"] not in (None, cid) and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 24
    again = _post(cs, _body(history + [8], chain_id=cid)).json()  # the source goes on independently
    assert again["chain_id"] == cid


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_names_the_chain_on_its_closing_chunks(cs, include_usage):
    cid, history = _open(cs)
    body = _body(history + [50, 51], chain_id=cid, stream=True, max_tokens=5,
                 stream_options={"include_usage": include_usage})
    events = _events(cs, body)
    assert events[-1]["chain_id"] == cid
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["chain_id"] == cid
    named = [e for e in events if "chain_id" in e]
    assert named == finish + ([events[-1]] if include_usage else [])
    if include_usage:
        assert events[-1]["choices"] == []
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history)


def test_chat_stream_names_the_chain_on_the_finish_and_usage_chunks(cs):
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "chain": True, "stream": True, "stream_options": {"include_usage": True}}
    events = _events(cs, body, "/v1/chat/completions")
    cid = events[-1]["chain_id"]
    assert cid and events[-1]["usage"]["completion_tokens"] == 3
    assert [e.get("chain_id") for e in events if e["choices"] and e["choices"][0]["finish_reason"]] == [cid]
    assert all("chain_id" not in e for e in events[:-2])


# ---- errors -----------------------------------------------------------------------------------
def test_unknown_chain_is_404(cs):
    err = _error(_post(cs, _body(chain_id="chain-nope")), 404, "chain_not_found", "chain_id")
    assert err["type"] == "not_found_error"
    _error(_post(cs, _body(chain_fork="chain-nope")), 404, "chain_not_found")


def test_diverging_prompt_is_409(cs):
    cid, _ = _open(cs)
    err = _error(_post(cs, _body([3] * 30, chain_id=cid)), 409, "chain_diverged")
    assert "token 0" in err["message"] and err["type"] == "conflict_error"


def test_busy_chain_is_409_and_free_again_after_the_stream_ends(cs):
    cid, history = _open(cs)
    with _running(cs, _body(history + [1], chain_id=cid, stream=True, max_tokens=400)):
        _error(_post(cs, _body(history + [1], chain_id=cid)), 409, "chain_busy")
    # the client went away: the request is aborted, its turn recorded, the chain idle again
    assert cs.wait_metric("kvc:chains_active", 0) == 0
    r = _post(cs, _body(history + [2], chain_id=cid))
    assert r.status_code == 200, r.text


def test_evicted_chain_is_410_and_capacity_is_503():
    with chain_server(max_chains=1) as s:
        first, history = _open(s)
        second, _ = _open(s, [4, 5, 6])  # the one slot: the idle first chain is evicted
        err = _error(_post(s, _body(history + [1], chain_id=first)), 410, "chain_evicted", "chain_id")
        assert "evicted" in err["message"]
        assert s.metric("kvc:chains_evicted_total") == 1
        with _running(s, _body([4, 5, 6], chain_id=second, stream=True, max_tokens=400)):
            err = _error(_post(s, _body(chain=True)), 503, "chain_capacity")
            assert err["type"] == "service_unavailable"


# ---- GET / DELETE -----------------------------------------------------------------------------
def test_get_and_delete_a_chain(cs):
    cid, history = _open(cs)
    info = httpx.get(f"{cs.url}/v1/chains/{cid}").json()
    assert info["id"] == cid and info["object"] == "chain"
    assert (info["tokens"], info["state"], info["pages"]) == (len(history), "idle", 2) and info["last_used"] > 0
    r = httpx.delete(f"{cs.url}/v1/chains/{cid}")
    assert r.status_code == 200 and r.json() == {"id": cid, "object": "chain", "deleted": True}
    _error(httpx.get(f"{cs.url}/v1/chains/{cid}"), 410, "chain_evicted")
    _error(httpx.delete(f"{cs.url}/v1/chains/{cid}"), 410, "chain_evicted")
    _error(_post(cs, _body(history + [1], chain_id=cid)), 410, "chain_evicted")
    _error(httpx.get(f"{cs.url}/v1/chains/chain-unknown"), 404, "chain_not_found")
    _error(httpx.get(f"{cs.url}/v1/chains/{'x' * 200}"), 400)


# ---- auth -------------------------------------------------------------------------------------
def test_chains_belong_to_the_key_that_opened_them():
    import hashlib

    with chain_server(api_key="key-a", api_keys=("key-b",)) as s:
        _error(_post(s, _body(chain=True)), 401, "invalid_api_key")
        _error(_post(s, _body(chain=True), key="key-c"), 401, "invalid_api_key")
        cid, history = _open(s, key="key-a")
        assert s.fake.chains.live[cid].owner == hashlib.sha256(b"key-a").hexdigest()
        other = {"Authorization": "Bearer key-b"}
        _error(_post(s, _body(history + [1], chain_id=cid), key="key-b"), 404, "chain_not_found")
        _error(_post(s, _body(history + [1], chain_fork=cid), key="key-b"), 404, "chain_not_found")
        _error(httpx.get(f"{s.url}/v1/chains/{cid}", headers=other), 404, "chain_not_found")
        _error(httpx.delete(f"{s.url}/v1/chains/{cid}", headers=other), 404, "chain_not_found")
        mine = {"Authorization": "Bearer key-a"}
        assert httpx.get(f"{s.url}/v1/chains/{cid}", headers=mine).json()["state"] == "idle"
        other_cid, _ = _open(s, key="key-b")
        assert s.fake.chains.live[other_cid].owner == hashlib.sha256(b"key-b").hexdigest()
        r = _post(s, _body(history + [1], chain_id=cid), key="key-a")
        assert r.status_code == 200 and r.json()["chain_id"] == cid


def test_without_keys_the_owner_is_none(cs):
    cid, _ = _open(cs)
    assert cs.fake.chains.live[cid].owner is None


# ---- metrics ----------------------------------------------------------------------------------
def test_chain_metrics(cs):
    text = httpx.get(f"{cs.url}/metrics").text
    for name in ("kvc:chains_active", "kvc:chains_idle", "kvc:chains_evicted_total", "kvc:chain_pages",
                 "kvc:prompt_tokens_reused_total", "kvc:prompt_tokens_prefilled_total"):
        assert f"\n{name}{{" in text, name
    cid, history = _open(cs)
    idle = sum(c.state == "idle" for c in cs.fake.chains.live.values())
    assert idle >= 1 and cs.wait_metric("kvc:chains_idle", idle) == idle
    assert cs.metric("kvc:chain_pages") == cs.fake.chains.stats()["pages"] > 0
    reused, prefilled = cs.metric("kvc:prompt_tokens_reused_total"), cs.metric("kvc:prompt_tokens_prefilled_total")
    r = _post(cs, _body(history + [9, 9, 9], chain_id=cid)).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history)
    assert cs.wait_metric("kvc:prompt_tokens_reused_total", reused + len(history)) == reused + len(history)
    assert cs.metric("kvc:prompt_tokens_prefilled_total") == prefilled + 3


# ---- the openai client ------------------------------------------------------------------------
def test_openai_client_with_extra_body(cs):
    client = openai.OpenAI(base_url=f"{cs.url}/v1", api_key="unused", max_retries=0, timeout=60)
    extra = {"ignore_eos": True, "return_token_ids": True}
    r = client.completions.create(model="kvc-test", prompt=IDS, max_tokens=4, temperature=0,
                                  extra_body={"chain": True, **extra})
    cid = r.chain_id
    history = IDS + r.choices[0].token_ids
    r2 = client.completions.create(model="kvc-test", prompt=history + [3], max_tokens=4, temperature=0,
                                   extra_body={"chain_id": cid, **extra})
    assert r2.chain_id == cid and r2.usage.prompt_tokens_details.cached_tokens == len(history)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="kvc-test", prompt=IDS, max_tokens=2, extra_body={"chain_id": "chain-x"})
    assert e.value.code == "chain_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="kvc-test", prompt=IDS, max_tokens=2, n=2, extra_body={"chain": True})

    messages = [{"role": "user", "content": "tell me"}]
    c = client.chat.completions.create(model="kvc-test", messages=messages, max_tokens=3, temperature=0,
                                       extra_body={"chain": True, "ignore_eos": True})
    messages += [{"role": "assistant", "content": c.choices[0].message.content},
                 {"role": "tool", "content": "a long tool result"}]
    c2 = client.chat.completions.create(model="kvc-test", messages=messages, max_tokens=3, temperature=0,
                                        extra_body={"chain_id": c.chain_id, "ignore_eos": True})
    assert c2.chain_id == c.chain_id and c2.usage.prompt_tokens_details.cached_tokens >= c.usage.prompt_tokens
    client.delete(f"/chains/{c.chain_id}", cast_to=object)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="kvc-test", messages=messages, max_tokens=3,
                                       extra_body={"chain_id": c.chain_id})
    assert e.value.status_code == 410 and e.value.code == "chain_evicted"


# ---- cached_tokens of the real engine ------------------------------------------------------------
def test_cached_tokens_from_the_prefix_cache_stream_and_not(server):
    rng = random.Random(6)
    prompt = [rng.randrange(3, 290) for _ in range(40)]  # 2 full pages of 16, then 8 tokens
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = _post(server, body).json()["usage"]
    assert (first["prompt_tokens"], first["prompt_tokens_details"]["cached_tokens"]) == (40, 0)
    second = _post(server, body).json()["usage"]
    assert second["prompt_tokens_details"]["cached_tokens"] == 32
    events = _events(server, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    chat = {"messages": [{"role": "user", "content": "x" * 60}], "max_tokens": 2, "temperature": 0}
    _post(server, chat, "/v1/chat/completions")
    events = _events(server, {**chat, "stream": True, "stream_options": {"include_usage": True}},
                     "/v1/chat/completions")
    usage = events[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] // 16 * 16
