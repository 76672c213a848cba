"""The hand-written references against NVIDIA kvpress 0.5.5 (oracle 3), on tiny Llama and Qwen3.

kvpress is configured to the references' semantics, and the references to kvpress's defaults:
- budget: kvpress takes `compression_ratio` r and keeps n = max(1, int(T * (1 - r))) tokens per
  KV head (its `compute_n_kept`); the references get `budget=n`. PyramidKV's average budget is
  the unrounded T * (1 - r), as kvpress computes its schedule from it.
- SnapKV / PyramidKV / Ada-KV: `window_size` = `window` (kvpress default 64), `kernel_size` =
  `kernel` (default 5); kvpress only average-pools, so `pool="avg"`. PyramidKV `beta` = `beta`
  (default 20). Ada-KV wraps `SnapKVPress`; `alpha_safeguard` = `alpha` (default 0.2).
- StreamingLLM `n_sink` = `n_sink` (default 4). TOVA has no parameter; both average the last
  query's attention over all heads of the layer. H2O: kvpress has no recent window and averages
  instead of summing received attention, so its `ObservedAttentionPress` is compared with
  `observed_attention` (same `accumulated_attention`, normalized), and the raw scores are checked
  to be H2O's column sums divided by the number of queries that see each key.
- Attention: `AdaKVPress` refuses eager attention, and `ObservedAttentionPress` needs it (it reads
  the attention matrix); the others run both ways — with eager they read the attention matrix,
  with sdpa they recompute the window's queries themselves — except PyramidKV: with layers of
  different cache lengths only sdpa decodes (eager sizes its mask by layer 0's cache).
Prompts are random token ids; the continuation is 3 tokens decoded at positions T, T+1, T+2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.references.compare import assert_logits_close, assert_same_kept
from tests.references.conftest import ARCHS
from tests.references.eviction import DEFAULTS
from tests.references.kvpress_runner import capture_scores, run_press
from tests.references.model_forward import prefill, run_compressed
from tests.references.scores import accumulated_attention, last_query_attention, snapkv_scores

kvpress = pytest.importorskip(
    "kvpress", reason="kvpress (the test extra) is not installed; 0.5.5 needs transformers < 5.3"
)
from kvpress.utils import compute_n_kept  # noqa: E402


def press_for(method: str, ratio: float, params: dict[str, Any]) -> Any:
    """The kvpress press configured to a reference method's semantics and parameters."""
    p = {**DEFAULTS[method], **params}
    if method == "streamingllm":
        return kvpress.StreamingLLMPress(ratio, n_sink=p["n_sink"])
    if method == "tova":
        return kvpress.TOVAPress(ratio)
    if method == "observed_attention":
        return kvpress.ObservedAttentionPress(ratio)
    assert p["pool"] == "avg", "kvpress only average-pools"
    window = {"window_size": p["window"], "kernel_size": p["kernel"]}
    if method == "snapkv":
        return kvpress.SnapKVPress(ratio, **window)
    if method == "pyramidkv":
        return kvpress.PyramidKVPress(ratio, **window, beta=p["beta"])
    if method == "adakv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(ratio, **window), alpha_safeguard=p["alpha"])
    raise ValueError(method)


# name: (method, reference params, prompt length T, compression ratio, attention implementation)
CASES: dict[str, tuple[str, dict[str, Any], int, float, str]] = {
    "streamingllm-short": ("streamingllm", {}, 41, 0.5, "sdpa"),
    "streamingllm-sink2": ("streamingllm", {"n_sink": 2}, 130, 0.75, "eager"),
    "snapkv-w16": ("snapkv", {"window": 16}, 41, 0.5, "sdpa"),
    "snapkv-w8-k3-eager": ("snapkv", {"window": 8, "kernel": 3}, 97, 0.7, "eager"),
    "snapkv-defaults": ("snapkv", {}, 150, 0.5, "sdpa"),
    "pyramidkv-beta2": ("pyramidkv", {"window": 16, "beta": 2}, 150, 0.5, "sdpa"),
    "pyramidkv-beta20": ("pyramidkv", {"window": 4}, 200, 0.5, "sdpa"),
    "pyramidkv-capped": ("pyramidkv", {"window": 16, "beta": 2}, 100, 0.25, "sdpa"),
    "pyramidkv-fallback": ("pyramidkv", {"window": 8}, 61, 0.6, "sdpa"),
    "tova-short": ("tova", {}, 41, 0.5, "sdpa"),
    "tova-long-eager": ("tova", {}, 129, 0.8, "eager"),
    "observed-attention": ("observed_attention", {}, 77, 0.6, "eager"),
    "adakv-w8": ("adakv", {"window": 8}, 41, 0.5, "sdpa"),
    "adakv-safeguard-beyond-window": ("adakv", {"window": 16, "alpha": 0.5}, 150, 0.5, "sdpa"),
    # floor int(0.94 * 60) = 56 lifts heads that would keep 54-55 (window + 0.94 * 44 would give 57)
    "adakv-safeguard-binds": ("adakv", {"window": 16, "alpha": 0.94}, 120, 0.5, "sdpa"),
    "adakv-defaults": ("adakv", {}, 140, 0.5, "sdpa"),
}

_models: dict[tuple[Path, str], PreTrainedModel] = {}


def load(path: Path, attention: str) -> PreTrainedModel:
    if (path, attention) not in _models:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attention
        )
        _models[path, attention] = model.eval()
    return _models[path, attention]


def token_ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES)
def test_kept_tokens_and_logits_match_kvpress(case: str, arch: str, tiny_dirs: dict[str, Path]) -> None:
    method, params, length, ratio, attention = CASES[case]
    model = load(tiny_dirs[arch], attention)
    prompt, continuation = token_ids(length, seed=length), token_ids(3, seed=length + 1)
    press = press_for(method, ratio, params)
    theirs_kept, theirs_logits = run_press(model, press, prompt, continuation)

    budget = length * (1 - ratio) if method == "pyramidkv" else compute_n_kept(length, ratio)
    ours = run_compressed(model, prompt, continuation, method, budget=budget, **params)
    for layer, (ranking, kept) in enumerate(zip(ours.rankings, theirs_kept)):
        assert_same_kept(ranking, kept, where=f"{case} {arch} layer {layer}")
    assert_logits_close(ours.logits, theirs_logits, where=f"{case} {arch}")
    # The cases must compress: a budget that kept everything would pin nothing.
    assert sum(len(t) for t in ours.kept[-1]) < len(ours.kept[-1]) * length


@pytest.mark.parametrize("arch", ARCHS)
def test_scores_match_kvpress(arch: str, tiny_dirs: dict[str, Path]) -> None:
    """Beyond the kept sets: the score values themselves, window excluded."""
    length, window = 90, 16
    prompt, continuation = token_ids(length, seed=5), token_ids(1, seed=6)
    model = load(tiny_dirs[arch], "eager")
    layers, _ = prefill(model, prompt)
    presses = {
        "snapkv": kvpress.SnapKVPress(0.5, window_size=window),
        "tova": kvpress.TOVAPress(0.5),
        "observed": kvpress.ObservedAttentionPress(0.5),
    }
    theirs = {}
    for name, press in presses.items():
        theirs[name] = capture_scores(press)
        run_press(model, press, prompt, continuation)
    for layer, t in enumerate(layers):
        where = f"{arch} layer {layer}"
        snap = snapkv_scores(t.q, t.k, window=window, kernel=5, pool="avg")
        torch.testing.assert_close(snap, theirs["snapkv"][layer][:, :-window], msg=where)
        last = last_query_attention(t.q, t.k)
        torch.testing.assert_close(last, theirs["tova"][layer][:, :-1], msg=where)
        observed = accumulated_attention(t.q, t.k, normalize=True)
        torch.testing.assert_close(observed, theirs["observed"][layer], msg=where)
        # H2O's column sums are what observed attention averages.
        seen_by = torch.arange(length, 0, -1, dtype=torch.float32)
        column_sums = accumulated_attention(t.q, t.k)
        torch.testing.assert_close(column_sums, theirs["observed"][layer] * seen_by, msg=where)


def test_reference_defaults_are_kvpress_defaults() -> None:
    snap, pyramid = kvpress.SnapKVPress(), kvpress.PyramidKVPress()
    snap_defaults = DEFAULTS["snapkv"]
    assert (snap.window_size, snap.kernel_size) == (snap_defaults["window"], snap_defaults["kernel"])
    assert (pyramid.window_size, pyramid.kernel_size, pyramid.beta) == tuple(
        DEFAULTS["pyramidkv"][name] for name in ("window", "kernel", "beta")
    )
    assert kvpress.StreamingLLMPress().n_sink == DEFAULTS["streamingllm"]["n_sink"]
    assert kvpress.AdaKVPress(snap).alpha_safeguard == DEFAULTS["adakv"]["alpha"]
