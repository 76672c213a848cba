"""Quest (Tang et al. 2024, arXiv 2406.10774), written by hand from the paper and mit-han-lab/Quest,
with no kvc code: the page bound and the pages a decode query reads.

- A page of `page` consecutive stored keys keeps, per channel, the max and min of its keys. A query
  q's bound for the page is sum_d max(q_d * max_d, q_d * min_d): the largest q.k any key of the page
  could reach. With GQA the query heads of a KV head share one page set: the max of their bounds.
- A decode query reads `budget // page - 1` pages ranked by the bound among every stored page but
  the newest, plus the newest page (Quest's kernels read `page_budget - 1` ranked pages and the last
  one; `page_budget = token_budget // page_size`). The first `dense_layers` layers read everything.
"""

from __future__ import annotations

import torch


def page_bounds(q: torch.Tensor, keys: torch.Tensor, page: int) -> torch.Tensor:
    """q [Hq, D] of one decode row, its stored keys [Hkv, n, D] -> bounds [Hkv, ceil(n / page)]."""
    heads, kv_heads, n = q.shape[0], keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    out = torch.empty(kv_heads, -(-n // page))
    for h in range(kv_heads):
        for p in range(out.shape[1]):
            tile = keys[h, p * page:(p + 1) * page].float()
            high, low = tile.amax(0), tile.amin(0)
            out[h, p] = max(float(torch.maximum(q[g].float() * high, q[g].float() * low).sum())
                            for g in range(h * group, (h + 1) * group))
    return out


def read_pages(bounds: torch.Tensor, budget: int, page: int) -> list[set[int]]:
    """Per KV head, the pages read: the newest, and the best `budget // page - 1` of the others."""
    pages = bounds.shape[1]
    ranked = max(0, budget // page - 1)
    out = []
    for h in range(bounds.shape[0]):
        others = sorted(range(pages - 1), key=lambda p: -float(bounds[h, p]))
        out.append(set(others[:ranked]) | {pages - 1})
    return out
