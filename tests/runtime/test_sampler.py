"""The sampler: greedy, top-k/top-p cuts, seeds, and the distribution it draws from."""

from __future__ import annotations

import torch

from kvc.runtime.sampler import _filtered_probs, sample
from kvc.runtime.sampling_params import SamplingParams


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5, gen(0)).tokens
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = torch.randn(6, 40)
    params = [SamplingParams(temperature=1.7, top_k=1)] * 6
    assert sample(logits, params, [None] * 6, gen(3)).tokens.tolist() == logits.argmax(-1).tolist()


def test_top_k_and_top_p_cut_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = _filtered_probs(logits, top_k=[2], top_p=[1.0])
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = _filtered_probs(logits, top_k=[0], top_p=[0.8])  # 0.5 + 0.3 reaches 0.8: two tokens stay
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = _filtered_probs(logits, top_k=[0], top_p=[0.81])  # needs the third token too
    assert (p[0, :3] > 0).all() and p[0, 3] == 0
    p = _filtered_probs(logits, top_k=[0], top_p=[0.1])  # the top token always survives
    assert torch.allclose(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    params = [SamplingParams(temperature=1.0, seed=7)] + [SamplingParams(temperature=1.0)] * 3
    a = sample(logits, params, [gen(7), None, None, None], gen(1)).tokens
    b = sample(logits[:1], params[:1], [gen(7)], gen(99)).tokens
    assert a[0] == b[0]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))[None].repeat(20000, 1)
    params = [SamplingParams(temperature=1.0)] * 20000
    tokens = sample(logits, params, [None] * 20000, gen(5)).tokens
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.02)


def test_temperature_sharpens():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))[None].repeat(20000, 1)
    tokens = sample(logits, [SamplingParams(temperature=0.25)] * 20000, [None] * 20000, gen(5)).tokens
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    expected = torch.softmax(torch.log(torch.tensor([0.6, 0.3, 0.1])) / 0.25, -1)
    assert torch.allclose(freq, expected, atol=0.02)


# ---- what changes the logits, and logprobs: against hand-written references of the formulas ----
V = 50


class FakeSeq:
    """What TokenCounts reads of a sequence."""

    _ids = iter(range(10**6))

    def __init__(self, prompt, generated):
        self.seq_id = next(FakeSeq._ids)
        self.token_ids = list(prompt) + list(generated)
        self.num_prompt_tokens = len(prompt)

    @property
    def num_generated(self):
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self):
        return self.token_ids[self.num_prompt_tokens:]


def reference_processed(row, p, prompt, generated, stop_ids):
    """One row by the formulas, token by token: bias, min_tokens mask, repetition (over prompt and
    output: divide positive logits, multiply negative ones), frequency and presence (output only)."""
    out = row.clone()
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    if len(generated) < p.min_tokens:
        for t in stop_ids:
            out[t] = float("-inf")
    for t in range(len(out)):
        if t in prompt or t in generated:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = generated.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def history_of(params, prompts, outputs, stop_ids):
    from kvc.runtime.penalties import TokenCounts
    from kvc.runtime.sampler import RowHistory

    counts = TokenCounts(V, torch.device("cpu"))
    seqs = [FakeSeq(pr, out) for pr, out in zip(prompts, outputs)]
    pen = [i for i, p in enumerate(params) if p.has_penalties]
    history = RowHistory([len(o) for o in outputs], stop_ids, pen)
    if pen:
        slots = counts.rows([seqs[i] for i in pen])
        history.counts, history.prompt = counts.counts[slots], counts.prompt[slots]
    return history


def random_case(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 3
    prompts = [torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    outputs = [torch.randint(0, V, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    return logits, prompts, outputs


def test_bias_min_tokens_and_penalties_match_the_formulas():
    logits, prompts, outputs = random_case(0)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(temperature=0, presence_penalty=-1.0, frequency_penalty=-0.5, repetition_penalty=0.6),
        SamplingParams(temperature=0, logit_bias={3: 100.0, 4: -100.0, 9: 2.5}),
        SamplingParams(temperature=0, min_tokens=12, max_tokens=20, repetition_penalty=1.2, logit_bias={5: 1.0}),
        SamplingParams(temperature=0),
    ]
    stop_ids = [(), (), (), (), (5, 7, 11), ()]
    from kvc.runtime.sampler import _changed_logits

    got = _changed_logits(logits, params, history_of(params, prompts, outputs, stop_ids))
    for i, p in enumerate(params):
        ref = reference_processed(logits[i], p, prompts[i], outputs[i], stop_ids[i])
        assert torch.allclose(got[i], ref, atol=1e-5), f"row {i}"
    assert got[3].argmax() == 3 and got[4][5] == float("-inf") and got[4][7] == float("-inf")
    assert not torch.equal(got[0], logits[0]) and not torch.equal(got[1], logits[1])
    out = sample(logits, params, [None] * 6, gen(0), history_of(params, prompts, outputs, stop_ids))
    assert out.tokens.tolist() == got.argmax(-1).tolist()


def test_min_tokens_masks_only_until_reached():
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0  # EOS would win
    params = [SamplingParams(temperature=0, min_tokens=3)] * 2
    history = history_of(params, [[1], [1]], [[4, 4], [4, 4, 4]], [(2,), (2,)])
    assert sample(logits, params, [None] * 2, gen(0), history).tokens.tolist()[1] == 2
    assert sample(logits, params, [None] * 2, gen(0), history).tokens.tolist()[0] != 2


def test_min_p_cuts_below_the_scaled_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    from kvc.runtime.sampler import _filtered_logits

    kept = _filtered_logits(logits, [0], [1.0], [0.2]).isfinite()  # floor 0.1: the 0.08 token goes
    assert kept.tolist() == [[True, True, True, False]]
    params = [SamplingParams(temperature=1.0, min_p=0.5)] * 4000  # floor 0.25: two tokens stay
    tokens = sample(logits.repeat(4000, 1), params, [None] * 4000, gen(2)).tokens
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert freq[2] == freq[3] == 0
    assert torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.03)


def test_logprobs_are_log_softmax_of_the_processed_logits():
    logits, prompts, outputs = random_case(3, n=4)
    params = [
        SamplingParams(temperature=0, logprobs=5, frequency_penalty=0.9, logit_bias={1: 3.0}),
        SamplingParams(temperature=0.7, top_k=6, logprobs=20, seed=1),
        SamplingParams(temperature=1.3, min_p=0.05, top_p=0.9, logprobs=0, presence_penalty=0.4),
        SamplingParams(temperature=0.5),  # asks for nothing
    ]
    stop_ids = [()] * 4
    history = history_of(params, prompts, outputs, stop_ids)
    out = sample(logits, params, [None, gen(1), None, None], gen(4), history)
    assert out.logprob_rows == [0, 1, 2]
    from kvc.runtime.logprobs import to_host

    entries = to_host(out.logprobs.tensors(), [5, 20, 0])
    for row, entry in zip(out.logprob_rows, entries):
        p = params[row]
        processed = reference_processed(logits[row], p, prompts[row], outputs[row], stop_ids[row])
        if not p.greedy:
            processed = processed / p.temperature
            probs = torch.softmax(processed, -1)
            cut = probs < p.min_p * probs.max()
            order = processed.argsort(descending=True)
            if p.top_k > 0:
                cut[order[p.top_k:]] = True
            sorted_probs = torch.softmax(processed.masked_fill(cut, float("-inf")), -1)[order]
            cut[order[(sorted_probs.cumsum(0) - sorted_probs) >= p.top_p]] = True
            processed = processed.masked_fill(cut, float("-inf"))
        ref = torch.log_softmax(processed, -1)
        token = int(out.tokens[row])
        assert entry.token_id == token
        assert abs(entry.logprob - float(ref[token])) < 1e-5
        assert entry.rank == int((ref > ref[token]).sum()) + 1
        assert len(entry.top) == p.logprobs
        top = ref.topk(p.logprobs)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in entry.top]), top.values, atol=1e-5)
    assert entries[1].top[-1][1] == float("-inf")  # top-k 6 leaves 14 of the top 20 masked
    assert entries[0].rank == 1  # greedy takes the most likely token


def test_asking_for_logprobs_changes_no_token():
    logits = torch.randn(8, V)
    plain = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=5)] * 4
    asking = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.9, seed=5, logprobs=2)] * 4
    a = sample(logits, plain, [None, gen(5)] * 4, gen(1)).tokens
    b = sample(logits, asking, [None, gen(5)] * 4, gen(1)).tokens
    assert a.tolist() == b.tolist()


def test_invalid_params_name_the_field():
    import pytest

    from kvc.runtime.errors import InvalidSamplingParams

    for bad, field in [
        (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=1.5), "prompt_logprobs"), (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(min_p=1.5), "min_p"),
        (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
    ]:
        with pytest.raises(InvalidSamplingParams) as e:
            SamplingParams(**bad)
        assert e.value.param == field, bad
