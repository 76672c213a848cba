"""Reference eviction methods, one function per paper: which prompt tokens each KV head keeps.

Every function sees one layer of one prompt — post-RoPE `q [Hq, T, D]` and `k [Hkv, T, D]` —
and returns the kept token indices per KV head, ascending: a `[Hkv, n]` tensor when every head
keeps n tokens, a list of Hkv 1-D tensors for Ada-KV (per-head counts differ). `budget` counts
kept tokens per KV head, windows and sinks included. A prompt of T <= budget keeps everything.
Each method is written as a `Ranking` — scores [Hkv, T], tokens it must keep scored +inf, and a
count — whose kept set is the top `count` per head (Ada-KV: over the whole layer); `rank()` gives
the scores too, so a comparison with another implementation can set near-ties aside.
Defaults are those of NVIDIA kvpress 0.5.5 (the reference implementation the acceptance tests
compare against); `DEFAULTS` lists them. Scores and tie-breaking are in `scores.py`.

- StreamingLLM (Xiao et al. 2023): the first `n_sink` tokens + the most recent budget - n_sink.
- SnapKV (Li et al. 2024): the last `window` tokens + the top budget - window earlier tokens by
  observation-window attention (`snapkv_scores`).
- PyramidKV (Cai et al. 2024): SnapKV with a per-layer budget falling linearly with depth
  (`pyramid_budgets`); `budget` is the average over layers, possibly fractional.
- PyramidKV as KVCache-Factory schedules it (`pyramidkv_factory`, what kvc's
  methods/pyramidkv.kvm follows): the same SnapKV selection with the integer per-layer budgets of
  `kvcache_factory_budgets`; kvpress's real-valued schedule (`pyramid_budgets`) differs.
- H2O (Zhang et al. 2023): the last `recent` tokens + the top budget - recent earlier tokens by
  accumulated attention (column sums over all prompt queries); `recent` defaults to budget // 2,
  the paper's even heavy/recent split.
- observed attention (kvpress's prefill H2O scoring): top budget by average received attention,
  no recent window. Only here to pin `accumulated_attention` against kvpress.
- TOVA (Oren et al. 2024): the last token + the top budget - 1 by the last query's attention,
  averaged over all heads of the layer (every KV head keeps the same tokens).
- Ada-KV (Feng et al. 2024) over SnapKV scores: the layer keeps Hkv * budget (head, token) pairs
  chosen by one top-k over all heads' scores, after protecting per head the observation window
  and its top max(1, int(alpha * budget)) tokens (the safeguard, window tokens first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import torch

from tests.references.scores import (
    accumulated_attention,
    last_query_attention,
    snapkv_scores,
    top_indices,
)

Kept = Union[torch.Tensor, list[torch.Tensor]]

DEFAULTS: dict[str, dict[str, Any]] = {
    "streamingllm": {"n_sink": 4},
    "snapkv": {"window": 64, "kernel": 5, "pool": "avg"},
    "pyramidkv": {"window": 64, "kernel": 5, "pool": "avg", "beta": 20},
    "pyramidkv_factory": {"window": 32, "kernel": 5, "pool": "avg", "beta": 20},
    "h2o": {"recent": None},
    "observed_attention": {},
    "tova": {"per_kv_head": False},
    "adakv": {"window": 64, "kernel": 5, "pool": "avg", "alpha": 0.2},
}

ALWAYS = float("inf")  # the score of a token a method keeps whatever the others score


@dataclass
class Ranking:
    """A method's decision as scores: it keeps the `count` best tokens of each KV head, or of the
    whole layer (flattened head-major) when `across_heads`. Tokens scored `ALWAYS` are never
    outranked: there are never more of them than `count`."""

    scores: torch.Tensor  # [Hkv, T]
    count: int
    across_heads: bool = False

    def kept(self) -> Kept:
        if not self.across_heads:
            return top_indices(self.scores, self.count)
        length = self.scores.shape[1]
        flat = top_indices(self.scores.reshape(-1), self.count)
        heads, tokens = flat // length, flat % length
        return [tokens[heads == head] for head in range(self.scores.shape[0])]


def _forced_tail(scores: torch.Tensor, tail: int) -> torch.Tensor:
    """Scores of the first T - tail tokens [Hkv, T - tail], the last `tail` forced: [Hkv, T]."""
    return torch.nn.functional.pad(scores, (0, tail), value=ALWAYS)


def _keep_all(k: torch.Tensor) -> Ranking:
    return Ranking(torch.full(k.shape[:2], ALWAYS), k.shape[1])


def _check_budget(budget: float, forced: int, what: str) -> None:
    if budget < forced:
        raise ValueError(f"budget {budget} is smaller than {what} ({forced})")


def rank_streamingllm(q: torch.Tensor, k: torch.Tensor, *, budget: int, n_sink: int = 4) -> Ranking:
    """Attention sinks + recent window; needs no scores (`q` unused)."""
    num_kv_heads, length = k.shape[:2]
    if length <= budget:
        return _keep_all(k)
    _check_budget(budget, n_sink, "n_sink")
    scores = torch.full((num_kv_heads, length), -ALWAYS)
    scores[:, :n_sink] = ALWAYS
    scores[:, length - (budget - n_sink) :] = ALWAYS
    return Ranking(scores, budget)


def rank_snapkv(
    q: torch.Tensor, k: torch.Tensor, *, budget: int, window: int = 64, kernel: int = 5, pool: str = "avg"
) -> Ranking:
    if k.shape[1] <= budget:
        return _keep_all(k)
    _check_budget(budget, window, "the observation window")
    scores = snapkv_scores(q, k, window=window, kernel=kernel, pool=pool)
    return Ranking(_forced_tail(scores, window), budget)


def pyramid_budgets(
    length: int, *, num_layers: int, budget: float, window: int, beta: float = 20
) -> list[int]:
    """PyramidKV's per-layer token budgets (window included) for a T-token prompt.

    The bottom layer gets `max_num`, the top `min_num = max_num / (2 beta - 1)` (the pair averages
    to `budget`), linearly in between, each rounded half to even. `max_num` is capped at T - window
    (the top then takes the slack); when the schedule would break T >= max >= min >= window every
    layer gets round(budget) (plain SnapKV). Sum over layers = num_layers * budget up to rounding
    (a one-layer model gets max_num, as in kvpress).
    """
    if beta < 1:
        raise ValueError(f"beta must be >= 1, got {beta}")
    min_num = budget / beta
    max_num = 2 * budget - min_num
    if max_num >= length - window:
        max_num = length - window
        min_num = 2 * budget - max_num
    if not length >= max_num >= min_num >= window:
        return [max(1, round(budget))] * num_layers
    step = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
    return [round(max_num - layer * step) for layer in range(num_layers)]


def rank_pyramidkv(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    layer: int,
    num_layers: int,
    budget: float,
    window: int = 64,
    kernel: int = 5,
    pool: str = "avg",
    beta: float = 20,
) -> Ranking:
    budgets = pyramid_budgets(k.shape[1], num_layers=num_layers, budget=budget, window=window, beta=beta)
    return rank_snapkv(q, k, budget=budgets[layer], window=window, kernel=kernel, pool=pool)


def kvcache_factory_budgets(
    length: int, *, num_layers: int, budget: int, window: int, beta: int = 20
) -> list[int]:
    """PyramidKV's per-layer token budgets (window included) in KVCache-Factory's integer arithmetic
    (its PyramidKVCluster), for a T-token prompt and `budget` tokens per layer on average.

    Beyond the window a layer keeps on average r = budget - window. Prompts shorter than 2r use
    SnapKV's uniform budget. Otherwise the bottom layer keeps most = min(2r - r // beta, T - window)
    beyond the window, the top least = 2r - most, and each layer above the bottom one keeps
    (most - least) // (num_layers - 1) fewer. (kvpress computes the same shape in real numbers and
    rounds each layer, with its own fallback; see `pyramid_budgets`.)
    """
    reserve = budget - window
    if reserve <= 0 or beta < 1:
        raise ValueError(f"need budget > window and beta >= 1, got {budget}, {window}, {beta}")
    if length < 2 * reserve:
        return [budget] * num_layers
    most = min(2 * reserve - reserve // beta, length - window)
    least = 2 * reserve - most
    step = (most - least) // (num_layers - 1) if num_layers > 1 else 0
    return [window + most - layer * step for layer in range(num_layers)]


def rank_pyramidkv_factory(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    layer: int,
    num_layers: int,
    budget: int,
    window: int = 32,
    kernel: int = 5,
    pool: str = "avg",
    beta: int = 20,
) -> Ranking:
    budgets = kvcache_factory_budgets(k.shape[1], num_layers=num_layers, budget=budget, window=window, beta=beta)
    return rank_snapkv(q, k, budget=budgets[layer], window=window, kernel=kernel, pool=pool)


def rank_h2o(q: torch.Tensor, k: torch.Tensor, *, budget: int, recent: int | None = None) -> Ranking:
    length = k.shape[1]
    if length <= budget:
        return _keep_all(k)
    recent = budget // 2 if recent is None else recent
    if recent < 0:
        raise ValueError(f"recent must be >= 0, got {recent}")
    _check_budget(budget, recent, "the recent window")
    scores = accumulated_attention(q, k)[:, : length - recent]
    return Ranking(_forced_tail(scores, recent), budget)


def rank_observed_attention(q: torch.Tensor, k: torch.Tensor, *, budget: int) -> Ranking:
    if k.shape[1] <= budget:
        return _keep_all(k)
    return Ranking(accumulated_attention(q, k, normalize=True), budget)


def rank_tova(q: torch.Tensor, k: torch.Tensor, *, budget: int, per_kv_head: bool = False) -> Ranking:
    if k.shape[1] <= budget:
        return _keep_all(k)
    _check_budget(budget, 1, "the last token")
    return Ranking(_forced_tail(last_query_attention(q, k, per_kv_head=per_kv_head), 1), budget)


def adakv_safeguard(budget: int, alpha: float) -> int:
    """Tokens each head keeps for sure (window tokens count first): max(1, int(alpha * budget))."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return max(1, int(budget * alpha)) if alpha > 0 and budget > 0 else 0


def rank_adakv(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    budget: int,
    window: int = 64,
    kernel: int = 5,
    pool: str = "avg",
    alpha: float = 0.2,
) -> Ranking:
    num_kv_heads, length = k.shape[:2]
    if length <= budget:
        return _keep_all(k)
    _check_budget(budget, window, "the observation window")
    scores = _forced_tail(snapkv_scores(q, k, window=window, kernel=kernel, pool=pool), window)
    safe = top_indices(scores, adakv_safeguard(budget, alpha))
    return Ranking(scores.scatter(1, safe, ALWAYS), num_kv_heads * budget, across_heads=True)


RANKINGS: dict[str, Callable[..., Ranking]] = {
    "streamingllm": rank_streamingllm,
    "snapkv": rank_snapkv,
    "pyramidkv": rank_pyramidkv,
    "pyramidkv_factory": rank_pyramidkv_factory,
    "h2o": rank_h2o,
    "observed_attention": rank_observed_attention,
    "tova": rank_tova,
    "adakv": rank_adakv,
}

_LAYER_AWARE = {"pyramidkv", "pyramidkv_factory"}


def rank(
    method: str, q: torch.Tensor, k: torch.Tensor, *, layer: int, num_layers: int, **params: Any
) -> Ranking:
    """Any method's `Ranking` for one layer; `params` override `DEFAULTS[method]`."""
    if method not in RANKINGS:
        raise ValueError(f"unknown method {method!r}; known: {sorted(RANKINGS)}")
    if method in _LAYER_AWARE:
        params = {"layer": layer, "num_layers": num_layers, **params}
    return RANKINGS[method](q, k, **params)


def select(
    method: str, q: torch.Tensor, k: torch.Tensor, *, layer: int, num_layers: int, **params: Any
) -> list[torch.Tensor]:
    """Kept indices of one layer as a list of Hkv ascending 1-D tensors, for any method."""
    return list(rank(method, q, k, layer=layer, num_layers=num_layers, **params).kept())


def streamingllm(q: torch.Tensor, k: torch.Tensor, **params: Any) -> torch.Tensor:
    return rank_streamingllm(q, k, **params).kept()


def snapkv(q: torch.Tensor, k: torch.Tensor, **params: Any) -> torch.Tensor:
    return rank_snapkv(q, k, **params).kept()


def pyramidkv(q: torch.Tensor, k: torch.Tensor, **params: Any) -> torch.Tensor:
    return rank_pyramidkv(q, k, **params).kept()


def h2o(q: torch.Tensor, k: torch.Tensor, **params: Any) -> torch.Tensor:
    return rank_h2o(q, k, **params).kept()


def observed_attention(q: torch.Tensor, k: torch.Tensor, **params: Any) -> torch.Tensor:
    return rank_observed_attention(q, k, **params).kept()


def tova(q: torch.Tensor, k: torch.Tensor, **params: Any) -> torch.Tensor:
    return rank_tova(q, k, **params).kept()


def adakv(q: torch.Tensor, k: torch.Tensor, **params: Any) -> list[torch.Tensor]:
    return rank_adakv(q, k, **params).kept()


def gather_kv(k: torch.Tensor, v: torch.Tensor, kept: Kept) -> tuple[Any, Any]:
    """Compressed K/V of one layer: `[Hkv, n, D]` tensors for a tensor of indices, per-head
    lists of `[n_h, D]` for a list."""
    if isinstance(kept, torch.Tensor):
        index = kept[..., None].expand(-1, -1, k.shape[-1])
        return k.gather(1, index), v.gather(1, index)
    return [k[h, idx] for h, idx in enumerate(kept)], [v[h, idx] for h, idx in enumerate(kept)]
