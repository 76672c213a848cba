"""Token scores the reference eviction methods rank by, for one layer of one prompt.

Inputs are the prompt's post-RoPE queries `q [Hq, T, D]` and keys `k [Hkv, T, D]` of one layer
(Qwen3's q/k norms already applied), no batch dimension. Everything is computed in float32.

Conventions every score here shares (the kvc compiler must match them):
- Attention is causal softmax(q k^T / sqrt(D)) over keys, query at position p sees keys 0..p.
- GQA: query head h reads KV head h // (Hq // Hkv) (Hugging Face's `repeat_kv` layout); a score
  per KV head is the plain mean of its group's per-query-head scores, taken last.
- `top_indices` breaks ties toward the earlier token (then the lower head for flattened scores).
"""

from __future__ import annotations

import math

import torch


def attention_probs(q: torch.Tensor, k: torch.Tensor, first_query: int = 0) -> torch.Tensor:
    """Causal attention probabilities of queries first_query..T-1 over all T keys:
    [Hq, T - first_query, T]."""
    num_heads, length, head_dim = q.shape
    group = num_heads // k.shape[0]
    keys = k.float().repeat_interleave(group, dim=0)
    logits = q[:, first_query:].float() @ keys.transpose(1, 2) / math.sqrt(head_dim)
    query_pos = torch.arange(first_query, length)[:, None]
    key_pos = torch.arange(length)[None, :]
    logits = logits.masked_fill(key_pos > query_pos, float("-inf"))
    return logits.softmax(dim=-1)


def group_mean(per_query_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[Hq, ...] -> [Hkv, ...]: average each KV head's group of query heads."""
    return per_query_head.reshape(num_kv_heads, -1, *per_query_head.shape[1:]).mean(dim=1)


def pool1d(scores: torch.Tensor, kernel: int, pool: str) -> torch.Tensor:
    """Stride-1 pooling along the last dim, output as long as the input ("same" padding).

    avg: zero padding that counts in the mean (every output is a window sum / kernel);
    max: padding never wins. `kernel` must be odd so the window is centred.
    """
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd and positive, got {kernel}")
    if kernel == 1:
        return scores
    radius = kernel // 2
    if pool == "avg":
        padded = torch.nn.functional.pad(scores, (radius, radius), value=0.0)
        return padded.unfold(-1, kernel, 1).sum(dim=-1) / kernel
    if pool == "max":
        padded = torch.nn.functional.pad(scores, (radius, radius), value=float("-inf"))
        return padded.unfold(-1, kernel, 1).amax(dim=-1)
    raise ValueError(f"pool must be 'avg' or 'max', got {pool!r}")


def snapkv_scores(
    q: torch.Tensor, k: torch.Tensor, *, window: int, kernel: int, pool: str
) -> torch.Tensor:
    """SnapKV's observation-window scores of the non-window keys: [Hkv, T - window].

    The last `window` queries attend causally over all keys (so the softmax normalizes over the
    window keys too); their probabilities on keys 0..T-window-1 are averaged over the window
    queries, pooled per query head over those keys only (window keys never enter a pooling
    window), then averaged over the GQA group.
    """
    length = q.shape[1]
    if not 0 < window < length:
        raise ValueError(f"window must be in [1, T-1], got window={window}, T={length}")
    probs = attention_probs(q, k, first_query=length - window)[:, :, : length - window]
    pooled = pool1d(probs.mean(dim=1), kernel, pool)
    return group_mean(pooled, k.shape[0])


def accumulated_attention(q: torch.Tensor, k: torch.Tensor, *, normalize: bool = False) -> torch.Tensor:
    """H2O's accumulated attention: column sums of the prompt's causal attention matrix, [Hkv, T].

    With `normalize`, key j's sum is divided by the T - j queries that can see it: the average
    attention a key receives (kvpress's observed attention).
    """
    length = q.shape[1]
    column_sums = attention_probs(q, k).sum(dim=1)
    if normalize:
        column_sums = column_sums / torch.arange(length, 0, -1, dtype=column_sums.dtype)
    return group_mean(column_sums, k.shape[0])


def last_query_attention(q: torch.Tensor, k: torch.Tensor, *, per_kv_head: bool = False) -> torch.Tensor:
    """TOVA's scores of keys 0..T-2: the last query's attention, [Hkv, T - 1].

    Averaged over all query heads of the layer (TOVA's paper and kvpress: every head keeps the
    same tokens), or over each KV head's group with `per_kv_head`.
    """
    num_kv_heads, length = k.shape[0], q.shape[1]
    probs = attention_probs(q, k, first_query=length - 1)[:, 0, : length - 1]
    if per_kv_head:
        return group_mean(probs, num_kv_heads)
    return probs.mean(dim=0, keepdim=True).expand(num_kv_heads, -1)


def top_indices(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest scores along the last dim, ascending; ties go to the lower index."""
    if count > scores.shape[-1]:
        raise ValueError(f"cannot keep {count} of {scores.shape[-1]} scores")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :count].sort(dim=-1).values
