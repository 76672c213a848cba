"""The server driven by the official `openai` client: completions and chat, streaming and not,
usage counts, greedy output equal to `LLM.generate`, sampling fields, stop strings."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from kvc import SamplingParams

PROMPTS = ["Hello, kvc", "The capital of France is", "def main():"]


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy(llm, prompt, max_tokens, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **kw))[0]


def _chat_ids(llm, messages):
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_llm_generate(client, llm, prompt):
    ref = _greedy(llm, prompt, 24)
    r = client.completions.create(model="kvc-test", prompt=prompt, max_tokens=24, temperature=0)
    assert r.object == "text_completion" and r.model == "kvc-test"
    (choice,) = r.choices
    assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_non_stream_and_reports_usage(client, llm):
    ref = _greedy(llm, PROMPTS[1], 20)
    chunks = list(client.completions.create(model="kvc-test", prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert text_chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))


def test_stream_without_include_usage_has_no_usage_chunk(server):
    body = {"prompt": "abc", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all('"usage"' not in line for line in lines)


def test_chat_greedy_equals_llm_generate_on_the_chat_template(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ref = _greedy(llm, _chat_ids(llm, messages), 16)
    r = client.chat.completions.create(model="kvc-test", messages=messages, max_tokens=16, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)


def test_chat_stream(client, llm):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}]}]
    ref = _greedy(llm, _chat_ids(llm, [{"role": "user", "content": "Tell me"}]), 12)
    chunks = list(client.chat.completions.create(model="kvc-test", messages=messages, max_completion_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [ref.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_token_id_prompts_batches_and_n(client, llm):
    prompts = [[5, 6, 7, 8], [100, 101]]
    r = client.completions.create(model="kvc-test", prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, ids in enumerate(prompts):
        ref = _greedy(llm, ids, 5)
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == ref.text  # greedy: all n agree
    assert r.usage.prompt_tokens == 6  # each prompt counted once
    assert r.usage.completion_tokens == sum(len(_greedy(llm, ids, 5).token_ids) * 2 for ids in prompts)


def test_seed_makes_sampling_reproducible_and_n_differs(client):
    def sample(seed, n=1):
        r = client.completions.create(model="kvc-test", prompt="Once upon", max_tokens=12, temperature=1.0,
                                      seed=seed, n=n, extra_body={"return_token_ids": True, "ignore_eos": True})
        return [c.model_extra["token_ids"] for c in r.choices]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    two = sample(7, n=2)
    assert two[0] == sample(7)[0] and two[0] != two[1]


def test_top_k_one_is_greedy(client, llm):
    ref = _greedy(llm, "Top k", 10)
    r = client.completions.create(model="kvc-test", prompt="Top k", max_tokens=10, temperature=1.5,
                                  extra_body={"top_k": 1})
    assert r.choices[0].text == ref.text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_output_and_never_leaks(client, llm, stream):
    ref = _greedy(llm, PROMPTS[0], 32, ignore_eos=True)
    text = ref.text
    start = next(i for i in range(4, len(text) - 3) if text.find(text[i : i + 3]) == i)
    stop = text[start : start + 3]
    r = client.completions.create(model="kvc-test", prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=[stop],
                                  stream=stream, extra_body={"ignore_eos": True},
                                  **({"stream_options": {"include_usage": True}} if stream else {}))
    if stream:
        chunks = list(r)
        pieces = [c.choices[0].text for c in chunks if c.choices]
        shown, reason, usage = "".join(pieces), chunks[-2].choices[0].finish_reason, chunks[-1].usage
    else:
        shown, reason, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
    assert shown == text[:start] and reason == "stop"
    assert stop not in shown
    assert 0 < usage.completion_tokens < len(ref.token_ids)


def test_stop_token_ids_and_return_token_ids(client, llm):
    ref = _greedy(llm, PROMPTS[2], 16, ignore_eos=True)
    stop_id = ref.token_ids[5]
    cut = ref.token_ids.index(stop_id)
    r = client.completions.create(model="kvc-test", prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id], "ignore_eos": True,
                                              "return_token_ids": True})
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.model_extra["token_ids"] == ref.token_ids[: cut + 1]  # the stop token counts, unshown
    assert c.text == llm.decode(ref.token_ids[:cut])
    assert r.usage.completion_tokens == cut + 1


def test_models_version_health_tokenize_detokenize(client, server, llm):
    models = client.models.list()
    assert [m.id for m in models.data] == ["kvc-test"]
    assert client.models.retrieve("kvc-test").id == "kvc-test"
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/version").json()["version"]
    ids = llm.encode("Hello, kvc")
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello, kvc"}).json()
    assert tok["tokens"] == ids and tok["count"] == len(ids) and tok["max_model_len"] == 512
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == _chat_ids(llm, [{"role": "user", "content": "Hi"}])
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello, kvc"}


def test_metrics_count_tokens_and_latencies(server, client):
    before = server.metric("kvc:generation_tokens_total")
    client.completions.create(model="kvc-test", prompt="count me", max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    assert server.metric("kvc:generation_tokens_total") == before + 7
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["kvc:num_requests_running", "kvc:num_requests_waiting", "kvc:kv_pages_used", "kvc:kv_pages_free",
                 "kvc:prefix_cache_hit_rate", "kvc:time_to_first_token_seconds_bucket",
                 "kvc:time_per_output_token_seconds_bucket", "kvc:e2e_request_latency_seconds_bucket",
                 "kvc:prompt_tokens_total", "kvc:request_success_total"]:
        assert name in text, name
