"""Reference SkipKV (Tian et al. 2026, "SkipKV: Selective Skipping of KV Generation and Storage for Efficient
Inference with Large Reasoning Models", arXiv 2512.07993), written from the paper's algorithm as
`methods/skipkv.kvm` spells it, never from kvc's compiler: what each KV head of one layer keeps when a
compression runs (every `every` decoding steps), in float64, with loops.

- Sentences: the sequence's text is cut after every token at which the text so far ends with one of the
  markers (".\\n", ")\\n\\n", "\\n\\n"); a token's sentence is the number of cuts before it.
- Token importance (per KV head, over the tokens it holds, oldest first): the last `window` queries' logits
  q k^T / sqrt(D), causal (query i sees the keys up to its own), the largest over the head's query group, a
  softmax over the keys per query, the mean over the window, a centred max pool of `kernel` keys.
- A sentence's importance: the mean of its tokens'. Its embedding: the mean of its keys. It is redundant (1,
  else 0) when a later sentence's embedding has cosine similarity above `threshold` with it (a vector's norm
  + 1e-8 under it). Its score: importance - redundant.
- Kept: the newest `window` tokens, then whole sentences best first (ties: the older sentence) while the
  tokens they bring (those before the window) fit in `budget - window`; the first that does not fit and every
  sentence after it are dropped.
"""

from __future__ import annotations

import math

import torch

MARKERS = (".\n", ")\n\n", "\n\n")


def sentences(pieces: list[str], markers: tuple[str, ...] = MARKERS) -> list[int]:
    """The sentence of every token, from each token's text."""
    out, text, current = [], "", 0
    for piece in pieces:
        out.append(current)
        text += piece
        if piece and any(text.endswith(m) for m in markers):
            current += 1
    return out


def keep_head(q: torch.Tensor, keys: torch.Tensor, ids: list[int], *, budget: int, window: int, kernel: int,
              threshold: float) -> torch.Tensor:
    """One KV head: q [group, window, D] (its query heads' newest queries, oldest first), keys [n, D] (oldest
    first), ids [n] the tokens' sentences -> the kept indices, ascending."""
    n, dim = keys.shape
    q, k = q.double(), keys.double()
    logits = torch.stack([q[g] @ k.T for g in range(q.shape[0])]).amax(dim=0) / math.sqrt(dim)  # [window, n]
    for i in range(window):
        logits[i, n - window + i + 1:] = -math.inf
    mean = logits.softmax(dim=-1).mean(dim=0)
    pooled = torch.tensor([max(mean[max(0, i - kernel // 2): i + kernel // 2 + 1].tolist()) for i in range(n)])
    present = sorted(set(ids))
    importance = {s: pooled[[i for i in range(n) if ids[i] == s]].mean().item() for s in present}
    embedding = {s: k[[i for i in range(n) if ids[i] == s]].mean(dim=0) for s in present}
    unit = {s: e / (e.norm() + 1e-8) for s, e in embedding.items()}
    redundant = {s: float(any(t > s and float(unit[s] @ unit[t]) > threshold for t in present)) for s in present}
    score = {s: importance[s] - redundant[s] for s in present}
    before = n - min(window, n)
    size = {s: sum(1 for i in range(before) if ids[i] == s) for s in present}
    room, kept = max(0, min(budget - window, before)), set()
    for s in sorted(present, key=lambda s: (-score[s], s)):
        if size[s] > room:
            break
        room -= size[s]
        kept.add(s)
    return torch.tensor([i for i in range(n) if i >= before or ids[i] in kept], dtype=torch.long)
