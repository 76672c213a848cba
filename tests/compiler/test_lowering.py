"""The generated torch lowering keeps the same tokens as the hand-written references
(tests/references/eviction.py), per layer and KV head, on random GQA q/k of several lengths."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.references import eviction as ref

HEADS, KV_HEADS, DIM, LAYERS = 8, 2, 16, 4
LENGTHS = [37, 96, 181]


def _qk(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(HEADS, length, DIM, generator=g), torch.randn(KV_HEADS, length, DIM, generator=g)


def _lowering(name: str):
    return importlib.import_module(f"kvc.kernels_generated.{name}.torch_lowering")


def _same(ours, theirs):
    assert len(ours) == len(theirs) == KV_HEADS
    for head in range(KV_HEADS):
        assert torch.equal(ours[head], theirs[head]), f"kv head {head}: {ours[head]} != {theirs[head]}"


def _check(name, ref_name, ours_params, ref_params, length, seed, layer=0):
    q, k = _qk(length, seed)
    ours = _lowering(name).keep(q, k, layer=layer, num_layers=LAYERS, params=ours_params)
    theirs = ref.select(ref_name, q, k, layer=layer, num_layers=LAYERS, **ref_params)
    _same(ours, theirs)


@pytest.mark.parametrize("length", LENGTHS)
def test_streamingllm(length):
    _check("streamingllm", "streamingllm", {"sink": 4, "recent": 28}, {"budget": 32, "n_sink": 4}, length, 1)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv(length, pooling):
    _check("snapkv", "snapkv", {"budget": 24, "window": 8, "kernel": 5, "pooling": pooling},
           {"budget": 24, "window": 8, "kernel": 5, "pool": pooling}, length, 2)


@pytest.mark.parametrize("length", [37, 96])
def test_pyramidkv_layers(length):
    """Each layer keeps SnapKV's choice at the budget of the compiled schedule (KVCache-Factory's)."""
    from kvc.compiler import budgets, ir
    from kvc.dsl import load_method

    params = {"budget": 20, "window": 4, "kernel": 3, "pooling": "avg", "beta": 2}
    kept = budgets.lambdify(budgets.derive(ir.build(load_method("pyramidkv"))))
    for layer in range(LAYERS):
        budget = kept(length, layer, LAYERS, KV_HEADS, params)
        _check("pyramidkv", "snapkv", params, {"budget": budget, "window": 4, "kernel": 3, "pool": "avg"},
               length, 3 + layer, layer=layer)


@pytest.mark.parametrize("length", LENGTHS)
def test_h2o(length):
    heavy, recent = 0.2, 0.1
    _check("h2o", "h2o", {"heavy": heavy, "recent": recent},
           {"budget": int(heavy * length) + int(recent * length), "recent": int(recent * length)}, length, 4)


@pytest.mark.parametrize("length", LENGTHS)
def test_tova(length):
    _check("tova", "tova", {"budget": 20}, {"budget": 20}, length, 5)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("alpha_ref", [0.2, 0.5])
def test_adakv(length, alpha_ref):
    """kvc's at_least counts outside the window; kvpress's safeguard counts window tokens first."""
    budget, window = 24, 4
    extra = max(0, max(1, int(alpha_ref * budget)) - window)
    alpha = (extra + 0.5) / (budget - window)
    _check("adakv", "adakv", {"budget": budget, "window": window, "kernel": 5, "alpha": alpha},
           {"budget": budget, "window": window, "kernel": 5, "pool": "avg", "alpha": alpha_ref}, length, 6)


def test_short_prompts_keep_everything():
    q, k = _qk(10, 7)
    for name in ("snapkv", "tova", "adakv", "streamingllm", "full"):  # h2o keeps fractions of the prompt
        kept = _lowering(name).keep(q, k, params={"window": 4} if name in ("snapkv", "adakv") else None)
        _same(kept, [torch.arange(10)] * KV_HEADS)


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_pool_over_no_keys(pooling):
    """A prompt no longer than SnapKV's window leaves no key to pool (the served request crashed)."""
    from kvc.runtime.primitives.torch_primitives import pool

    empty = torch.zeros(2, 0)
    assert pool(empty, pooling, 5, 1).shape == (2, 0)
    module = importlib.import_module("kvc.kernels_generated.snapkv.torch_lowering")
    q, k = torch.randn(4, 3, 8), torch.randn(2, 3, 8)  # 3 tokens, window 8
    sym = {"context": 3, "prompt": 3, "step": 0, "layer": 0, "layers": 1, "heads": 4, "kv_heads": 2, "head_dim": 8}
    params = {"budget": 24, "window": 8, "kernel": 5, "pooling": pooling}
    scores = module.prefill_end_scores({"q": q, "k": k, "v": None}, {}, sym, params)
    kept = module.prefill_end_select(scores, sym, params)
    assert [t.tolist() for t in kept] == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("xdims,ydims,to", [
    (("row", "head", "channel"), ("row", "kv_head", "clusters", "channel"), ("row", "head", "clusters")),
    (("row", "kv_head", "clusters", "channel"), ("row", "head", "channel"), ("row", "clusters", "head")),
    (("head", "query", "channel"), ("head", "key", "channel"), ("head", "key")),
    (("key", "channel"), ("channel", "page"), ("page", "query", "key")),
])
def test_contract_is_the_sum_of_the_aligned_product(xdims, ydims, to):
    """`_contract` (the lowering of `sum(a * b, over ...)`) equals the product laid out by `_align` and
    summed: every axis order, KV heads meeting query heads as their groups, an axis neither operand has."""
    from kvc.runtime.primitives.torch_primitives import align, contract, reduce

    g = torch.Generator().manual_seed(0)
    sizes = {"row": 3, "head": 8, "kv_head": 2, "channel": 5, "clusters": 7, "query": 2, "key": 6, "page": 4}
    x = torch.randn(*(sizes[d] for d in xdims), generator=g)
    y = torch.randn(*(sizes[d] for d in ydims), generator=g, dtype=torch.float64)
    full = tuple(dict.fromkeys(["head" if d == "kv_head" else d for d in (*to, *xdims, *ydims)]))
    product = align(x, xdims, full, sizes["head"]) * align(y, ydims, full, sizes["head"])
    summed = [i for i, d in enumerate(full) if d not in to]
    want = align(reduce(product, "sum", tuple(summed)), tuple(d for d in full if d in to), to)
    got = contract(x, xdims, y, ydims, to)
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got, want)
