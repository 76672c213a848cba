"""The primitives of a k-means partition of the keys (`dim clusters = kmeans(k, size = n, segment =
s, iterations = i)`) that a generated torch lowering calls: clustering one segment of a layer's
keys, the summaries `fn(k | v, within clusters)` of its clusters, and the read plan of a
`read top(...)` + `estimate top(...)` over the clusters. docs/design.md, "Cluster indices", has
the rules; runtime/compiled/cluster_index.py keeps each sequence's index.
"""

from __future__ import annotations

import functools
import math

import torch

from kvc.runtime.primitives.torch_primitives import per_row

NEG_INF = float("-inf")


def kmeans(x: torch.Tensor, k: int, iterations: int) -> torch.Tensor:
    """Lloyd's k-means of each head's vectors x [H, n, D] into k clusters (Euclidean): the cluster
    of every vector, [H, n] int64. Deterministic: the centroids start at k evenly spaced vectors
    (n * i // k); a cluster left empty by an iteration keeps its centroid; the last assignment is
    to the nearest final centroid (ties to the lower cluster)."""
    heads, n, dim = x.shape
    k = max(1, min(int(k), n))
    x = x.float()
    centroids = x[:, (torch.arange(k, device=x.device) * n) // k]  # [H, k, D]
    assign = torch.zeros(heads, n, dtype=torch.long, device=x.device)
    for step in range(int(iterations) + 1):
        # |x - c|^2 up to |x|^2, which does not change the argmin
        dist = (centroids * centroids).sum(-1)[:, None, :] - 2 * x @ centroids.transpose(1, 2)  # [H, n, k]
        assign = dist.argmin(-1)
        if step == iterations:
            break
        sums = torch.zeros_like(centroids).scatter_add_(1, assign[..., None].expand(-1, -1, dim), x)
        counts = torch.zeros(heads, k, device=x.device).scatter_add_(1, assign, torch.ones_like(assign, dtype=x.dtype))
        centroids = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], centroids)
    return assign


def summarise(x: torch.Tensor, assign: torch.Tensor, k: int, fn: str) -> torch.Tensor:
    """`fn(x, within clusters)` of vectors x [H, n, D] in clusters `assign` [H, n] -> [H, k, D]
    float32 (sum, mean, max, min; an empty cluster's is 0)."""
    heads, _, dim = x.shape
    index = assign[..., None].expand(-1, -1, dim)
    out = torch.zeros(heads, k, dim, device=x.device)
    if fn in ("sum", "mean"):
        out.scatter_add_(1, index, x.float())
        if fn == "mean":
            out /= sizes_of(assign, k).clamp(min=1)[..., None]
        return out
    if fn in ("max", "min"):
        out = out.scatter_reduce(1, index, x.float(), "amax" if fn == "max" else "amin", include_self=False)
        return torch.where(sizes_of(assign, k)[..., None] > 0, out, 0.0)
    raise ValueError(f"no cluster summary {fn!r} (sum, mean, max, min)")


def sizes_of(assign: torch.Tensor, k: int) -> torch.Tensor:
    """Vectors per cluster, [H, k] float32."""
    return torch.zeros(assign.shape[0], k, device=assign.device).scatter_add_(
        1, assign, torch.ones(assign.shape, device=assign.device))


def cluster_segment(k: torch.Tensor, v: torch.Tensor, size, iterations, summaries: dict[str, tuple[str, str]]):
    """One segment of a layer's keys k [Hkv, n, D] (values v) clustered into ceil(n / size) clusters:
    (assign [Hkv, n] int64, sizes [Hkv, C] float32, {summary name: [Hkv, C, D] float32}), the
    summaries given as name -> (fn, "k" | "v")."""
    count = max(1, math.ceil(k.shape[1] / size))
    assign = kmeans(k, count, iterations)
    count = min(count, k.shape[1])
    sources = {"k": k, "v": v}
    return assign, sizes_of(assign, count), {name: summarise(sources[src], assign, count, fn)
                                             for name, (fn, src) in summaries.items()}


def read_clusters(scores, inputs, count, size, first=0, estimate=None, using=None):
    """The plan of `read top(scores, count) + first n` and `estimate top(scores, m) using KEY, VSUM`
    over a batch's cluster indices (runtime/compiled/cluster_index.py `ClusterIndices.inputs`):

    - scores [row, kv_head, C] (padding clusters, size 0, are never chosen); the index as gathered rows, or as
      views over every sequence row with `rows` (`ClusterIndices.inputs(gather=False)`); `count` and `estimate`
      are tokens per row ([row] tensors or numbers), counted in clusters of the partition's average
      `size`: ceil(tokens / size) clusters (docs/language.md; the paper's nprobe, a fraction of
      the clusters);
    - read exactly: each (row, KV head)'s `count` best clusters, the row's first `first` slots, and
      (`last`) every slot past the index, the newest tokens;
    - estimated: the next `estimate` clusters by score, each one pseudo-key KEY (the cluster's key
      summary) whose softmax weight counts its size (log-weight log(size)), with value sum VSUM
      (`Estimate`: the attention divides by the size; no per-step mean).

    Ties as a stable sort leaves them (the lower cluster first). Static shapes, no host read: the
    estimate has an entry per cluster, in cluster order, those not estimated weighing nothing
    (log-weight -inf).
    Returns (tokens [row, kv_head, n] int32, each head's slots first in slot order and -1 after;
    last [row] int32; estimate (keys, value sums, log_weights[, rows]) or None, `Estimate`'s fields;
    counts [row, kv_head] int32, the slots each head lists: `ReadPlan.counts`)."""
    if scores.is_cuda and _triton() is not None:  # the same plan in three Triton launches (clusters_triton.py)
        return _triton().read_clusters(scores, inputs, count, size, first, estimate, using)
    if "rows" in inputs:  # the index's views over every sequence row: this path reads the decode rows' copies
        rows = inputs["rows"].long()
        inputs = {name: x[rows] if name in ("sizes", "members", "starts", "ends", *(using or ())) else x
                  for name, x in inputs.items()}
    sizes, members = inputs["sizes"], inputs["members"].long()  # [B, Hkv, C], [B, Hkv, N]
    present = sizes > 0
    ranked = torch.where(present, scores.float(), NEG_INF)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices  # padding last
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)  # each cluster's place in the order
    available = present.sum(-1)  # [B, Hkv]
    n_read = torch.minimum(_clusters(count, size, sizes), available)
    chosen = rank < n_read[..., None]
    listed = chosen.gather(-1, members.clamp(min=0)) & (members >= 0)
    slots = inputs["starts"].long()[:, None, None] + torch.arange(members.shape[-1], device=members.device)
    tokens = torch.where(listed, slots, -1)
    first = max(0, int(first))
    if first:
        head = torch.arange(first, device=tokens.device).expand(*tokens.shape[:2], first)
        head = torch.where(head < inputs["starts"].long()[:, None, None], head, -1)
        tokens = torch.cat([head, tokens], dim=-1)
    last = (inputs["lengths"].long() - inputs["ends"].long()).clamp(min=0).to(torch.int32)
    tokens, counts = packed(tokens)
    if estimate is None:
        return tokens, last, None, counts
    n_est = torch.minimum(_clusters(estimate, size, sizes), available - n_read)  # the places right after the read's
    if order.shape[-1] == 0:
        return tokens, last, None, counts
    # every cluster has its entry (a static width, no gather): those ranked right after the read clusters count
    estimated = present & (rank >= n_read[..., None]) & (rank < (n_read + n_est)[..., None])
    key_name, value_name = using
    log_weights = torch.where(estimated, torch.log(sizes.clamp(min=1)), NEG_INF)
    return tokens, last, (inputs[key_name], inputs[value_name], log_weights), counts


@functools.cache
def _triton():
    """clusters_triton, or None where Triton is not installed (the torch read serves then)."""
    try:
        from kvc.runtime.primitives import clusters_triton
    except ImportError:
        return None
    return clusters_triton


def packed(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A token plan [B, Hkv, n] (-1: none) with each head's listed slots moved to its front, in their
    order, -1 after them, as int32; and how many each head lists, [B, Hkv] int32. A prefix sum and a
    scatter: static shapes, no host read."""
    listed = tokens >= 0
    width = tokens.shape[-1]
    place = torch.where(listed, torch.cumsum(listed, dim=-1) - 1, width)  # unlisted: a spare column
    out = torch.full((*tokens.shape[:-1], width + 1), -1, dtype=torch.int32, device=tokens.device)
    out.scatter_(-1, place, tokens.to(torch.int32))
    return out[..., :width].contiguous(), listed.sum(-1).to(torch.int32)


def _clusters(count, size, like: torch.Tensor) -> torch.Tensor:
    """A count of tokens per row (a [row] tensor or a number) as clusters of `size` tokens,
    ceil(count / size), at least 0: [row, 1] int64."""
    count = per_row(count, like.shape[0], like.device).clamp(min=0)
    return torch.ceil(count / size).long().reshape(-1, 1)
