"""MLA's decompressed heads as the one latent KV head that kvc's methods see (docs/design.md, "MLA").

transformers runs GLM-4.7-Flash's attention decompressed: head h has its own key `k_h = [W_UK_h c, k_rope]`
and value, so the references' prompt tensors are q [H, T, D] and k [H, T, D] (`model_forward.prefill`).
kvc's cache holds one latent head that all H query heads read, so a method's per-KV-head score averages
over all H heads and every head keeps the same tokens. `one_kv_head` writes the decompressed heads as one
KV head without changing any logit: the key is the H heads' keys side by side `[k_1 | ... | k_H]` (H D
channels) and query head h is `q_h` in block h, zeros elsewhere, times sqrt(H) (the references scale
by the width's inverse square root), so q'_h . k' / sqrt(H D) = q_h . k_h / sqrt(D). The reference methods
then rank from the decompressed model's own attention probabilities.
"""

from __future__ import annotations

import math

import torch


def one_kv_head(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [H, T, D] (one key per head) -> q' [H, T, H D], k' [1, T, H D] with the same logits."""
    heads, length, dim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"decompressed MLA has one key per query head: q {tuple(q.shape)}, k {tuple(k.shape)}")
    keys = k.float().transpose(0, 1).reshape(length, heads * dim)[None]
    queries = torch.zeros(heads, length, heads, dim)
    for h in range(heads):
        queries[h, :, h] = q[h].float() * math.sqrt(heads)
    return queries.reshape(heads, length, heads * dim), keys
