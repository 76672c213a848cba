"""Logprobs through the engine: prompt logprobs equal a Hugging Face forward's log-probs (any
prefill chunk size, batched, with prefix caching on), generated tokens' logprobs equal the
log-probs of a Hugging Face forward over prompt + output (greedy), asking for logprobs changes no
token, penalties / min_tokens / logprobs give the same tokens and logprobs with async scheduling
as without, and `stop_reason` names the stop token that ended a request.
"""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from kvc.runtime.errors import InvalidSamplingParams
from tests.models.tiny import make_tiny_qwen3

LENGTHS = [1, 9, 40, 77]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def make_llm(model_dir, **options):
    opts = dict(device="cpu", dtype="float32", page_size=8, max_num_batched_tokens=64, attention_backend="torch")
    return LLM(str(model_dir), **{**opts, **options})


def prompts(seed=3, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def hf_logprobs(hf, ids):
    """[len(ids), V]: row p is the log-distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("chunk", [5, 32, None])
def test_prompt_logprobs_equal_hugging_face(model_dir, hf, chunk):
    llm = make_llm(model_dir, max_prefill_chunk=chunk)
    ps = prompts()
    outs = llm.generate(ps, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, ignore_eos=True))
    for p, out in zip(ps, outs):
        ref = hf_logprobs(hf, p)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        for t in range(1, len(p)):
            entry = out.prompt_logprobs[t]
            assert entry.token_id == p[t]
            assert abs(entry.logprob - float(ref[t - 1, p[t]])) < 1e-4, (len(p), t)
            assert entry.rank == int((ref[t - 1] > ref[t - 1, p[t]]).sum()) + 1
            assert [i for i, _ in entry.top] == ref[t - 1].topk(3).indices.tolist()
        assert out.logprobs is None


def test_prompt_logprobs_skip_no_position_on_a_prefix_hit(model_dir, hf):
    llm = make_llm(model_dir, max_prefill_chunk=16)
    shared = prompts(lengths=[40])[0]
    first, second = shared + [5, 6, 7], shared + [8, 9]
    llm.generate(first, SamplingParams(max_tokens=1, temperature=0))
    plain = llm.generate(second, SamplingParams(max_tokens=1, temperature=0))[0]
    assert plain.num_cached_tokens > 0  # the prefix cache would serve these positions ...
    asking = llm.generate(second, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert asking.num_cached_tokens == 0  # ... but a request owed prompt logprobs computes them all
    ref = hf_logprobs(hf, second)
    got = torch.tensor([e.logprob for e in asking.prompt_logprobs[1:]])
    assert torch.allclose(got, ref[:-1].gather(1, torch.tensor(second[1:])[:, None])[:, 0], atol=1e-4)


def test_generated_logprobs_equal_hugging_face_and_change_no_token(model_dir, hf):
    llm = make_llm(model_dir, max_prefill_chunk=32)
    ps = prompts(seed=4)
    plain = llm.generate(ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    asking = llm.generate(ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=4))
    for p, a, b in zip(ps, plain, asking):
        assert a.token_ids == b.token_ids
        assert [e.token_id for e in b.logprobs] == b.token_ids
        ref = hf_logprobs(hf, p + b.token_ids)
        for j, entry in enumerate(b.logprobs):
            row = ref[len(p) - 1 + j]
            assert abs(entry.logprob - float(row[entry.token_id])) < 1e-4
            assert entry.rank == 1 and entry.top[0][0] == entry.token_id
            assert torch.allclose(torch.tensor([lp for _, lp in entry.top]), row.topk(4).values, atol=1e-4)


def work():
    return [
        (prompts(seed=5)[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.8,
                                            logprobs=2)),
        (prompts(seed=5)[2], SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True,
                                            presence_penalty=1.0, frequency_penalty=0.8, logprobs=0)),
        (prompts(seed=5)[3], SamplingParams(max_tokens=18, temperature=0, min_tokens=10, logit_bias={7: 4.0},
                                            logprobs=1)),
        (prompts(seed=5)[0], SamplingParams(max_tokens=22, temperature=0, ignore_eos=True)),  # asks for nothing
    ]


def run(llm):
    w = work()
    return llm.generate([p for p, _ in w], [sp for _, sp in w])


def test_async_scheduling_gives_the_same_tokens_and_logprobs(model_dir):
    plain = run(make_llm(model_dir, async_scheduling=False))
    llm = make_llm(model_dir, async_scheduling=True)
    built = []
    inner = llm.engine.scheduler.schedule_ahead
    llm.engine.scheduler.schedule_ahead = lambda batch: built.append(inner(batch)) or built[-1]
    ahead = run(llm)
    assert sum(b is not None for b in built) >= 8, "steps were not scheduled ahead: the test lost its point"
    for a, b in zip(plain, ahead):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == b.logprobs
    # the penalties really acted: without them the same greedy request repeats itself more
    no_penalty = make_llm(model_dir).generate(work()[0][0], SamplingParams(max_tokens=20, temperature=0,
                                                                          ignore_eos=True))[0]
    assert len(set(plain[0].token_ids)) > len(set(no_penalty.token_ids))


def test_min_tokens_holds_back_eos(model_dir):
    llm = make_llm(model_dir)
    p = prompts(seed=6, lengths=[12])[0]
    first = llm.generate(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].token_ids
    stop = first[2]  # a token greedy decoding emits third: a stop token there ends the request early
    early = llm.generate(p, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop]))[0]
    assert early.stop_reason == stop and early.finish_reason == "stop" and len(early.token_ids) <= 3
    held = llm.generate(p, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop], min_tokens=8))[0]
    assert stop not in held.token_ids[:8] and len(held.token_ids) > 8
    plain = llm.generate(p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert plain.stop_reason is None and plain.finish_reason == "length"


def test_requests_the_engine_cannot_serve_are_refused(model_dir):
    llm = make_llm(model_dir)
    with pytest.raises(InvalidSamplingParams) as e:
        llm.generate([5, 6], SamplingParams(logit_bias={10**6: 1.0}))
    assert e.value.param == "logit_bias"
