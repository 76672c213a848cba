"""Reference decode-time eviction, one rule per paper, written from the papers (never from kvc's
compiler): what each KV head of one layer keeps after every decoding step.

Each evictor sees, per layer and step, the newest query `q [Hq, D]` (post-RoPE) and the layer's
cache after the step's token was appended (`HeadCache`, every head holding the same tokens,
oldest first); it recomputes that query's attention densely (causal softmax(q k^T / sqrt(D)) over
every cached key, the step's own included) and drops tokens in place. Counts are per KV head.

- StreamingLLM (Xiao et al. 2024): once over `n_sink + recent`, the first `n_sink` tokens and the
  newest `recent` stay.
- H2O (Zhang et al. 2023): every token's accumulated attention (the prompt's column sums, then
  each step's attention added, query heads of a KV head averaged) ranks the heavy hitters; once
  over `heavy + recent`, the newest `recent` stay and the `heavy` best of the others (ties: the
  older token). The accumulated scores follow the kept tokens.
- TOVA (Oren et al. 2024): once over `budget`, keep the `budget` tokens the newest query attends
  to most, averaged over every query head of the layer (one set for all heads); the newest token
  itself may go.

- Ada-KV (Feng et al. 2024) with a decode budget (`AdaKV`): every `every` steps the layer allocates its
  budget again across KV heads over the tokens each head still holds (they differ per head).

`interval` (kvpress DecodingPress's compression_interval; 1: the papers' every-step rule): a head
evicts only once it holds `interval` tokens past its budget, then back down to the budget by the
same rule at that length (H2O keeps accumulating meanwhile).
"""

from __future__ import annotations

import math

import torch

from tests.references.scores import top_indices


def _probs(q: torch.Tensor, keys: list[torch.Tensor]) -> torch.Tensor:
    """The newest query's attention over each KV head's cached keys: [Hq, n]."""
    num_kv_heads = len(keys)
    group = q.shape[0] // num_kv_heads
    out = []
    for h in range(num_kv_heads):
        logits = q[h * group : (h + 1) * group].float() @ keys[h].float().T / math.sqrt(q.shape[-1])
        out.append(logits.softmax(dim=-1))
    return torch.cat(out)


def _gather(cache, kept: torch.Tensor) -> None:
    """Keep `kept [Hkv, n]` (ascending) of every head's keys and values, in place."""
    cache.keys[:] = [cache.keys[h][kept[h]] for h in range(len(cache.keys))]
    cache.values[:] = [cache.values[h][kept[h]] for h in range(len(cache.values))]


class StreamingLLM:
    def __init__(self, *, n_sink: int, recent: int, interval: int = 1) -> None:
        self.n_sink, self.recent, self.interval = n_sink, recent, interval

    def step(self, layer: int, q: torch.Tensor, cache) -> None:
        n = cache.keys[0].shape[0]
        if n < self.n_sink + self.recent + self.interval:
            return
        kept = torch.cat([torch.arange(self.n_sink), torch.arange(n - self.recent, n)])
        _gather(cache, kept.expand(len(cache.keys), -1))


class H2O:
    """`seen[layer]` starts as the prompt's accumulated attention of the tokens prefill kept."""

    def __init__(self, *, heavy: int, recent: int, seen: list[torch.Tensor], interval: int = 1) -> None:
        self.heavy, self.recent, self.seen, self.interval = heavy, recent, seen, interval

    def step(self, layer: int, q: torch.Tensor, cache) -> None:
        num_kv_heads = len(cache.keys)
        probs = _probs(q, cache.keys)
        received = probs.reshape(num_kv_heads, -1, probs.shape[-1]).mean(dim=1)  # [Hkv, n]
        seen = torch.nn.functional.pad(self.seen[layer], (0, 1)) + received
        n = seen.shape[1]
        if n < self.heavy + self.recent + self.interval:
            self.seen[layer] = seen
            return
        older = n - self.recent
        heavy = top_indices(seen[:, :older], self.heavy)
        kept = torch.cat([heavy, torch.arange(older, n).expand(num_kv_heads, -1)], dim=1)
        _gather(cache, kept)
        self.seen[layer] = seen.gather(1, kept)


class TOVA:
    def __init__(self, *, budget: int, interval: int = 1) -> None:
        self.budget, self.interval = budget, interval

    def step(self, layer: int, q: torch.Tensor, cache) -> None:
        n = cache.keys[0].shape[0]
        if n < self.budget + self.interval:
            return
        scores = _probs(q, cache.keys).mean(dim=0)  # [n], every head of the layer
        kept = top_indices(scores, self.budget)
        _gather(cache, kept.expand(len(cache.keys), -1))


class RKV:
    """R-KV (Cai et al. 2025; tests/references/rkv.py for the scores and the keep) as `methods/rkv.kvm` spells
    its schedule: the prefill keeps every token; after decoding step s (1 at the first) with s % every == 0, a
    layer holding more than `budget` tokens keeps R-KV's choice, scored with its newest `window` queries (the
    prompt's last ones first, then each step's)."""

    def __init__(self, *, budget: int, window: int, kernel: int, mix: float, threshold: float, every: int,
                 prompt_queries: list[torch.Tensor]) -> None:
        self.params = {"budget": budget, "window": window, "kernel": kernel, "mix": mix, "threshold": threshold}
        self.every = every
        self.queries = [q[:, -window:] for q in prompt_queries]  # per layer [Hq, <= window, D]
        self.steps = [0] * len(prompt_queries)

    def step(self, layer: int, q: torch.Tensor, cache) -> None:
        from tests.references import rkv

        window = self.params["window"]
        self.queries[layer] = torch.cat([self.queries[layer], q[:, None]], dim=1)[:, -window:]
        self.steps[layer] += 1
        n = cache.keys[0].shape[0]
        if self.steps[layer] % self.every or n <= self.params["budget"]:
            return
        keys = torch.stack(list(cache.keys))
        _gather(cache, rkv.keep(self.queries[layer], keys, **self.params))



class SkipKV:
    """SkipKV (Tian et al. 2026; tests/references/skipkv.py for the sentences, scores and the keep) as
    `methods/skipkv.kvm` spells its schedule: the prefill keeps every token; after decoding step s (1 at the
    first) with s % every == 0, each KV head of a layer keeps SkipKV's choice over the tokens it still holds
    (they differ per head: whole sentences), scored with its newest `window` queries (the prompt's last ones
    first, then each step's). `history` holds the sequence's tokens so far (the caller appends each generated
    one) and `piece` gives a token's text; each head's tokens keep their positions, whose sentences come from
    the whole history."""

    def __init__(self, *, budget: int, window: int, kernel: int, threshold: float, every: int,
                 prompt_queries: list[torch.Tensor], history: list[int], piece) -> None:
        self.params = {"budget": budget, "window": window, "kernel": kernel, "threshold": threshold}
        self.every, self.history, self.piece = every, history, piece
        self.queries = [q[:, -window:] for q in prompt_queries]  # per layer [Hq, <= window, D]
        self.steps = [0] * len(prompt_queries)
        self.positions: list[list[list[int]] | None] = [None] * len(prompt_queries)  # per layer, per head

    def step(self, layer: int, q: torch.Tensor, cache) -> None:
        from tests.references import skipkv

        window = self.params["window"]
        self.queries[layer] = torch.cat([self.queries[layer], q[:, None]], dim=1)[:, -window:]
        self.steps[layer] += 1
        lengths = cache.lengths()
        if self.positions[layer] is None:  # the prompt and the first step's token, every head
            self.positions[layer] = [list(range(n)) for n in lengths]
        else:
            for held in self.positions[layer]:
                held.append(held[-1] + 1)
        if self.steps[layer] % self.every:
            return
        newest = self.positions[layer][0][-1]
        ids = skipkv.sentences([self.piece(t) for t in self.history[:newest]] + [""])
        group = q.shape[0] // len(lengths)
        kept = []
        for h, held in enumerate(self.positions[layer]):
            queries = self.queries[layer][h * group:(h + 1) * group]
            kept.append(skipkv.keep_head(queries, cache.keys[h], [ids[p] for p in held], **self.params))
            self.positions[layer][h] = [held[i] for i in kept[-1].tolist()]
        _gather(cache, kept)


class SnapKV:
    """SnapKV (Li et al. 2024) with a decode budget, as `methods/snapkv.kvm` and `pyramidkv.kvm` spell `every`:
    after decoding step s (1 at the first) with s % every == 0, a layer holding more than its budget (the
    prefill's: SnapKV's `budget`, PyramidKV's per layer) keeps SnapKV's choice again over its stored keys, the
    newest `window` kept, scored by its newest `window` queries (the prompt's last ones first, then each
    step's), each attending causally over the stored keys up to its own."""

    def __init__(self, *, budgets: list[int], window: int, kernel: int, pool: str, every: int,
                 prompt_queries: list[torch.Tensor]) -> None:
        self.budgets, self.window, self.kernel, self.pool, self.every = budgets, window, kernel, pool, every
        self.queries = [q[:, -window:] for q in prompt_queries]  # per layer [Hq, <= window, D]
        self.steps = [0] * len(prompt_queries)

    def step(self, layer: int, q: torch.Tensor, cache) -> None:
        from tests.references.eviction import rank_snapkv

        self.queries[layer] = torch.cat([self.queries[layer], q[:, None]], dim=1)[:, -self.window:]
        self.steps[layer] += 1
        n, budget = cache.keys[0].shape[0], self.budgets[layer]
        if self.steps[layer] % self.every or n <= budget:
            return
        keys = torch.stack(list(cache.keys))  # [Hkv, n, D]
        queries = keys.new_zeros(q.shape[0], n, keys.shape[-1])  # the window's queries at their positions
        queries[:, n - self.window:] = self.queries[layer].to(keys.dtype)
        ranking = rank_snapkv(queries, keys, budget=budget, window=self.window, kernel=self.kernel, pool=self.pool)
        _gather(cache, ranking.kept())


class AdaKV:
    """Ada-KV (Feng et al. 2024) with a decode budget, as `methods/adakv.kvm` spells `every`: after decoding
    step s (1 at the first) with s % every == 0, a layer whose heads hold more than `budget` tokens each on
    average allocates again. Each KV head scores the tokens it holds (they differ per head) with SnapKV's rule:
    its query group's newest `window` queries (the prompt's last ones first, then each step's), each attending
    causally over that head's keys up to its own, averaged over the window, pooled along keys, averaged over the
    group. Every head keeps its newest `window` tokens and its `safeguard` best (window tokens count first);
    the rest of `num_kv_heads * budget` goes to the best-scored tokens of any head (ties: the lower head, then
    the older token), as `eviction.rank_adakv` over heads of different lengths."""

    def __init__(self, *, budget: int, window: int, kernel: int, pool: str, safeguard: int, every: int,
                 prompt_queries: list[torch.Tensor]) -> None:
        self.budget, self.window, self.kernel, self.pool = budget, window, kernel, pool
        self.safeguard, self.every = safeguard, every
        self.queries = [q[:, -window:] for q in prompt_queries]  # per layer [Hq, <= window, D]
        self.steps = [0] * len(prompt_queries)

    def step(self, layer: int, q: torch.Tensor, cache) -> None:
        from tests.references.eviction import ALWAYS
        from tests.references.scores import snapkv_scores, top_indices

        self.queries[layer] = torch.cat([self.queries[layer], q[:, None]], dim=1)[:, -self.window:]
        self.steps[layer] += 1
        lengths = cache.lengths()
        num_kv_heads = len(lengths)
        if self.steps[layer] % self.every or sum(lengths) <= num_kv_heads * self.budget:
            return
        group = q.shape[0] // num_kv_heads
        rows = []
        for h, n in enumerate(lengths):
            keys = cache.keys[h][None]  # [1, n, D]
            queries = keys.new_zeros(group, n, keys.shape[-1])  # the window's queries at their positions
            queries[:, n - self.window:] = self.queries[layer][h * group:(h + 1) * group].to(keys.dtype)
            scores = snapkv_scores(queries, keys, window=self.window, kernel=self.kernel, pool=self.pool)[0]
            scores = torch.cat([scores, torch.full((self.window,), ALWAYS)])  # the window always stays
            safe = top_indices(scores, min(self.safeguard, n))
            rows.append(scores.scatter(0, safe, ALWAYS))
        flat = top_indices(torch.cat(rows), num_kv_heads * self.budget)
        bounds = torch.tensor([0, *lengths]).cumsum(0)
        kept = [flat[(flat >= bounds[h]) & (flat < bounds[h + 1])] - bounds[h] for h in range(num_kv_heads)]
        _gather(cache, kept)
