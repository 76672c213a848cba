"""A chain pruned between turns, by hand: the oracle of `POST /v1/chains/{id}/prune` for `full`.

Turn 1 runs with full attention and greedy decoding (every decoded token's K/V appended, the last
sampled token never fed). The prune then scores each layer's stored keys with SnapKV's
observation-window votes (`scores.snapkv_scores`), the window queries being the last `stored_queries`
post-RoPE queries of the prompt, placed as the newest positions (as the chain cache keeps them);
in each range [a, b) every KV head drops its ceil-rounded share of the lowest-scored tokens
(ties: the older first). Turn 2 appends its suffix at the logical positions after the history and
decodes greedily. Nothing here comes from kvc's engine.
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

from tests.references.chain_snapkv import _decode
from tests.references.model_forward import HeadCache, _logits, _reference_attention, _Session, prefill
from tests.references.scores import snapkv_scores


def _prune_layer(cache: HeadCache, q: torch.Tensor, ranges, keep: float, window: int, kernel: int) -> None:
    keys = torch.stack(cache.keys)  # [Hkv, T, D]
    length = keys.shape[1]
    queries = torch.zeros(q.shape[0], length, q.shape[2])
    queries[:, length - q.shape[1]:] = q
    scores = snapkv_scores(queries, keys, window=window, kernel=kernel, pool="avg")  # [Hkv, T - window]
    scores = torch.cat([scores, torch.full((keys.shape[0], window), float("inf"))], dim=1)
    for h in range(keys.shape[0]):
        dropped = set()
        for a, b in ranges:
            n = b - a
            drop = n - math.ceil(keep * n)
            order = torch.sort(scores[h, a:b], stable=True).indices[:drop]
            dropped |= {a + int(i) for i in order}
        kept = [i for i in range(length) if i not in dropped]
        cache.keys[h], cache.values[h] = cache.keys[h][kept], cache.values[h][kept]


def pruned_session(model: PreTrainedModel, prompt: list[int], steps: int, ranges: list[tuple[int, int]],
                   keep: float, next_prompt: list[int], next_steps: int, *, stored_queries: int,
                   window: int, kernel: int) -> tuple[list[int], list[int]]:
    """Greedy tokens of turn 1 and of turn 2 (`next_prompt` extends the stored conversation)."""
    layers, logits = prefill(model, torch.tensor(prompt))
    caches = [HeadCache([t.k[h] for h in range(t.k.shape[0])], [t.v[h] for h in range(t.v.shape[0])])
              for t in layers]
    first = _decode(model, caches, int(logits[-1].argmax()), len(prompt), steps)
    stored = prompt + first[:-1]
    for t, cache in zip(layers, caches):
        _prune_layer(cache, t.q[:, -stored_queries:], ranges, keep, window, kernel)
    if next_prompt[: len(stored)] != stored:
        raise ValueError("turn 2's prompt must extend the stored conversation")
    with _reference_attention(model, _Session(caches=caches)):
        logits = _logits(model, torch.tensor(next_prompt[len(stored):]), len(stored))
    second = _decode(model, caches, int(logits[-1].argmax()), len(next_prompt), next_steps)
    return first, second
