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
