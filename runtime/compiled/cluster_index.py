"""Each sequence's k-means index over its stored keys, per layer, for a method whose decode read ranks
the clusters of a `kmeans` partition (hook fact `clusters`; docs/design.md, "Cluster indices").

An index covers the stored slots [start, end): `start` is the read's `first n` (those slots are read
exactly anyway), `end` the row's prompt less the read's `last m` at first; the slots past `end` (the
newest m of the prompt and every generated token) are read exactly through the plan's `last`. When
`segment` more tokens than `m` lie past `end`, the oldest `segment` of them are clustered as one
more segment and `end` moves on: the index grows as decode appends, a segment at a time, and never
re-clusters what it holds. The index is a function of the stored keys and values, the prompt length
and the parameters, so it is built on a row's first decode step in a layer (from the stored
pages: a prefix-cache hit, a chain's next turn, a fork or a preemption's recompute need nothing
else) and rebuilt when the row's prompt length changes (a new turn). It lives on the device of the
keys, keyed by sequence id, and is dropped on release. Host facts (`DecodeView.rows`) are needed:
such methods decode eagerly (no CUDA graphs yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kvc.runtime.errors import ConfigError
from kvc.runtime.method_api import DecodeView


@dataclass
class ClusterIndex:
    """One sequence's index in one layer: slots [start, end) in clusters."""

    prompt: int  # the row's prompt length it was built for
    start: int
    end: int
    assign: torch.Tensor  # [Hkv, end - start] int64: the cluster of each indexed slot
    sizes: torch.Tensor  # [Hkv, C] float32
    summaries: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [Hkv, C, D] float32

    def extend(self, segment: tuple) -> None:
        """Append one clustered segment (`cluster_segment`'s answer for slots [end, end + n))."""
        assign, sizes, summaries = segment
        offset = self.sizes.shape[1]
        self.assign = torch.cat([self.assign, assign + offset], dim=1)
        self.sizes = torch.cat([self.sizes, sizes], dim=1)
        self.summaries = {name: torch.cat([self.summaries[name], summaries[name]], dim=1) for name in summaries}
        self.end += assign.shape[1]


class ClusterIndices:
    """The indices of every running sequence, built and grown by `cluster(k, v)`, the generated
    clustering of one segment (`<partition>_segment`), over `segment` tokens at a time."""

    def __init__(self, name: str, cluster: Callable, summaries: list[str]) -> None:
        self.name, self.cluster, self.summaries = name, cluster, summaries
        self.indices: dict[tuple[int, int], ClusterIndex] = {}

    def batch(self, layer: int, view: DecodeView, first: int, last: int, segment: int,
              params: dict) -> dict[str, torch.Tensor]:
        """The decode rows' indices in `layer`, each brought up to date, padded into batch tensors:
        `sizes` [B, Hkv, C] (0: padding), `members` [B, Hkv, N] (cluster of indexed slot
        `starts[b] + i`, -1: padding), `starts`, `ends`, `lengths` [B] and each summary [B, Hkv, C, D]."""
        if view.rows is None:
            raise ConfigError(f"method {self.name!r} keeps a cluster index per sequence and decodes eagerly (its "
                              "decode steps are not captured in CUDA graphs)", param="method")
        rows = []
        for b, row in enumerate(view.rows):
            if row.length == 0:  # a padding row
                rows.append(None)
                continue
            rows.append(self._current(layer, view, b, (row.seq_id, row.prompt_len, row.length), first, last, segment,
                                      params))
        return _padded(rows, view, self.summaries)

    def _current(self, layer: int, view: DecodeView, b: int, row: tuple[int, int, int], first: int, last: int,
                 segment: int, params: dict) -> ClusterIndex:
        seq_id, prompt, length = row
        key = (seq_id, layer)
        index = self.indices.get(key)
        stored = length - 1  # the step's own token is not stored yet; `last` reads it
        if index is None or index.prompt != prompt or index.end > stored:
            start = min(first, prompt)
            end = max(start, prompt - last)
            index = self._build(view, b, prompt, start, end, segment, params)
            self.indices[key] = index
        while index.end + segment <= min(length - last, stored):
            k, v = _row_slots(view, b, index.end, index.end + segment)
            index.extend(self.cluster(k, v, params))
        return index

    def _build(self, view: DecodeView, b: int, prompt: int, start: int, end: int, segment: int,
               params: dict) -> ClusterIndex:
        heads = view.k.shape[1]
        index = ClusterIndex(prompt, start, start, torch.zeros(heads, 0, dtype=torch.long, device=view.q.device),
                             torch.zeros(heads, 0, device=view.q.device),
                             {name: torch.zeros(heads, 0, view.k.shape[2], device=view.q.device)
                              for name in self.summaries})
        for lo in range(start, end, segment):
            k, v = _row_slots(view, b, lo, min(end, lo + segment))
            index.extend(self.cluster(k, v, params))
        return index

    def release(self, seq_id: int) -> None:
        for key in [key for key in self.indices if key[0] == seq_id]:
            del self.indices[key]


def _row_slots(view: DecodeView, b: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b's stored keys and values of slots [lo, hi), [Hkv, hi - lo, D] each (dense caches)."""
    try:
        k_cache, v_cache = view.store.k_cache, view.store.v_cache  # [pages + 1, Hkv, S, D]
    except TypeError as e:
        raise ConfigError(f"a cluster index is built from dense keys and values ({e})", param="method") from None
    size = k_cache.shape[2]
    pages = view.block_tables[b, lo // size: -(-hi // size)].long()
    out = []
    for cache in (k_cache, v_cache):
        x = cache[pages].permute(1, 0, 2, 3).reshape(cache.shape[1], -1, cache.shape[3])
        out.append(x[:, lo - (lo // size) * size:][:, :hi - lo])
    return out[0], out[1]


def _padded(rows: list[ClusterIndex | None], view: DecodeView, summaries: list[str]) -> dict[str, torch.Tensor]:
    batch, heads, dim, device = len(rows), view.k.shape[1], view.k.shape[2], view.q.device
    width = max([r.sizes.shape[1] for r in rows if r is not None], default=0)
    count = max([r.assign.shape[1] for r in rows if r is not None], default=0)
    out = {"sizes": torch.zeros(batch, heads, width, device=device),
           "members": torch.full((batch, heads, count), -1, dtype=torch.long, device=device),
           "starts": torch.zeros(batch, dtype=torch.long, device=device),
           "ends": torch.zeros(batch, dtype=torch.long, device=device),
           "lengths": view.context_lens.long()}
    for name in summaries:
        out[name] = torch.zeros(batch, heads, width, dim, device=device)
    for b, r in enumerate(rows):
        if r is None:
            continue
        c, n = r.sizes.shape[1], r.assign.shape[1]
        out["sizes"][b, :, :c] = r.sizes
        out["members"][b, :, :n] = r.assign
        out["starts"][b], out["ends"][b] = r.start, r.end
        for name in summaries:
            out[name][b, :, :c] = r.summaries[name]
    return out
