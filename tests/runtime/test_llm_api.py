"""The Python API on the embedded default model: prompts as text or ids, sampling options, stops,
abort, and clear errors for bad input."""

from __future__ import annotations

import pytest

from kvc import LLM, SamplingParams
from kvc.runtime.errors import ConfigError, InvalidPromptError, InvalidSamplingParams, PromptTooLongError


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_model_len=512)


def test_text_and_token_prompts(llm):
    ids = llm.tokenizer.encode("hello world", add_special_tokens=False)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a, b = llm.generate(["hello world", ids], greedy)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    assert a.prompt_token_ids == ids
    assert a.text == llm.tokenizer.decode(a.token_ids, skip_special_tokens=True)
    assert a.finish_reason == "length"


def test_seed_reproducible_and_batch_independent(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate(["the seed"], p)[0].token_ids
    crowd = llm.generate(["other", "the seed", "more prompts here"],
                         [SamplingParams(max_tokens=5), p, SamplingParams(max_tokens=9)])
    assert crowd[1].token_ids == alone
    other = llm.generate(["the seed"], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))
    assert other[0].token_ids != alone


def test_stop_token_ids_and_max_tokens(llm):
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = llm.generate(["stop here"], greedy)[0].token_ids
    stop_at = full[5]
    first = full.index(stop_at)
    out = llm.generate(["stop here"], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.spec.eos_token_ids[0]
    full = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].token_ids
    forced = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[])
    # make EOS the argmax of the first step by biasing its logit through a tiny patch of the head
    head = llm.engine.model.compute_logits

    def biased(hidden, out=None):
        logits = head(hidden, out=out)
        logits[:, eos] += 1e4
        return logits

    llm.engine.model.compute_logits = biased
    try:
        out = llm.generate([[5, 6, 7]], forced)[0]
        ignored = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    finally:
        del llm.engine.model.compute_logits
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    assert ignored.token_ids == [eos] * 3
    assert len(full) == 30


def test_pages_free_after_generate_and_abort(llm):
    eng = llm.engine
    seq = eng.add_request(list(range(10, 200)), SamplingParams(max_tokens=50))
    for _ in range(3):
        eng.step()
    assert eng.pool.num_used > 0
    eng.abort(seq.seq_id)
    assert seq.finish_reason == "abort"
    assert eng.pool.num_used == 0 and eng.pool.num_free == eng.num_pages
    assert not eng.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_sampling_params(kwargs, param):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_prompt_too_long(llm):
    with pytest.raises(PromptTooLongError, match="512"):
        llm.generate([[1] * 512], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished()


def test_bad_prompts_and_options(llm):
    with pytest.raises(InvalidPromptError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(InvalidPromptError, match="token ids"):
        llm.generate([[10**9]], SamplingParams())
    with pytest.raises(InvalidPromptError, match="string or a list"):
        llm.generate([3.5], SamplingParams())
    with pytest.raises(ConfigError, match="unknown method"):
        LLM(method="nope", device="cpu")
    with pytest.raises(ConfigError, match="page_size"):
        LLM(device="cpu", page_size=0)
    with pytest.raises(ConfigError, match="dtype"):
        LLM(device="cpu", dtype="int3")
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(device="cpu", max_model_len=10**7)


def test_cli_generate_and_errors(capsys):
    from kvc.runtime.cli import main

    assert main(["generate", "--prompt", "hi", "--max-tokens", "4", "--json", "--max-model-len", "256"]) == 0
    assert '"token_ids"' in capsys.readouterr().out
    assert main(["generate", "--model", "/no/such/dir"]) == 1
    err = capsys.readouterr().err
    assert "kvc: error:" in err and "/no/such/dir" in err and "Traceback" not in err
    assert main(["generate", "--top-p", "2"]) == 1
    assert "top_p" in capsys.readouterr().err
