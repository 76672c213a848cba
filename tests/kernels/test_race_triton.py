"""The fused exponential race (runtime/primitives/race_triton.py): temperature-0 rows equal torch's argmax
bit for bit (ties to the first maximum, a row of -inf, a vocabulary over several chunks, strided bf16 rows);
sampled rows follow softmax(logits / T) by a chi-square test; a seed and a row give one draw; and the
sampler takes the kernel only where its batch allows. Under TRITON_INTERPRET=1 without a GPU
(tests/conftest.py sets it)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from kvc.runtime.primitives import race_triton  # noqa: E402
from kvc.runtime.sampler import sample  # noqa: E402
from kvc.runtime.sampling_params import SamplingParams  # noqa: E402


def test_temperature_zero_rows_are_torch_argmax():
    g = torch.Generator().manual_seed(0)
    vocab = 2 * race_triton.CHUNK + 37  # three chunks, the last one partial
    logits = torch.randn(6, vocab, generator=g) * 4
    logits[1, 5000] = logits[1].max() + 1  # a maximum in the second chunk
    logits[2] = 1.5  # all tied: the first token
    logits[3] = float("-inf")  # all masked: token 0, as argmax says
    logits[4, [7, 4100, 8200]] = 50.0  # a tie across chunks: the first one
    logits[5, -1] = 60.0  # the last token of the partial chunk
    inv = torch.zeros(6)
    got = race_triton.race(logits.to(DEVICE), inv.to(DEVICE), seed=11).cpu()
    assert got.tolist() == logits.argmax(-1).tolist() == [got[0].item(), 5000, 0, 0, 7, vocab - 1]


def test_bf16_rows_through_a_strided_view():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 3000, generator=g).to(torch.bfloat16)
    logits = wide[:, :2500]  # row stride 3000
    got = race_triton.race(logits.to(DEVICE), torch.zeros(4, device=DEVICE), seed=3).cpu()
    assert got.tolist() == logits.float().argmax(-1).tolist()


def test_sampled_rows_follow_the_tempered_softmax():
    rows, temperature = 1500, 2.0
    p = torch.tensor([0.1, 0.2, 0.3, 0.05, 0.25, 0.1], dtype=torch.float64)
    logits = (p.log() * temperature).float()[None].repeat(2 * rows, 1)  # softmax(logits / T) = p
    inv = torch.tensor([1 / temperature] * rows + [1.0] * rows)  # the second half at T = 1: p squared, renormalised
    got = race_triton.race(logits.to(DEVICE), inv.to(DEVICE), seed=5).cpu()
    for law, drawn in ((p, got[:rows]), (p ** 2 / (p ** 2).sum(), got[rows:])):
        counts = torch.bincount(drawn, minlength=6).double()
        chi2 = ((counts - law * rows) ** 2 / (law * rows)).sum().item()
        assert chi2 < 25.0, (counts, law * rows)  # 5 degrees of freedom: p < 1.4e-4 by chance (a fixed seed)


def test_a_seed_and_a_row_give_one_draw():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 300, generator=g).to(DEVICE)
    inv = torch.ones(64, device=DEVICE)
    a = race_triton.race(logits, inv, seed=9)
    assert torch.equal(a, race_triton.race(logits, inv, seed=9))
    b = race_triton.race(logits, inv, seed=10)
    assert (a != b).sum() > 32  # another key: other draws for most rows
    same = logits[:1].repeat(64, 1)  # one row's logits 64 times: the rows draw independently
    assert len(set(race_triton.race(same, inv, seed=9).tolist())) > 16


def test_sampler_takes_the_race_only_where_the_batch_allows(monkeypatch):
    calls = []
    real = race_triton.race
    monkeypatch.setattr(race_triton, "race", lambda *a, **k: calls.append(a) or real(*a, **k))
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 50, generator=g).to(DEVICE)
    race_gen = torch.Generator().manual_seed(0)
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), SamplingParams()]
    out = sample(logits, mixed, [None] * 3, None, race_generator=race_gen)
    assert len(calls) == 1 and out.tokens.shape == (3,) and out.tokens[0].item() == logits[0].argmax().item()
    for params, generators in (
        ([SamplingParams(temperature=0.0)] * 3, [None] * 3),  # all greedy: argmax alone
        ([SamplingParams(top_k=1)] * 3, [None] * 3),  # a filter
        ([SamplingParams(top_p=0.9)] * 3, [None] * 3),
        ([SamplingParams(min_p=0.1)] * 3, [None] * 3),
        ([SamplingParams(logprobs=2)] * 3, [None] * 3),  # logprobs
        ([SamplingParams(seed=1)] * 3, [torch.Generator(device=DEVICE).manual_seed(1)] * 3),  # a seed of its own
    ):
        sample(logits, params, generators, torch.Generator(device=DEVICE).manual_seed(0), race_generator=race_gen)
    assert len(calls) == 1
    # a seeded request's tokens are the torch path's whether or not the runner offers the race
    seeded = [SamplingParams(seed=7)] * 3
    a = sample(logits, seeded, [torch.Generator(device=DEVICE).manual_seed(7) for _ in range(3)], None,
               race_generator=race_gen).tokens
    b = sample(logits, seeded, [torch.Generator(device=DEVICE).manual_seed(7) for _ in range(3)], None).tokens
    assert torch.equal(a, b)


def test_the_kernels_compile_for_sm90():
    from tests.kernels.sm90 import code_compiles_for_sm90

    code_compiles_for_sm90("""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvc.runtime.primitives import race_triton as r
types = {"logits_ptr": "*fp32", "inv_temp_ptr": "*fp32", "best_ptr": "*i64", "out_ptr": "*i64", "stride_row": "i64",
         "vocab": "i32", "chunks": "i32", "seed": "i64"}
for fn, consts in ((r._race_kernel, {"BLOCK": r.CHUNK, "PDL": True}), (r._pick_kernel, {"BLOCK_C": 64, "PDL": True})):
    sig = {n: ("constexpr" if fn.params[i].is_constexpr else types[n]) for i, n in enumerate(fn.arg_names)}
    c = {(i,): consts[n] for i, n in enumerate(fn.arg_names) if fn.params[i].is_constexpr}
    k = triton.compile(ASTSource(fn, sig, constexprs=c), target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert ".entry " + fn.__name__ in k.asm["ptx"]
print("race kernels compiled for sm90")
""")
