"""Served methods vs NVIDIA kvpress 0.5.5, end to end (issue 4, acceptance 2, oracle 3).

The same tiny checkpoint directory is loaded by kvc's engine (`LLM(dir, method=..., method_params=
...)`) and by Hugging Face for kvpress. For each prompt: the tokens each KV head of each layer keeps
after prefill (the engine's `KeepPlan`, recorded by `tests/runtime/served.py`; kvpress's from its
pruned cache, `kvpress_runner.run_press`) must be the same, a different choice among near-ties of
kvpress's own scores aside; and the logits of the first decode step (the engine's first token fed
at position T over each side's compressed cache) must agree within 1e-4 relative, float32.

kvpress is configured to kvc's semantics:
- budgets: kvpress keeps int(T * (1 - ratio)) tokens; the ratio is chosen per prompt so that this
  is kvc's count (`ratio_keeping`), checked before use. These conversions live in
  kvc.runtime.eval.kvpress_reference, which runs kvc eval's cases through kvpress.
- StreamingLLM: `n_sink` = sink, kept = sink + recent. SnapKV: `window_size` = window,
  `kernel_size` = kernel (kvpress averages the window's votes where kvc sums them: the same
  ranking). TOVA: no parameter (both average the last query over all heads).
- PyramidKV: kvc's .kvm follows KVCache-Factory's integer schedule; kvpress computes the same
  linear shape in real numbers from c = T * (1 - ratio) and beta: bottom layer 2c - c / beta, top
  layer c / beta. With c = (bottom + top) / 2 and beta = c / top (a real number), taken from kvc's
  schedule, kvpress's rounded per-layer budgets are kvc's, as long as kvpress does not cap its
  bottom layer at T - window (prompts here are long enough); `get_layer_budget` is checked.
- H2O: kvpress has no H2O; its `ObservedAttentionPress` is H2O's prefill scoring (the prompt's
  attention received per key, GQA-averaged) divided by the number of queries that see each key,
  with no recent window. `ColumnSumPress` (kvc.runtime.eval.kvpress_reference) undoes the
  division and forces the last floor(recent * T) tokens, the rest of kvpress (attention,
  pruning, decoding) unchanged. It needs eager attention (it reads the attention matrix); the
  others run with sdpa.
- Ada-KV (`test_adakv_matches_kvpress`): `AdaKVPress(SnapKVPress(ratio, window_size=window,
  kernel_size=kernel), alpha_safeguard=a)`, sdpa (it refuses eager). kvc's `budget` is the average
  per KV head, window included, so the layer keeps Hkv * budget: kvpress's n_kept = budget
  (`ratio_keeping`), its pruned count Hkv * (T - n_kept). kvpress's safeguard counts the window
  first (max(1, int(a * n_kept)) per head, window scored above everything), kvc's `alpha` counts
  beyond the window (floor(alpha * (budget - window))): `adakv_params` converts. kvpress masks
  instead of evicting: its kept set is the complement of `masked_key_indices` (kvpress_runner),
  and at decode it replaces masked keys by keys whose attention underflows to zero.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.models.tiny import make_tiny_llama, make_tiny_qwen3
from tests.references.compare import assert_logits_close, assert_same_kept
from tests.references.eviction import ALWAYS, Ranking
from tests.references.kvpress_runner import capture_scores, run_press
from tests.references.scores import top_indices
from tests.runtime.served import ServedRequest, make_llm, serve

kvpress = pytest.importorskip(
    "kvpress", reason="kvpress (the test extra) is not installed; 0.5.5 needs transformers < 5.3"
)
# kvc eval's kvpress reference configures kvpress the same way: one piece of code serves both.
from kvc.runtime.eval.kvpress_reference import (  # noqa: E402
    ColumnSumPress,
    adakv_params,
    pyramid_press,
    ratio_keeping,
)
from kvpress.utils import compute_n_kept  # noqa: E402

LENGTHS = [53, 101, 211]
PAGE_SIZE, CHUNK = 7, 24
STEPS = 2


# method -> (kvc method_params, attention kvpress runs with, press for a prompt: (T, kvc's per-layer kept) -> press)
METHODS: dict[str, tuple[dict[str, Any], str, Any]] = {
    "streamingllm": ({"sink": 4, "recent": 20}, "sdpa",
                     lambda n, kept: kvpress.StreamingLLMPress(ratio_keeping(n, 24), n_sink=4)),
    "snapkv": ({"budget": 28, "window": 16, "kernel": 5}, "sdpa",
               lambda n, kept: kvpress.SnapKVPress(ratio_keeping(n, 28), window_size=16, kernel_size=5)),
    "pyramidkv": ({"budget": 24, "window": 8, "kernel": 5, "beta": 2}, "sdpa",
                  lambda n, kept: pyramid_press(kept, n, window=8, kernel=5)),
    "tova": ({"budget": 20}, "sdpa", lambda n, kept: kvpress.TOVAPress(ratio_keeping(n, 20))),
    "h2o": ({"heavy": 0.3, "recent": 0.1}, "eager",
            lambda n, kept: ColumnSumPress(ratio_keeping(n, math.floor(0.3 * n) + math.floor(0.1 * n)),
                                          recent=math.floor(0.1 * n))),
}


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


PROMPTS = prompts_of(LENGTHS, seed=31)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return make_tiny_llama(root, seed=1, num_hidden_layers=4, num_attention_heads=8)
    return make_tiny_qwen3(root, seed=2, num_hidden_layers=4)


_hf: dict[tuple[Path, str], PreTrainedModel] = {}


def hf_model(path: Path, attention: str) -> PreTrainedModel:
    if (path, attention) not in _hf:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
        _hf[path, attention] = model.eval()
    return _hf[path, attention]


def assert_kept_like_kvpress(served: ServedRequest, kept: list[list[torch.Tensor]],
                             scores: list[torch.Tensor], where: str) -> None:
    """Per layer, the engine's kept tokens are kvpress's, or as good by kvpress's scores."""
    assert len(kept) == len(served.kept) and len(scores) == len(kept), where
    for layer, (theirs, their_scores) in enumerate(zip(kept, scores)):
        ours = served.kept_heads(layer)
        if all(torch.equal(a, b) for a, b in zip(ours, theirs)) and len(ours) == len(theirs):
            continue
        count = len(theirs[0])
        assert_same_kept(Ranking(their_scores.float(), count), ours, where=f"{where} layer {layer}")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_served_method_matches_kvpress(model_dir: Path, method: str) -> None:
    params, attention, press_for = METHODS[method]
    llm = make_llm(model_dir, method, params, page_size=PAGE_SIZE, chunk=CHUNK)
    budget = llm.engine.method.budget
    layers = llm.engine.spec.num_layers
    model = hf_model(model_dir, attention)
    for served in serve(llm, PROMPTS, STEPS):
        length = len(served.prompt)
        where = f"{method}, {length}-token prompt"
        schedule = [budget.kept(length, layer) for layer in range(layers)]
        assert [len(served.kept[layer][0]) for layer in range(layers)] == schedule, where
        assert max(schedule) < length, f"{where}: the budget must compress"
        press = press_for(length, schedule)
        if method == "pyramidkv":  # the configuration above must give kvpress kvc's schedule
            modules = [layer.self_attn for layer in model.model.layers]
            assert [press.get_layer_budget(m, length) for m in modules] == schedule, where
        scores = capture_scores(press)
        kept, logits = run_press(model, press, torch.tensor(served.prompt), torch.tensor(served.tokens[:1]))
        assert_kept_like_kvpress(served, kept, scores, where)
        assert_logits_close(served.logits[1:], logits, where=where)


# name -> (budget per KV head incl. window, window, kernel, kvpress's alpha_safeguard)
ADAKV = {
    "safeguard-beyond-window": (24, 8, 5, 0.5),  # kvpress safeguard 12 > window 8: 4 more per head
    "window-covers-safeguard": (28, 16, 3, 0.2),  # safeguard 5 < window 16: the window is the floor
}


def adakv_ranking(scores: torch.Tensor, n_kept: int, alpha_safeguard: float) -> Ranking:
    """kvpress's Ada-KV decision as a ranking of its own scores [Hkv, T] (window already on top):
    each head's safeguard forced, then the best Hkv * n_kept of the layer."""
    n_safe = max(1, int(n_kept * alpha_safeguard))
    safe = top_indices(scores, n_safe)
    return Ranking(scores.float().scatter(1, safe, ALWAYS), scores.shape[0] * n_kept, across_heads=True)


@pytest.mark.parametrize("case", sorted(ADAKV))
def test_adakv_matches_kvpress(model_dir: Path, case: str) -> None:
    budget, window, kernel, alpha_safeguard = ADAKV[case]
    llm = make_llm(model_dir, "adakv", adakv_params(budget, window, kernel, alpha_safeguard),
                   page_size=PAGE_SIZE, chunk=CHUNK)
    heads, layers = llm.engine.spec.num_kv_heads, llm.engine.spec.num_layers
    model = hf_model(model_dir, "sdpa")
    ragged = 0
    for served in serve(llm, PROMPTS, STEPS):
        length = len(served.prompt)
        where = f"adakv {case}, {length}-token prompt"
        ratio = ratio_keeping(length, budget)
        assert budget < length, f"{where}: the budget must compress"
        inner = kvpress.SnapKVPress(ratio, window_size=window, kernel_size=kernel)
        press = kvpress.AdaKVPress(inner, alpha_safeguard=alpha_safeguard)
        scores = capture_scores(inner)
        kept, logits = run_press(model, press, torch.tensor(served.prompt), torch.tensor(served.tokens[:1]))
        assert len(kept) == layers and len(scores) == layers, where
        for layer in range(layers):
            ours, theirs = served.kept_heads(layer), kept[layer]
            # kvpress's own count: Hkv * n_kept survive per layer; kvc's total is the same
            assert sum(len(t) for t in theirs) == heads * compute_n_kept(length, ratio), where
            assert sum(len(t) for t in ours) == heads * budget, f"{where} layer {layer}"
            ragged += len({len(t) for t in ours}) > 1
            if len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs)):
                continue
            ranking = adakv_ranking(scores[layer], compute_n_kept(length, ratio), alpha_safeguard)
            assert_same_kept(ranking, ours, where=f"{where} layer {layer}")
        assert_logits_close(served.logits[1:], logits, where=where)
    assert ragged > 0, f"{case}: no layer kept unequal counts per head, Ada-KV is not exercised"
