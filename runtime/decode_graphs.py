"""CUDA graphs of decode-only steps (the model runner's fast path on a GPU).

`ModelRunner.run` hands a decode-only batch to `DecodeGraphs.run`: the batch is loaded into
static device buffers (`_load`: token ids, positions, per-layer slots, context lengths, page
tables and KV-head starts, incrementally from a host mirror, the rows of the spec's
per-sequence tensors and what their residual windows hold), and the graph of its key is
replayed, captured lazily on first use.
`run_uncaptured` runs the same step eagerly over the same buffers (the CPU tests).

Graph keys (`GraphKey`): the batch-size bucket (padding rows have no slot and no context), whether
some KV head starts past slot 0 (those graphs read the static `starts` buffer), and the context
bucket: the smallest rung of `context_ladder` that covers the step's longest stored context + 1
over every row and layer. The captured `AttentionMetadata.max_context_len` is that rung, so all
that a decode step sizes by the longest context scales with what is stored, not with
max_model_len: the decode-statistics buffer and its scores scratch, the state-plane temporaries
of methods that read them (`[B, Hkv, W]`), and the split-KV grid of the decode kernels. The
ladder is the powers of two from the tuner's smallest context bucket (256) up, ending at the
longest context a sequence can reach (`longest_context`): a rung then costs at most twice the
stored width, there are about log2(longest / 256) of them, and each power-of-two rung is exactly
one tuning bucket (runtime/tuning/buckets.py `context_bucket`), so a graph launches the tuned
config of its own context bucket.

Memory: every graph reads the same static buffers, allocated once at their largest here, and the
statistics buffer, which `reserve_stats` sizes for the largest batch bucket and rung before any
capture (eager steps never ask for more: no more rows than max_num_seqs, no longer context than
`longest_context`), so nothing a captured graph reads is ever reallocated. Graphs share one
memory pool and copy their logits into one static buffer: a graph keeps no output of its own in
the pool, so what one capture frees the next reuses and the pool stays about the size of the
largest graph's temporaries; capture is lazy, and there are at most (batch buckets) x 2 x
(rungs) graphs (`num_graphs` counts them).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from kvc.runtime.attention.metadata import AttentionMetadata
from kvc.runtime.kv.ring import ring_offsets
from kvc.runtime.kv.tables import split_resized
from kvc.runtime.method_api import Hook
from kvc.runtime.scheduler import ScheduledBatch
from kvc.runtime.transfer import Feed, copy_into, feed_pending, to_device
from kvc.runtime.tuning.buckets import BATCH_BUCKETS, MIN_CONTEXT_BUCKET

if TYPE_CHECKING:
    from kvc.runtime.model_runner import ModelRunner

log = logging.getLogger(__name__)


class GraphKey(NamedTuple):
    batch: int  # batch-size bucket
    starts: bool  # reads the KV-head start slots
    context: int  # context bucket: the captured max_context_len


def longest_context(max_model_len: int, num_pages: int, page_size: int) -> int:
    """The longest context a decode row can have: within max_model_len, and within the pages of
    the whole pool (one layer of one sequence cannot hold more)."""
    return max(1, min(max_model_len, num_pages * page_size))


def context_ladder(longest: int, smallest: int = MIN_CONTEXT_BUCKET) -> list[int]:
    """The context buckets: `smallest` doubled while below `longest`, then `longest`."""
    ladder, rung = [], smallest
    while rung < longest:
        ladder.append(rung)
        rung *= 2
    return [*ladder, longest]


def context_bucket(ladder: list[int], needed: int) -> int:
    """The smallest rung of `ladder` that holds `needed` tokens."""
    i = bisect.bisect_left(ladder, needed)
    if i == len(ladder):
        raise RuntimeError(f"a decode row holds {needed} tokens, past the {ladder[-1]} the decode graphs "
                           "were sized for (max_model_len and the pool bound every row)")
    return ladder[i]


class DecodeGraphs:
    """CUDA graphs of decode-only steps, one per `GraphKey` (module docstring), sharing one
    memory pool and one static logits buffer."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int) -> None:
        self.runner = runner
        self.buckets = [b for b in BATCH_BUCKETS if b < max_num_seqs]
        self.buckets.append(max_num_seqs)
        self.contexts = context_ladder(longest_context(runner.max_model_len, runner.attention.num_pages,
                                                       runner.page_size))
        # a ring's capacity is a rung of its own: its rows stay there, and what a decode hook reads is that wide
        lanes = getattr(runner, "lanes", ())  # a runner stand-in of the host benches and tests may have none
        rings = {c for lane in lanes if lane.rules.rings is not None for c in lane.rules.rings.capacities}
        self.contexts = sorted(set(self.contexts) | {c for c in rings if 0 < c < self.contexts[-1]})
        n, dev, layers = self.buckets[-1], runner.device, runner.num_layers
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        # per-layer static buffers: layer l's row of each is what its kernels read
        self.slots = torch.full((layers, n), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((layers, n, runner.max_pages_per_seq), dtype=torch.int32, device=dev)
        self.ctx = torch.zeros((layers, n), dtype=torch.int32, device=dev)
        self.prompts = torch.zeros((layers, n), dtype=torch.int32, device=dev)
        self.cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.starts = torch.zeros((layers, n, runner.num_kv_heads), dtype=torch.int32, device=dev)
        # each row's row of the spec's per-sequence tensors (padding: the scratch row); None: it has none
        self.rows = (torch.full((n,), runner.attention.scratch_row, dtype=torch.int32, device=dev)
                     if runner.attention.num_rows else None)
        # per layer and row, the newest slots its residual window held before the step; None: no window
        self.resid = (torch.zeros((layers, n), dtype=torch.int32, device=dev)
                      if runner.attention.residual_window else None)
        # per layer and row, the slot a ranked ring hands to the method's ranking (runtime/kv/ring.py); None: no
        # lane's ring is ranked
        ranked = any(lane.rules.rings is not None and lane.rules.rings.ranked for lane in lanes)
        self.leave = torch.full((layers, n), -1, dtype=torch.int64, device=dev) if ranked else None
        self.first = torch.zeros((layers, n), dtype=torch.int64, device=dev) if ranked else None
        self.logits: torch.Tensor | None = None  # [n, vocab] float32, every graph's output (`_step_fn`)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._stream: torch.cuda.Stream | None = None  # the warm-up and capture stream
        # host mirror of what the table and starts buffers hold, per row (`_load`)
        # (seq_id, tables_version, len(resized_layers)) of each row's last load
        self._loaded: list[tuple[int, int, int] | None] = [None] * n
        self._host_tables = np.zeros((layers, n, 1), dtype=np.int32)
        self._row_lens = [[0] * layers for _ in range(n)]  # per row, per layer: pages of its table loaded
        self._host_starts = np.zeros((layers, n, runner.num_kv_heads), dtype=np.int32)
        self._row_starts = [False] * n

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def reserve_stats(self) -> None:
        """When the method's decode hook reads attention statistics: their buffer at the largest
        request any step makes (largest batch bucket, largest rung), before any capture."""
        r = self.runner
        fold = r.method.attention.decode_stats
        if fold is not None and Hook.DECODE_AFTER_ATTENTION in r.method.hooks:
            r.attention.stats_request(fold, self.buckets[-1], r.model.spec.num_heads, self.contexts[-1])

    def _step_fn(self, key: GraphKey):
        """The decode step a graph of `key` captures: the model over the static buffers, the
        logits copied into the static output."""
        r, b = self.runner, key.batch
        md = AttentionMetadata(
            slot_mapping=self.slots[:, :b],
            block_tables=self.tables[:, :b],
            cu_seqlens_q=self.cu[: b + 1],
            context_lens=self.ctx[:, :b],
            prompt_lens=self.prompts[:, :b],
            num_decodes=b,
            max_query_len=1,
            max_context_len=key.context,
            kv_starts=self.starts[:, :b] if key.starts else None,
            rows=None if self.rows is None else self.rows[:b],
            resid_lens=None if self.resid is None else self.resid[:, :b],
            positions=self.positions[:b],
            ring_leave=None if self.leave is None else self.leave[:, :b],
            ring_first=None if self.first is None else self.first[:, :b],
        )
        attn = r._attn_fn(md)
        if self.logits is None:  # outside any capture
            self.logits = torch.empty((self.buckets[-1], r.model.spec.vocab_size), dtype=torch.float32,
                                      device=r.device)
        out = self.logits[:b]

        def step() -> torch.Tensor:
            return r.model.compute_logits(r.model(self.input_ids[:b], self.positions[:b], attn), out=out)

        return step

    def _capture(self, key: GraphKey) -> None:
        step = self._step_fn(key)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        with self.parked(key.batch):  # the warm-up steps run for real: on padding rows only
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile kernels and settle allocations outside the graph
                    step()
            torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # captured on the stream the warm-up ran on: libraries' per-stream state (cuBLAS's workspace)
        # exists before the capture; a fresh capture stream made cuBLAS allocate inside it, which
        # failed on the H200 (CUBLAS_STATUS_EXECUTION_FAILED) once other engines had run in the process
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            step()
        self.pool = graph.pool()
        self.graphs[key] = graph
        log.debug("captured decode graph %d for batch %d, context %d%s", len(self.graphs), key.batch, key.context,
                  " with KV-head starts" if key.starts else "")

    @contextlib.contextmanager
    def parked(self, b: int):
        """The first `b` rows of the static buffers as padding rows (no slot, no context, the scratch row)
        inside the block, restored after it. A capture's warm-up steps execute: over the batch loaded
        for the step (a graph captured lazily) they would store its tokens' K/V and queries, count its
        query windows and fold its decode statistics three times instead of once."""
        held = [(buf, buf[..., :b].clone()) for buf in (self.slots, self.ctx, self.resid, self.rows, self.leave)
                if buf is not None]
        self.slots[:, :b].fill_(-1)
        if self.leave is not None:
            self.leave[:, :b].fill_(-1)
        self.ctx[:, :b].zero_()
        if self.resid is not None:
            self.resid[:, :b].zero_()
        if self.rows is not None:
            self.rows[:b].fill_(self.runner.attention.scratch_row)
        try:
            yield
        finally:
            for buf, saved in held:
                buf[..., :b].copy_(saved)

    def capture_all(self) -> None:
        """Every batch bucket at the first context bucket (longer contexts capture when reached)."""
        for b in reversed(self.buckets):
            self._capture(GraphKey(b, False, self.contexts[0]))

    def run(self, batch: ScheduledBatch, feed: Feed | None = None) -> torch.Tensor:
        """Replays the batch's graph; `feed`: the previous step's device tokens and the rows they
        feed (async scheduling, `transfer.feed_pending`)."""
        n = len(batch.seqs)
        key = self._load(batch, feed)
        if key not in self.graphs:
            self._capture(key)
        self.graphs[key].replay()
        return self.logits[:n]

    def run_uncaptured(self, batch: ScheduledBatch, feed: Feed | None = None) -> torch.Tensor:
        """What `run` replays, run eagerly (the same buffers and code; tests on the CPU)."""
        return self._step_fn(self._load(batch, feed))()[: len(batch.seqs)]

    def _load(self, batch: ScheduledBatch, feed: Feed | None = None) -> GraphKey:
        """Fills the static buffers with the batch (pending input tokens from `feed`); its graph key.

        Incremental: a host mirror of the page tables and KV-head starts keeps each row's last
        load; a row whose sequence only appended pages since (in steady decoding, the layers that
        crossed a page boundary) gets just those pages, on the host and on the device (one scatter
        for the whole step), and only rows whose sequence or tables otherwise changed are rewritten
        and copied whole. Slots and context lengths are computed vectorised over [layer, row] from
        the mirror. (Row by row over 48 layers this cost ~12 ms per step at batch 160; rewriting
        every row whose tables changed, as PyramidKV's per-layer lengths do at nearly every step,
        cost about as much again; the GPU waited for both.)"""
        seqs, n = batch.seqs, len(batch.seqs)
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        page, layers = self.runner.page_size, self.runner.num_layers
        rebuilt, appended = self._update_mirror(seqs)
        with_starts = any(self._row_starts[:n])
        pos = [seq.num_computed_tokens for seq in seqs]
        ids = [seq.token_ids[p] if p < len(seq.token_ids) else 0 for seq, p in zip(seqs, pos)]  # 0: pending
        kv = np.array([seq.kv_lens for seq in seqs], dtype=np.int64).T  # [L, n]
        phys, after, leave = ring_offsets(kv, [seq.ring for seq in seqs], pos,  # appends, or rings (runtime/kv/ring.py)
                                          leave=self.leave is not None)
        pages = np.take_along_axis(self._host_tables[:, :n], (phys // page)[:, :, None], axis=2)[:, :, 0]
        slots = np.full((layers, b), -1, dtype=np.int64)  # padding rows: no slot, no context
        slots[:, :n] = pages.astype(np.int64) * page + phys % page
        ctx = np.zeros((layers, b), dtype=np.int32)
        ctx[:, :n] = after
        key = GraphKey(b, with_starts, context_bucket(self.contexts, int(ctx.max())))
        pad = b - n
        copy_into(self.input_ids[:b], ids + [0] * pad)  # pinned: no wait for the step still running
        copy_into(self.positions[:b], pos + [0] * pad)
        copy_into(self.slots[:, :b], slots)
        copy_into(self.ctx[:, :b], ctx)
        if self.leave is not None:
            hand, first = np.full((layers, b), -1, dtype=np.int64), np.zeros((layers, b), dtype=np.int64)
            if leave is not None:
                hand[:, :n], first[:, :n] = leave
            copy_into(self.leave[:, :b], hand)
            copy_into(self.first[:, :b], first)
        prompts = np.zeros((layers, b), dtype=np.int32)
        prompts[:, :n] = (np.array([s.prefill_end for s in seqs], dtype=np.int64)[None, :]
                          - np.array([s.history_gap for s in seqs], dtype=np.int64).T)  # as the runner's `prepare`
        copy_into(self.prompts[:, :b], prompts)
        if self.rows is not None:
            scratch = self.runner.attention.scratch_row
            copy_into(self.rows[:b], [scratch if s.row is None else s.row for s in seqs] + [scratch] * pad)
        if self.resid is not None:  # padding rows: 0 (their context is empty)
            resid = np.zeros((layers, b), dtype=np.int32)
            resid[:, :n] = np.array([s.resid_lens for s in seqs], dtype=np.int32).T
            copy_into(self.resid[:, :b], resid)
        # Page tables: rebuilt rows travel whole (the whole block when many did), appended pages
        # one entry each (stale entries past a row's table, and in padding rows, are never read:
        # kernels stop at the row's context length, 0 for padding).
        width = self._host_tables.shape[2]
        if len(rebuilt) > n // 4:
            copy_into(self.tables[:, :n, :width], self._host_tables[:, :n])
        else:
            for i in rebuilt:
                copy_into(self.tables[:, i, :width], self._host_tables[:, i])
            if appended is not None:
                self._scatter_pages(*appended)
        if with_starts:  # padding rows start at 0 (their context is empty anyway)
            starts = np.zeros((layers, b, self._host_starts.shape[2]), dtype=np.int32)
            starts[:, :n] = self._host_starts[:, :n]
            copy_into(self.starts[:, :b], starts)
        if feed is not None:
            feed_pending(self.input_ids, feed[0], feed[1], list(range(n + 1)))
        return key

    def _update_mirror(self, seqs) -> tuple[list[int], tuple[np.ndarray, np.ndarray] | None]:
        """Brings the mirror rows up to the batch's sequences: a row whose sequence only resized its
        tables' ends since its last load (`Sequence.resized_since`) gets just the entries past its
        copy's end or its lowest truncation, read from its tables; any other row whose sequence or
        tables changed is rewritten from the runner's arrays (every row when the mirror must widen).
        Returns (rewritten rows, (flat indices into the device tables, page ids) of the appended
        entries, or None when there are none)."""
        tables = self.runner.tables
        rebuilt: list[int] = []
        layer_of, row_of, col_of, values = [], [], [], []  # one entry per appended page
        for i, seq in enumerate(seqs):
            loaded = self._loaded[i]
            grown = None
            if loaded is not None and loaded[0] == seq.seq_id:
                if loaded[1] == seq.tables_version:
                    continue
                log = seq.resized_since(loaded[1], loaded[2])
                grown = None if log is None else split_resized(log)
            self._loaded[i] = (seq.seq_id, seq.tables_version, len(seq.resized_layers))
            if grown is None:
                rebuilt.append(i)
                continue
            lens, page_tables = self._row_lens[i], seq.page_tables
            for layer, low in grown.items():
                table = page_tables[layer]
                first = lens[layer] if low is None else min(lens[layer], low)  # re-grown after a truncation
                end = lens[layer] = len(table)
                for col in range(first, end):
                    layer_of.append(layer)
                    row_of.append(i)
                    col_of.append(col)
                values += tables.local(layer, table[first:end])
        longest = max((tables.longest(seqs[i]) for i in rebuilt), default=0)
        if col_of:
            longest = max(longest, max(col_of) + 1)
        if longest > self._host_tables.shape[2]:  # widen (rare): every row is rewritten
            width = min(max(longest, 2 * self._host_tables.shape[2]), self.tables.shape[2])
            self._host_tables = np.zeros((self.runner.num_layers, len(self._loaded), width), dtype=np.int32)
            self._loaded = [None] * len(self._loaded)
            for i, seq in enumerate(seqs):
                self._loaded[i] = (seq.seq_id, seq.tables_version, len(seq.resized_layers))
            rebuilt, col_of = list(range(len(seqs))), []
        for i in rebuilt:
            seq = seqs[i]
            arr = tables.array(seq)
            w = min(arr.shape[1], self._host_tables.shape[2])
            self._host_tables[:, i, :w] = arr[:, :w]
            self._host_tables[:, i, w:] = 0
            self._row_lens[i] = list(tables.lengths(seq))
            has = seq.has_kv_starts
            self._row_starts[i] = has
            self._host_starts[:, i] = tables.starts_array(seq) if has else 0
        if not col_of:
            return rebuilt, None
        layer, row, col = (np.array(idx, dtype=np.int64) for idx in (layer_of, row_of, col_of))
        page_ids = np.array(values, dtype=np.int64)
        self._host_tables[layer, row, col] = page_ids
        _, rows, width = self.tables.shape
        return rebuilt, ((layer * rows + row) * width + col, page_ids)

    def _scatter_pages(self, index: np.ndarray, values: np.ndarray) -> None:
        """Writes page ids into the device tables at flat indices: both in one pinned copy, then
        one scatter on the device."""
        both = to_device(np.stack([index, values]), self.tables.device)
        self.tables.view(-1).index_copy_(0, both[0], both[1].to(torch.int32))
