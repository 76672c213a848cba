"""CUDA graphs of decode-only steps (the model runner's fast path on a GPU).

`ModelRunner.run` hands a decode-only batch to `DecodeGraphs.run`: the batch is loaded into
static device buffers (`_load`: token ids, positions, per-layer slots, context lengths, page
tables and KV-head starts, incrementally from a host mirror), and the graph of its key is
replayed, captured lazily on first use. All graphs share one memory pool. `run_uncaptured` runs
the same step eagerly over the same buffers (the CPU tests).
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvc.runtime.attention.metadata import AttentionMetadata
from kvc.runtime.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from kvc.runtime.model_runner import ModelRunner

log = logging.getLogger(__name__)


class DecodeGraphs:
    """CUDA graphs of decode-only steps, one per batch-size bucket (and per "some KV head starts
    past slot 0": those graphs read the static `starts` buffer, the others are the kernels
    without it), sharing one memory pool."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int) -> None:
        self.runner = runner
        self.buckets = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512) if b < max_num_seqs]
        self.buckets.append(max_num_seqs)
        n, dev, layers = self.buckets[-1], runner.device, runner.num_layers
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        # per-layer static buffers: layer l's row of each is what its kernels read
        self.slots = torch.full((layers, n), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((layers, n, runner.max_pages_per_seq), dtype=torch.int32, device=dev)
        self.ctx = torch.zeros((layers, n), dtype=torch.int32, device=dev)
        self.cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.starts = torch.zeros((layers, n, runner.num_kv_heads), dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        self.pool = None
        # host mirror of what the table and starts buffers hold, per row (`_load`)
        self._loaded: list[tuple[int, int] | None] = [None] * n
        self._host_tables = np.zeros((layers, n, 1), dtype=np.int32)
        self._host_starts = np.zeros((layers, n, runner.num_kv_heads), dtype=np.int32)
        self._row_starts = [False] * n

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def _step_fn(self, b: int, with_starts: bool):
        """The decode step a graph of bucket `b` captures: the model over the static buffers."""
        r = self.runner
        md = AttentionMetadata(
            slot_mapping=self.slots[:, :b],
            block_tables=self.tables[:, :b],
            cu_seqlens_q=self.cu[: b + 1],
            context_lens=self.ctx[:, :b],
            num_decodes=b,
            max_query_len=1,
            max_context_len=r.max_model_len,
            kv_starts=self.starts[:, :b] if with_starts else None,
        )
        attn = r._attn_fn(md)

        def step() -> torch.Tensor:
            return r.model.compute_logits(r.model(self.input_ids[:b], self.positions[:b], attn))

        return step

    def _capture(self, b: int, with_starts: bool = False) -> None:
        step = self._step_fn(b, with_starts)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile kernels and settle allocations outside the graph
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[b, with_starts] = step()
        self.pool = graph.pool()
        self.graphs[b, with_starts] = graph
        log.debug("captured decode graph for batch %d%s", b, " with KV-head starts" if with_starts else "")

    def capture_all(self) -> None:
        for b in reversed(self.buckets):
            self._capture(b)

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        n = len(batch.seqs)
        key = self._load(batch)
        if key not in self.graphs:
            self._capture(*key)
        self.graphs[key].replay()
        return self.logits[key][:n]

    def run_uncaptured(self, batch: ScheduledBatch) -> torch.Tensor:
        """What `run` replays, run eagerly (the same buffers and code; tests on the CPU)."""
        return self._step_fn(*self._load(batch))()[: len(batch.seqs)]

    def _load(self, batch: ScheduledBatch) -> tuple[int, bool]:
        """Fills the static buffers with the batch; the graph key (bucket, with starts).

        Incremental: a host mirror of the page tables and KV-head starts keeps each row's last
        load, and only rows whose sequence or `tables_version` changed are rewritten and copied to
        the device (in steady decoding, the rows that crossed a page boundary). Slots and context
        lengths are computed vectorised over [layer, row] from the mirror. (Row by row over 48
        layers this cost ~12 ms per step at batch 160; the GPU waited for it.)"""
        seqs, n = batch.seqs, len(batch.seqs)
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        page, layers = self.runner.page_size, self.runner.num_layers
        changed = self._update_mirror(seqs)
        with_starts = any(self._row_starts[:n])
        key = (b, with_starts)
        pos = [seq.num_computed_tokens for seq in seqs]
        ids = [seq.token_ids[p] for seq, p in zip(seqs, pos)]
        kv = np.array([seq.kv_lens for seq in seqs], dtype=np.int64).T  # [L, n]
        pages = np.take_along_axis(self._host_tables[:, :n], (kv // page)[:, :, None], axis=2)[:, :, 0]
        slots = np.full((layers, b), -1, dtype=np.int64)  # padding rows: no slot, no context
        slots[:, :n] = pages.astype(np.int64) * page + kv % page
        ctx = np.zeros((layers, b), dtype=np.int32)
        ctx[:, :n] = kv + 1
        pad = b - n
        self.input_ids[:b].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(pos + [0] * pad), non_blocking=True)
        self.slots[:, :b].copy_(torch.from_numpy(slots), non_blocking=True)
        self.ctx[:, :b].copy_(torch.from_numpy(ctx), non_blocking=True)
        # Page tables: only changed rows travel (stale entries past a row's table, and in padding
        # rows, are never read: kernels stop at the row's context length, 0 for padding).
        width = self._host_tables.shape[2]
        if len(changed) > n // 4:
            self.tables[:, :n, :width].copy_(torch.from_numpy(self._host_tables[:, :n]), non_blocking=True)
        else:
            for i in changed:
                self.tables[:, i, :width].copy_(torch.from_numpy(self._host_tables[:, i]), non_blocking=True)
        if with_starts:  # padding rows start at 0 (their context is empty anyway)
            starts = np.zeros((layers, b, self._host_starts.shape[2]), dtype=np.int32)
            starts[:, :n] = self._host_starts[:, :n]
            self.starts[:, :b].copy_(torch.from_numpy(starts), non_blocking=True)
        return key

    def _update_mirror(self, seqs) -> list[int]:
        """Rewrites the mirror rows whose sequence or tables changed since the last load (all of
        them when the mirror must widen); returns their indices."""
        tables = self.runner.tables
        longest = max(tables.longest(seq) for seq in seqs)
        if longest > self._host_tables.shape[2]:  # widen (rare): every row is rewritten
            width = min(max(longest, 2 * self._host_tables.shape[2]), self.tables.shape[2])
            self._host_tables = np.zeros((self.runner.num_layers, len(self._loaded), width), dtype=np.int32)
            self._loaded = [None] * len(self._loaded)
        changed = []
        for i, seq in enumerate(seqs):
            mark = (seq.seq_id, seq.tables_version)
            if self._loaded[i] == mark:
                continue
            self._loaded[i] = mark
            changed.append(i)
            arr = tables.array(seq)
            w = min(arr.shape[1], self._host_tables.shape[2])
            self._host_tables[:, i, :w] = arr[:, :w]
            self._host_tables[:, i, w:] = 0
            has = seq.has_kv_starts
            self._row_starts[i] = has
            self._host_starts[:, i] = tables.starts_array(seq) if has else 0
        return changed
