"""Every served eviction method takes `budget`: the tokens it keeps per KV head (on average) after
prefill, the one knob `kvc eval --budgets` and users turn. StreamingLLM's and H2O's budgets are the
same algorithm as their native parameters (sink + recent; heavy and recent fractions), served
token for token; every method's compiled bound keeps what `budget` says."""

from __future__ import annotations

import math

import pytest
import torch

from kvc.runtime.methods import resolve_method
from tests.models.tiny import make_tiny_llama
from tests.runtime.served import make_llm, serve

BUDGET = 24
LENGTHS = [61, 97]
BUDGETED = ("adakv", "h2o", "pyramidkv", "snapkv", "streamingllm", "tova")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"), seed=5, num_hidden_layers=3)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.mark.parametrize("method", BUDGETED)
def test_budget_is_the_kept_count(method: str) -> None:
    m = resolve_method(method, {"budget": BUDGET, **({"window": 8} if method in ("snapkv", "pyramidkv", "adakv")
                                                     else {})})
    m.bind(4, 2)
    kept = [m.budget.kept(200, layer) for layer in range(4)]
    if method == "pyramidkv":  # a schedule around the budget: the average is the budget
        assert kept[0] > kept[-1] and sum(kept) == pytest.approx(BUDGET * 4, abs=4)
    elif method == "adakv":  # the most-keeping head's bound, at least the average
        assert min(kept) >= BUDGET
    else:
        assert kept == [BUDGET] * 4, method


@pytest.mark.parametrize(("method", "native"), [
    ("streamingllm", lambda n: {"sink": 4, "recent": BUDGET - 4}),
    ("h2o", lambda n: {"heavy": (BUDGET // 2 + 0.5) / n, "recent": (BUDGET - BUDGET // 2 + 0.5) / n}),
])
def test_budget_serves_like_the_native_parameters(model_dir, method: str, native) -> None:
    for prompt in prompts():
        n = len(prompt)
        if method == "h2o":  # the fractions floor to the budget's halves at this length
            p = native(n)
            assert (math.floor(p["heavy"] * n), math.floor(p["recent"] * n)) == (BUDGET // 2, BUDGET - BUDGET // 2)
        by_budget = serve(make_llm(model_dir, method, {"budget": BUDGET}, page_size=8, chunk=None), [prompt], 6)[0]
        by_native = serve(make_llm(model_dir, method, native(n), page_size=8, chunk=None), [prompt], 6)[0]
        assert by_budget.tokens == by_native.tokens, (method, n)
        for layer in range(3):
            assert [k.tolist() for k in by_budget.kept[layer]] == [k.tolist() for k in by_native.kept[layer]]
            assert all(len(k) == BUDGET for k in by_budget.kept[layer])
