"""Reference R-KV (Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models",
arXiv 2505.24133), written from the paper and its published algorithm, never from kvc's compiler: what each KV
head of one layer keeps when a compression runs (every `every` decoding steps), in float64.

- Importance: the last `window` queries' logits q k^T / sqrt(D), each KV head taking the largest over its
  query heads; over the keys before the window, a softmax per query, the mean over the window's queries, then
  a centred max pool of `kernel` keys (out-of-range neighbours never win).
- Redundancy, per KV head over every key: S = cosine similarities (a key's norm + 1e-8 under it), 0 on the
  diagonal; for each key i the newest key j with S[i, j] > threshold is i's near-copy that is not counted
  (S[i, j] = 0; a key with none zeroes S[i, 0], as the published code's index of 0 does); each key's mean
  similarity from the others (the column mean over every row), softmaxed over the keys.
- Score of a key before the window: mix * importance - (1 - mix) * redundancy. Kept: the `budget - window`
  best of them (ties: the older key) and the window's keys; every key while at most `budget` are stored.
"""

from __future__ import annotations

import math

import torch

from tests.references.scores import top_indices


def importance(q: torch.Tensor, keys: torch.Tensor, window: int, kernel: int) -> torch.Tensor:
    """q [Hq, >= window, D] (the newest last), keys [Hkv, n, D] -> [Hkv, n - window]."""
    num_kv, n, dim = keys.shape
    group = q.shape[0] // num_kv
    q = q[:, -window:].double()
    out = torch.empty(num_kv, n - window, dtype=torch.float64)
    for h in range(num_kv):
        logits = torch.stack([q[h * group + g] @ keys[h].double().T for g in range(group)]) / math.sqrt(dim)
        probs = logits.amax(dim=0)[:, : n - window].softmax(dim=-1)  # [window, n - window]
        mean = probs.mean(dim=0)
        for i in range(n - window):
            lo, hi = max(0, i - kernel // 2), min(n - window, i + kernel // 2 + 1)
            out[h, i] = mean[lo:hi].max()
    return out


def redundancy(keys: torch.Tensor, threshold: float) -> torch.Tensor:
    """keys [Hkv, n, D] -> [Hkv, n]."""
    num_kv, n, _ = keys.shape
    out = torch.empty(num_kv, n, dtype=torch.float64)
    for h in range(num_kv):
        k = keys[h].double()
        unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
        sim = unit @ unit.T
        sim.fill_diagonal_(0.0)
        for i in range(n):
            near = [j for j in range(n) if sim[i, j] > threshold]
            sim[i, max(near) if near else 0] = 0.0
        out[h] = sim.mean(dim=0).softmax(dim=-1)
    return out


def scores(q: torch.Tensor, keys: torch.Tensor, *, window: int, kernel: int, mix: float,
           threshold: float) -> torch.Tensor:
    """The score of every key before the window: [Hkv, n - window]."""
    n = keys.shape[1]
    return mix * importance(q, keys, window, kernel) - (1 - mix) * redundancy(keys, threshold)[:, : n - window]


def keep(q: torch.Tensor, keys: torch.Tensor, *, budget: int, window: int, kernel: int, mix: float,
         threshold: float) -> torch.Tensor:
    """Kept key indices [Hkv, min(n, budget)], ascending."""
    num_kv, n, _ = keys.shape
    if n <= budget:
        return torch.arange(n).expand(num_kv, n)
    best = top_indices(scores(q, keys, window=window, kernel=kernel, mix=mix, threshold=threshold), budget - window)
    return torch.cat([best, torch.arange(n - window, n).expand(num_kv, window)], dim=1)
