"""Every error status the server sends, in OpenAI's error schema: 400 (with `param`), 401, 404,
400 for a prompt over the context, 503 when the waiting queue is full, 500 without details."""

from __future__ import annotations

import logging
import threading

import httpx
import openai
import pytest

from tests.server.conftest import live_server


def _post(server, path, body, **kw):
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kw)


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 10**6]}, "prompt"),
    ({"prompt": "x", "stop": ["", "a"]}, "stop"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "logit_bias": {"65": 101}}, "logit_bias.65"),
    ({"prompt": "x", "logit_bias": {"sixty": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 1, "chain_id": "nope"}, "prompt_logprobs"),
    ({"prompt": "x", "max_tokens": 600}, "max_tokens"),
    ({"prompt": "x", "n": 300}, "n"),
])
def test_invalid_completion_requests_are_400_with_param(server, body, param):
    err = _error(_post(server, "/v1/completions", body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_invalid_chat_requests_are_400_with_param(server, body, param):
    assert _error(_post(server, "/v1/chat/completions", body), 400)["param"] == param


def test_sampling_params_reject_seeds_a_generator_cannot_take():
    from kvc import SamplingParams
    from kvc.runtime.errors import InvalidSamplingParams

    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(seed=2**64)
    assert e.value.param == "seed"
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_malformed_json_is_400(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert _error(r, 400)["param"] is None


def test_prompt_over_the_context_is_400(server):
    err = _error(_post(server, "/v1/completions", {"prompt": list(range(1, 200)) * 3}), 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]})
    assert _error(chat, 400)["code"] == "context_length_exceeded"


def test_unknown_model_path_and_method(server):
    err = _error(_post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    _error(httpx.get(f"{server.url}/v1/models/gpt-9"), 404)
    _error(httpx.get(f"{server.url}/no/such/path"), 404)
    _error(httpx.get(f"{server.url}/v1/completions"), 405)


def test_openai_client_raises_the_matching_exceptions(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="kvc-test", prompt="x", temperature=-2)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_api_key_is_required_on_everything_but_health_and_version():
    with live_server(api_key="sekret") as s:
        ok = {"Authorization": "Bearer sekret"}
        err = _error(_post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}), 401)
        assert err["code"] == "invalid_api_key"
        _error(_post(s, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer wrong"}), 401)
        _error(_post(s, "/tokenize", {"prompt": "x"}), 401)
        assert _post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers=ok).status_code == 200
        assert httpx.get(f"{s.url}/health").status_code == 200
        _error(httpx.get(f"{s.url}/metrics"), 401)  # test_hardening.py has the rest
        assert httpx.get(f"{s.url}/metrics", headers=ok).status_code == 200
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        assert openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekret").models.list().data[0].id == "kvc-test"


def test_full_waiting_queue_is_503_and_frees_up():
    with live_server({"max_num_seqs": 1, "max_model_len": 4096}, max_waiting=1) as s:
        long = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}  # runs for seconds
        with httpx.Client(timeout=60) as a:
            with a.stream("POST", f"{s.url}/v1/completions", json=long) as running:
                lines = running.iter_lines()  # kept: a dropped iterator closes the connection
                next(lines)  # it runs: one seat, taken
                waiting = {}
                t = threading.Thread(target=lambda: waiting.update(r=_post(s, "/v1/completions",
                                                                            {"prompt": "y", "max_tokens": 2})))
                t.start()
                assert s.wait_metric("kvc:num_requests_waiting", 1) == 1
                err = _error(_post(s, "/v1/completions", {"prompt": "z", "max_tokens": 2}), 503)
                assert err["code"] == "server_busy"
        # the stream's client went away: its request is aborted and the waiting one runs
        t.join(timeout=30)
        assert waiting["r"].status_code == 200
        assert s.wait_metric("kvc:kv_pages_used", 0) == 0


def test_engine_failure_is_a_logged_500_without_details(caplog):
    with live_server() as s:
        engine = s.state.engine
        real_step = engine.step

        def broken_step():
            engine.step = real_step
            raise RuntimeError("secret internal detail")

        caplog.set_level(logging.ERROR)
        engine.step = broken_step
        r = _post(s, "/v1/completions", {"prompt": "x", "max_tokens": 4})
        err = _error(r, 500)
        assert "secret" not in r.text and "Traceback" not in r.text and err["type"] == "server_error"
        assert "secret internal detail" in caplog.text and "Traceback" in caplog.text
        engine.step = broken_step
        with httpx.stream("POST", f"{s.url}/v1/completions", json={"prompt": "x", "stream": True}) as st:
            lines = [line for line in st.iter_lines() if line]
        assert '"error"' in lines[-2] and "secret" not in lines[-2] and lines[-1] == "data: [DONE]"
        # the server keeps serving, with no page left behind
        assert _post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
        assert s.wait_metric("kvc:kv_pages_used", 0) == 0


def test_handler_bug_is_a_logged_500(caplog, server, monkeypatch):
    def boom(*a, **k):
        raise ZeroDivisionError("hidden")

    monkeypatch.setattr(server.state.ctx, "encode", boom)
    caplog.set_level(logging.ERROR)
    r = _post(server, "/v1/completions", {"prompt": "x"})
    err = _error(r, 500)
    assert "hidden" not in r.text and err["type"] == "server_error"
    assert "ZeroDivisionError" in caplog.text


def test_openapi_schema_documents_400_not_422(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    op = schema["paths"]["/v1/completions"]["post"]
    assert "422" not in op["responses"] and {"400", "404", "500", "503"} <= set(op["responses"])
    assert "text/event-stream" in op["responses"]["200"]["content"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_fails_requests_fast_instead_of_hanging(caplog):
    with live_server() as s:
        aengine = s.state.aengine

        def broken_publish():
            raise RuntimeError("engine thread bug")

        caplog.set_level(logging.ERROR)
        aengine._publish = broken_publish
        r = _post(s, "/v1/completions", {"prompt": "x", "max_tokens": 4})  # wakes the thread, which dies
        assert r.status_code in (500, 503), r.text
        aengine._thread.join(timeout=10)
        assert not aengine._thread.is_alive()
        for _ in range(3):  # later requests are answered at once, not queued forever
            err = _error(_post(s, "/v1/completions", {"prompt": "x", "max_tokens": 4}), 503)
            assert "RuntimeError" not in err["message"] and "engine thread bug" not in err["message"]
        assert httpx.get(f"{s.url}/health", timeout=5).status_code == 503
        assert "engine thread bug" in caplog.text
