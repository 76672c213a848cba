"""Runs one scheduled step through the model: builds the step's tensors, calls the model with
paged attention, and samples the sequences that reached the end of their known tokens.

Decode-only steps on a GPU replay CUDA graphs captured per batch-size bucket; everything else
(prefill chunks, mixed steps, CPU) runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from kvc.runtime.attention.backend import PagedAttention
from kvc.runtime.attention.metadata import AttentionMetadata
from kvc.runtime.models.base import CausalLM
from kvc.runtime.sampler import sample
from kvc.runtime.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    md: AttentionMetadata
    sample_rows: list[int]  # index into the step's tokens of each sampled sequence's last token
    sample_seqs: list[int]  # index into batch.seqs


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        attention: PagedAttention,
        page_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        use_cuda_graphs: bool,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.attention = attention
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.device = device
        self.scale = model.spec.head_dim**-0.5
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)
        self.graphs: _DecodeGraphs | None = None
        if use_cuda_graphs and device.type == "cuda":
            self.graphs = _DecodeGraphs(self, max_num_seqs)

    # ---- per-request sampling state -------------------------------------------------------
    def add_request(self, seq_id: int, seed: int | None) -> None:
        if seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[seq_id] = gen

    def remove_request(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, needs_sample: list[bool]) -> dict[int, int]:
        """Runs the step; returns {seq_id: sampled token} for the sequences that sample."""
        decode_only = batch.num_decodes == len(batch.seqs)
        if self.graphs is not None and decode_only and self.graphs.fits(len(batch.seqs)):
            logits = self.graphs.run(batch)
            rows = list(range(len(batch.seqs)))
        else:
            inputs = self.prepare(batch, needs_sample)
            hidden = self.model(inputs.input_ids, inputs.positions, self._attn_fn(inputs.md))
            logits = self.model.compute_logits(hidden[inputs.sample_rows])
            rows = inputs.sample_seqs
        if not rows:
            return {}
        seqs = [batch.seqs[i] for i in rows]
        tokens = sample(
            logits,
            [s.params for s in seqs],
            [self.generators.get(s.seq_id) for s in seqs],
            self.default_generator,
        ).tolist()
        return {s.seq_id: t for s, t in zip(seqs, tokens)}

    def _attn_fn(self, md: AttentionMetadata):
        attention, scale = self.attention, self.scale

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention.forward(layer, q, k, v, md, scale)

        return attn

    def prepare(self, batch: ScheduledBatch, needs_sample: list[bool]) -> StepInputs:
        """Flattens the batch into token ids, positions, slots and page tables."""
        page = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        ctx: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            table = seq.page_table
            ids.extend(seq.token_ids[start : start + n])
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(table[p // page] * page + p % page for p in span)
            cu.append(cu[-1] + n)
            ctx.append(start + n)
            if needs_sample[i]:
                sample_rows.append(cu[-1] - 1)
                sample_seqs.append(i)
        width = max(len(s.page_table) for s in batch.seqs)
        tables = torch.zeros((len(batch.seqs), width), dtype=torch.int32)
        for i, seq in enumerate(batch.seqs):
            tables[i, : len(seq.page_table)] = torch.tensor(seq.page_table, dtype=torch.int32)
        dev = self.device

        def to_dev(values, dtype):
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        md = AttentionMetadata(
            slot_mapping=to_dev(slots, torch.int64),
            block_tables=tables.to(dev, non_blocking=True),
            cu_seqlens_q=to_dev(cu, torch.int32),
            context_lens=to_dev(ctx, torch.int32),
            num_decodes=batch.num_decodes,
            max_query_len=max(batch.num_new_tokens),
            max_context_len=max(ctx),
        )
        return StepInputs(to_dev(ids, torch.int64), to_dev(positions, torch.int64), md, sample_rows, sample_seqs)


class _DecodeGraphs:
    """CUDA graphs of decode-only steps, one per batch-size bucket, sharing one memory pool."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int) -> None:
        self.runner = runner
        self.buckets = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512) if b < max_num_seqs]
        self.buckets.append(max_num_seqs)
        n, dev = self.buckets[-1], runner.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((n, runner.max_pages_per_seq), dtype=torch.int32, device=dev)
        self.ctx = torch.zeros(n, dtype=torch.int32, device=dev)
        self.cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def _capture(self, b: int) -> None:
        r = self.runner
        md = AttentionMetadata(
            slot_mapping=self.slots[:b],
            block_tables=self.tables[:b],
            cu_seqlens_q=self.cu[: b + 1],
            context_lens=self.ctx[:b],
            num_decodes=b,
            max_query_len=1,
            max_context_len=r.max_model_len,
        )
        attn = r._attn_fn(md)

        def step() -> torch.Tensor:
            return r.model.compute_logits(r.model(self.input_ids[:b], self.positions[:b], attn))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile kernels and settle allocations outside the graph
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[b] = step()
        self.pool = graph.pool()
        self.graphs[b] = graph
        log.debug("captured decode graph for batch %d", b)

    def capture_all(self) -> None:
        for b in reversed(self.buckets):
            self._capture(b)

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        n = len(batch.seqs)
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        if b not in self.graphs:
            self._capture(b)
        page = self.runner.page_size
        ids, pos, slots = [], [], []
        tables = torch.zeros((b, self.tables.shape[1]), dtype=torch.int32)
        ctx = torch.zeros(b, dtype=torch.int32)
        for i, seq in enumerate(batch.seqs):
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.page_table[p // page] * page + p % page)
            tables[i, : len(seq.page_table)] = torch.tensor(seq.page_table, dtype=torch.int32)
            ctx[i] = p + 1
        pad = b - n
        self.input_ids[:b].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(pos + [0] * pad), non_blocking=True)
        self.slots[:b].copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        self.tables[:b].copy_(tables, non_blocking=True)
        self.ctx[:b].copy_(ctx, non_blocking=True)
        self.graphs[b].replay()
        return self.logits[b][:n]
