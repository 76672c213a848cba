"""R-KV's generated step_end (methods/rkv.kvm through compiler/lower_torch.py) keeps the tokens of the
hand-written reference (tests/references/rkv.py), per KV head, on random GQA queries and keys and on keys made to
tie; and the `redundancy` primitive follows the published rule for a key's newest near-copy."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvc.runtime.compiled.decode import decode_sym
from tests.references import rkv as ref

HEADS, KV_HEADS, DIM = 8, 2, 16
PARAMS = {"budget": 24, "window": 4, "kernel": 5, "mix": 0.07, "threshold": 0.5, "every": 8}


def _lowering():
    return importlib.import_module("kvc.kernels_generated.rkv.torch_lowering")


def _kept(q: torch.Tensor, k: torch.Tensor, params: dict, step: int) -> list[torch.Tensor]:
    code, n = _lowering(), k.shape[1]
    sym = decode_sym(0, 4, n, 100 + step, 100, HEADS, KV_HEADS, DIM)
    scores = code.step_end_scores({"q": q, "k": k}, {}, sym, params)
    return code.step_end_select(scores, sym, params)


def _same(ours: list[torch.Tensor], theirs: torch.Tensor) -> None:
    assert len(ours) == KV_HEADS
    for head in range(KV_HEADS):
        assert torch.equal(ours[head], theirs[head]), f"kv head {head}: {ours[head]} != {theirs[head]}"


def _reference(q, k, params):
    return ref.keep(q, k, budget=params["budget"], window=params["window"], kernel=params["kernel"],
                    mix=params["mix"], threshold=params["threshold"])


@pytest.mark.parametrize("length", [24, 25, 57, 130])
@pytest.mark.parametrize("seed", [0, 1])
def test_step_end_keeps_the_references_tokens(length: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(HEADS, 6, DIM, generator=g)  # more queries than the window: the lowering takes the last 4
    k = torch.randn(KV_HEADS, length, DIM, generator=g)
    k[:, 5] = k[:, 3] * 2  # near-copies (cosine 1) and their newest one
    k[:, 9] = k[:, 3]
    _same(_kept(q, k, PARAMS, 8), _reference(q, k, PARAMS))


@pytest.mark.parametrize("mix", [0.0, 0.07, 1.0])
def test_the_mix_weighs_importance_against_redundancy(mix: float) -> None:
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(HEADS, 4, DIM, generator=g), torch.randn(KV_HEADS, 70, DIM, generator=g)
    params = PARAMS | {"mix": mix}
    _same(_kept(q, k, params, 16), _reference(q, k, params))


def test_tied_scores_keep_the_older_keys() -> None:
    """Every key the same vector: equal importance and (but for the newest keys, every row's near-copy) equal
    redundancy, so the older of tied keys stay, exactly as the reference's tie rule."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(HEADS, 4, DIM, generator=g)
    k = torch.randn(KV_HEADS, 1, DIM, generator=g).expand(KV_HEADS, 40, DIM).clone()
    ours = _kept(q, k, PARAMS, 8)
    _same(ours, _reference(q, k, PARAMS))
    assert ours[0][:5].tolist() == [0, 1, 2, 3, 4]


def test_between_compressions_every_token_stays() -> None:
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(HEADS, 4, DIM, generator=g), torch.randn(KV_HEADS, 50, DIM, generator=g)
    for head in _kept(q, k, PARAMS, 7):  # step 7 of `every` 8
        assert torch.equal(head, torch.arange(50))


def test_redundancy_skips_each_keys_newest_near_copy() -> None:
    from kvc.runtime.primitives.torch_primitives import redundancy

    a, b, c = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.1])
    keys = torch.stack([a, b, a, c, b])  # key 0's near-copies: 2 and 3 (newest 3); key 1's: 4
    sim = torch.nn.functional.cosine_similarity(keys[:, None], keys[None], dim=-1).double()
    sim.fill_diagonal_(0.0)
    for i, j in {0: 3, 1: 4, 2: 3, 3: 2, 4: 1}.items():
        sim[i, j] = 0.0
    want = sim.mean(dim=0).softmax(dim=0)
    got = redundancy(keys[None], 0.5, 1, 2)[0]
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.double(), ref.redundancy(keys[None], 0.5)[0], atol=1e-6, rtol=0)


def test_redundancy_without_a_near_copy_zeroes_the_oldest_column() -> None:
    """The published rule's index of 0 when no key passes the threshold: that row's similarity to key 0 is not
    counted either (kept here so that kvc's scores are the paper code's)."""
    from kvc.runtime.primitives.torch_primitives import redundancy

    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.2]])
    sim = torch.nn.functional.cosine_similarity(keys[:, None], keys[None], dim=-1).double()
    sim.fill_diagonal_(0.0)
    sim[:, 0] = 0.0  # no row has a near-copy at 0.5
    torch.testing.assert_close(redundancy(keys[None], 0.5, 1, 2)[0].double(), sim.mean(dim=0).softmax(dim=0),
                               atol=1e-6, rtol=0)
