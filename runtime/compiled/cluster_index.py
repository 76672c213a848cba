"""Each sequence's k-means index over its stored keys, per layer, for a method whose decode read ranks
the clusters of a `kmeans` partition (hook fact `clusters`; docs/design.md, "Cluster indices").

The index lives in the sequence's row of SEQ tensors of the KV spec (`tensors`: runtime/kv/rows.py),
static buffers sized by the longest context, so the decode hook reads it through the step's rows
(`inputs`: static shapes, no host value) in eager steps and captured decode graphs alike. It is
written outside the decode step, on the host's facts: built at `prefill_end` over the stored
prompt, grown at `step_end` for the next step. A prefix-cache hit, a chain's next turn, a fork
(its row is copied) or a preemption's recompute (a prefill again) need nothing else.

An index covers the stored slots [start, end): `start` is the read's `first n` (those slots are read
exactly anyway), `end` the row's prompt less the read's `last m` at first; the slots past `end` (the
newest m of the prompt and every generated token) are read exactly through the plan's `last`. When
`segment` more tokens than `m` lie past `end`, the oldest `segment` of them are clustered as one
more segment and `end` moves on: the index grows a segment at a time and never re-clusters what it
holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kvc.runtime.kv.spec import Extent, TensorSpec
from kvc.runtime.method_api import DecodeView, LayerCacheView, StepView

NO_SEGMENT = 1 << 62  # `segment` of a partition clustered whole


@dataclass
class _Written:
    """What one sequence's row holds in one layer (the host's mirror; `row` None: a clone's, whose
    row is its source's copy)."""

    row: int | None
    prompt: int
    start: int
    end: int
    clusters: int


class ClusterIndices:
    """The rows' indices of partition `partition`, written by `cluster(k, v, params)`, the generated
    clustering of one segment (`<partition>_segment`: each cluster's size and `summaries`), `segment`
    tokens at a time; `size` and `segment` are the generated `<partition>_size` / `_segment_length`,
    `ranges(sym, params)` the read's (first, last)."""

    def __init__(self, partition: str, cluster: Callable, summaries: list[str], size: Callable,
                 segment: Callable, ranges: Callable) -> None:
        self.cluster, self.summaries, self.ranges = cluster, summaries, ranges
        self._size, self._segment = size, segment
        self.sizes, self.members, self.bounds = f"{partition}_sizes", f"{partition}_members", f"{partition}_bounds"
        self.written: dict[tuple[int, int], _Written] = {}  # (seq_id, layer) -> what its row holds

    # ---- sizes ---------------------------------------------------------------------------------
    def last_bound(self, sym: dict, params: dict) -> int | None:
        """The most slots past an index's end a decode step reads through the plan's `last`: the
        read's `last m`, a segment not yet clustered and the step's own token (the index grows
        whenever a whole segment fits, `_catch_up`); None when the partition is clustered whole
        or `m` is not one number for the batch."""
        segment = self.segment(params)
        last = self.ranges(sym, params)[1]
        if segment == NO_SEGMENT or isinstance(last, torch.Tensor) and last.numel() != 1:
            return None
        return int(last) + segment + 1

    def segment(self, params: dict) -> int:
        segment = self._segment(params)
        return NO_SEGMENT if segment is None else max(1, int(segment))

    def max_clusters(self, tokens: int, params: dict) -> int:
        """The most clusters an index over at most `tokens` slots holds: its segments are whole
        but for one, and a segment of m keys gets ceil(m / size) clusters."""
        size, segment = float(self._size(params)), self.segment(params)
        whole, rest = divmod(max(0, int(tokens)), segment)
        return max(1, whole * math.ceil(segment / size) + math.ceil(rest / size))

    def tensors(self, head_dim: int, longest: int, params: dict, dtype: torch.dtype) -> tuple[TensorSpec, ...]:
        """The SEQ tensors of the index for contexts of at most `longest` tokens: the summaries in the model's
        `dtype` (as page summaries are), the sizes in float32."""
        clusters = self.max_clusters(longest, params)
        return (TensorSpec(self.sizes, Extent.SEQ, torch.float32, (clusters,)),
                TensorSpec(self.members, Extent.SEQ, torch.int32, (max(1, longest),)),
                TensorSpec(self.bounds, Extent.SEQ, torch.int32, (2,)),
                *(TensorSpec(name, Extent.SEQ, dtype, (clusters, head_dim)) for name in self.summaries))

    # ---- the hook's inputs (static shapes) -----------------------------------------------------
    def inputs(self, layer: int, view: DecodeView, params: dict, gather: bool = True) -> dict[str, torch.Tensor]:
        """The decode rows' indices in `layer` read from their rows (`view.seq_rows`): `sizes` [B, Hkv,
        C] (0: none), `members` [B, Hkv, N] (cluster of indexed slot `starts[b] + i`, -1: none),
        `starts`, `ends`, `lengths` [B] and each summary [B, Hkv, C, D], C and N bounded by the step's
        `max_context_len` (a graph's context bucket). `gather=False` (the GPU's kernels, which index the
        rows themselves): `sizes`, `members`, `starts`, `ends` and the summaries are the layer's views over
        every sequence row ([R, ...], no copy, no launch) and `rows` [B] names each decode row's."""
        store, rows = view.store, view.seq_rows
        if rows is None:
            raise RuntimeError("a cluster read needs the step's rows of the per-sequence tensors")
        members = store[self.members]
        width = members.shape[-1] if view.max_context_len is None else min(members.shape[-1], view.max_context_len)
        count = min(store[self.sizes].shape[-1], self.max_clusters(width, params))
        bounds = store[self.bounds][:, layer, 0]  # [R, 2] (every KV head holds the same)
        out = {"sizes": store[self.sizes][:, layer, :, :count], "members": members[:, layer, :, :width],
               "starts": bounds[:, 0], "ends": bounds[:, 1]}
        for name in self.summaries:
            out[name] = store[name][:, layer, :, :count]
        if not gather:
            return {**out, "lengths": view.context_lens, "rows": rows}
        rows = rows.long()
        out = {name: x[rows] for name, x in out.items()}
        return {**out, "starts": out["starts"].long(), "ends": out["ends"].long(), "lengths": view.context_lens.long()}

    # ---- writing (outside the decode step) -----------------------------------------------------
    def build(self, layer: int, seq_id: int, prompt: int, cache: LayerCacheView, sym: dict, params: dict) -> None:
        """The index of a prompt of `prompt` stored slots, written into the sequence's row."""
        store, row = cache.store, cache.row
        if row is None:
            return
        first, last = self.ranges(sym, params)
        start = min(first, prompt)
        end = max(start, prompt - last)
        store[self.sizes][row, layer] = 0
        store[self.members][row, layer] = -1
        for name in self.summaries:
            store[name][row, layer] = 0
        written = self.written[(seq_id, layer)] = _Written(row, prompt, start, start, 0)
        if end > start:
            keys, values = cache.keys(), cache.values()
            for lo in range(start, end, self.segment(params)):
                self._append(layer, store, written, keys, values, min(end, lo + self.segment(params)), params)
        store[self.bounds][row, layer, :, 0] = start
        self._catch_up(layer, cache, written, last, params)

    def due(self, lengths: np.ndarray, prompts: np.ndarray, sym: dict, params: dict) -> np.ndarray:
        """Which rows that store `lengths` slots (prompts of `prompts`) grow their index for the
        next step: one more whole segment fits between the built index's end and the newest `last`."""
        first, last = self.ranges(sym, params)
        segment = self.segment(params)
        end = np.maximum(np.minimum(first, prompts), prompts - last)
        room = np.minimum(lengths + 1 - last, lengths) - end  # what the next step leaves past the prompt's index
        return (room >= segment) & (room % segment == 0)

    def grow(self, layer: int, views: Seq[StepView], sym: dict, params: dict) -> None:
        """Brings each row's index up to date for the next step (its length + 1); a row whose index
        is not its prompt's is built first."""
        last = self.ranges(sym, params)[1]
        for view in views:
            cache = view.cache
            written = self.written.get((view.seq_id, layer))
            if written is not None and written.row is None:  # a clone's: its row is a copy
                written.row = cache.row
            if written is None or written.prompt != view.prompt_len or written.row != cache.row:
                self.build(layer, view.seq_id, view.prompt_len, cache, sym, params)
                written = self.written.get((view.seq_id, layer))
                if written is None:
                    continue
            self._catch_up(layer, cache, written, last, params)

    def _catch_up(self, layer: int, cache: LayerCacheView, written: _Written, last: int, params: dict) -> None:
        """Grows a row's index by whole segments while the next step (its length + 1) leaves one
        between the index and its newest `last`; the row's bounds say where the index ends."""
        segment = self.segment(params)
        top = min(cache.length + 1 - last, cache.length)
        if written.end + segment <= top:
            keys, values = cache.keys(), cache.values()
            while written.end + segment <= top:
                self._append(layer, cache.store, written, keys, values, written.end + segment, params)
        cache.store[self.bounds][written.row, layer, :, 1] = written.end

    def _append(self, layer: int, store, written: _Written, keys: torch.Tensor, values: torch.Tensor, hi: int,
                params: dict) -> None:
        """Clusters slots [written.end, hi) as one segment into the row, its clusters numbered after
        the ones the row holds."""
        lo, row, c = written.end, written.row, written.clusters
        assign, sizes, summaries = self.cluster(keys[:, lo:hi], values[:, lo:hi], params)
        n = sizes.shape[1]
        store[self.members][row, layer, :, lo - written.start:hi - written.start] = (assign + c).to(torch.int32)
        store[self.sizes][row, layer, :, c:c + n] = sizes
        for name in self.summaries:
            store[name][row, layer, :, c:c + n] = summaries[name]
        written.clusters, written.end = c + n, hi

    # ---- lifecycle -----------------------------------------------------------------------------
    def clone(self, src: int, dst: int) -> None:
        """A cloned sequence's row is a copy of its source's (the engine copies rows with pages)."""
        for (seq_id, layer), w in list(self.written.items()):
            if seq_id == src:
                self.written[(dst, layer)] = _Written(None, w.prompt, w.start, w.end, w.clusters)

    def release(self, seq_id: int) -> None:
        for key in [key for key in self.written if key[0] == seq_id]:
            del self.written[key]

