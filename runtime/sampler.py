"""Turns a step's logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds.

One batched pass over all rows: temperature scaling, top-k and top-p masks on a single sort, then
sampling by the exponential race (argmax of p / E with E ~ Exp(1)), which equals drawing from p.
Rows with their own seed draw E from their own generator, so a request's tokens do not depend on
what else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.transfer import to_device


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [N, V] (float32) -> token ids [N] (int64, on logits' device)."""
    tokens = logits.argmax(dim=-1)
    if all(p.greedy for p in params):  # decided on the host: no device round trip
        return tokens
    dev = logits.device
    rows = [i for i, p in enumerate(params) if not p.greedy]
    index = to_device(rows, dev, torch.int64)  # host lists reach the device without a stream wait
    sub = logits.index_select(0, index).float()
    temps = to_device([params[i].temperature for i in rows], dev, sub.dtype)
    probs = _filtered_probs(
        sub / temps[:, None],
        top_k=[params[i].top_k for i in rows],
        top_p=[params[i].top_p for i in rows],
    )
    noise = torch.empty_like(probs)
    shared = [j for j, i in enumerate(rows) if generators[i] is None]
    if len(shared) == len(rows):
        noise.exponential_(generator=default_generator)
    elif shared:
        noise[to_device(shared, dev, torch.int64)] = torch.empty(
            (len(shared), probs.shape[1]), device=probs.device, dtype=probs.dtype
        ).exponential_(generator=default_generator)
    for j, i in enumerate(rows):
        if generators[i] is not None:
            noise[j].exponential_(generator=generators[i])
    tokens.index_copy_(0, index, (probs / noise).argmax(dim=-1))
    return tokens


def _filtered_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Softmax over the tokens that survive each row's top-k and top-p cut."""
    vocab = logits.shape[1]
    if all(k <= 0 or k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = to_device([kk if 0 < kk < vocab else vocab for kk in top_k], logits.device, torch.int64)
    drop = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    p = to_device(top_p, logits.device, sorted_probs.dtype)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = drop | (mass_before >= p[:, None])  # the top token always survives: its mass_before is 0
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)
