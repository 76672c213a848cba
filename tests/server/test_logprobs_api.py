"""Logprobs, echo and the sampling fields through the server and the official `openai` client:
OpenAI's shapes for chat (`logprobs.content[]`) and completions (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), streamed and not, equal to `LLM.generate`'s logprobs; `echo` with
`max_tokens: 0` (lm-eval's loglikelihood request); penalties, `logit_bias`, `min_tokens` and
`min_p` mapped onto the engine; `stop_reason`."""

from __future__ import annotations

import pytest
from openai import OpenAI

from kvc import SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _chat_ids(llm, messages):
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_completion_logprobs_equal_the_engines(client, llm):
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3))[0]
    r = client.completions.create(model="kvc-test", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids) == r.usage.completion_tokens
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for top, entry in zip(lp.top_logprobs, ref.logprobs):  # keyed by text: the best of each text, its own too
        best: dict[str, float] = {}
        for t, x in [*entry.top, (entry.token_id, entry.logprob)]:
            best.setdefault(llm.tokenizer.decode([t]), x)
        assert top == pytest.approx(best, abs=1e-5)
        assert max(top.values()) == pytest.approx(entry.logprob, abs=1e-5)  # greedy: its own is the top

    stream = client.completions.create(model="kvc-test", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                       stream=True, extra_body={"ignore_eos": True})
    tokens, logprobs, offsets = [], [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, offsets) == (lp.tokens, lp.text_offset)
    assert logprobs == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_echo_with_max_tokens_0_returns_the_prompts_logprobs(client, llm):
    """What lm-eval's local-completions sends for loglikelihood: token-id prompts, a batch."""
    prompts = [llm.encode(PROMPT), llm.encode("Hello, kvc")]
    refs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    r = client.completions.create(model="kvc-test", prompt=prompts, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == sum(len(p) for p in prompts)
    for choice, prompt, ref in zip(sorted(r.choices, key=lambda c: c.index), prompts, refs):
        lp = choice.logprobs
        assert choice.text == llm.tokenizer.decode(prompt) and choice.finish_reason == "length"
        assert len(lp.tokens) == len(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in ref.prompt_logprobs[1:]], abs=1e-5)
        for top, entry in zip(lp.top_logprobs[1:], ref.prompt_logprobs[1:]):
            assert max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-5)  # the top token is there
            assert len(top) in (1, 2)  # the top one, and the prompt's own when it is not the top

    # echo with generation: the prompt (with its logprobs) then the output (with its)
    r = client.completions.create(model="kvc-test", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0,
                                  temperature=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n = len(llm.encode(PROMPT))
    assert r.choices[0].text.startswith(PROMPT) and len(lp.tokens) == n + 3
    assert lp.token_logprobs[:n] == pytest.approx([None] + [e.logprob for e in refs[0].prompt_logprobs[1:]],
                                                  abs=1e-5)
    stream = client.completions.create(model="kvc-test", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                       stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == n


def test_max_tokens_0_without_echo_is_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="kvc-test", prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_chat_logprobs_shape_and_stream(client, llm):
    messages = [{"role": "user", "content": "Say hi"}]
    ref = llm.generate(_chat_ids(llm, messages), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                                logprobs=2))[0]
    r = client.chat.completions.create(model="kvc-test", messages=messages, max_completion_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == r.usage.completion_tokens
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    skipped = {t for t in ref.token_ids if llm.tokenizer.decode([t], skip_special_tokens=True) == ""}
    shown = b"".join(bytes(c.bytes) for c, t in zip(content, ref.token_ids) if t not in skipped)  # special tokens
    assert shown.decode(errors="replace") == r.choices[0].message.content
    for c, entry in zip(content, ref.logprobs):
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([x for _, x in entry.top], abs=1e-5)
        assert all(t.bytes is not None for t in c.top_logprobs)

    stream = client.chat.completions.create(model="kvc-test", messages=messages, max_completion_tokens=10,
                                            temperature=0, logprobs=True, top_logprobs=2, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [item for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [(c.token, c.bytes) for c in streamed] == [(c.token, c.bytes) for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)

    plain = client.chat.completions.create(model="kvc-test", messages=messages, max_completion_tokens=4)
    assert plain.choices[0].logprobs is None
    only = client.chat.completions.create(model="kvc-test", messages=messages, max_completion_tokens=4,
                                          logprobs=True, temperature=0)
    assert all(c.top_logprobs == [] for c in only.choices[0].logprobs.content)


def test_sampling_fields_map_onto_the_engine(client, llm):
    fields = dict(presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.5, min_tokens=5, min_p=0.02)
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, **fields))[0]
    r = client.completions.create(model="kvc-test", prompt=PROMPT, max_tokens=12, temperature=0,
                                  presence_penalty=1.2, frequency_penalty=0.6,
                                  extra_body={"repetition_penalty": 1.5, "min_tokens": 5, "min_p": 0.02,
                                              "return_token_ids": True})
    assert r.choices[0].token_ids == ref.token_ids
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    assert ref.token_ids != plain.token_ids  # the fields changed the output: the test can fail

    a = llm.encode("A")[0]
    r = client.completions.create(model="kvc-test", prompt=PROMPT, max_tokens=5, temperature=0,
                                  logit_bias={str(a): 100}, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == [a] * 5


def test_stop_reason_names_the_stop_token_or_string(client, llm):
    ids = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    r = client.completions.create(model="kvc-test", prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [ids[2]], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == ids[2]
    text = llm.decode(ids)
    stop = text[len(text) // 2:][:2]
    r = client.completions.create(model="kvc-test", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    r = client.chat.completions.create(model="kvc-test", messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["stop_reason"] is None


def test_overflowing_parameters_still_give_json_logprobs(server):
    """A repetition penalty or temperature near 0 overflows the logits; the response stays valid
    JSON (the fuzzer found a 500 here)."""
    import httpx

    for extra in ({"repetition_penalty": 1e-195}, {"temperature": 1e-300}):
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
            **extra})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert all(-9999.0 <= item["logprob"] <= 0.0 for item in content)
