"""Runs one scheduled step through the model: builds the step's tensors, calls the model with
paged attention, and samples the sequences that reached the end of their known tokens.

Decode-only steps on a GPU replay CUDA graphs captured per batch-size and context bucket
(runtime/decode_graphs.py); everything else (prefill chunks, mixed steps, CPU) runs eagerly.

Positions are logical (`num_computed_tokens` onward); slots, tables and lengths are physical and
per layer (`kv_lens`, `page_tables`), plus per-KV-head start slots (`kv_starts`) in layers that a
keep plan with per-head variable counts compacted. The method's hooks run inside the forward, per
layer, right after attention: prefill_chunk / prefill_end for prefill chunks (the layer's keep
plans are compacted at once, all sequences in one `compact_batch` call, before any later decode;
`StepOutput.compacted` tells the scheduler which pages to free, and the runner records the new
per-head start slots on the sequence; a layer that has starts is compacted over them), and the decode
hooks for decode rows (static shapes, no host sync, so they are CUDA-graph capturable; a method
with `decode_graphs = False` runs its decode steps eagerly and its decode views carry host facts
per row). After the forward, step_end runs per layer over the decoded sequences (`step_end_batch`
when the method has it, else `step_end` per sequence; eager code, also after a graph replay); its
keep plans are compacted and reported like prefill_end's.

The KV store (runtime/kv/store.py) holds every tensor of the method's KV spec; the views carry
it, and the executor (runtime/kv/executor.py) moves all of them with a keep plan and copies them
with their pages (copy-on-write). A step that writes planes owns the pages first:
every page of a decode row (the decode hook rewrites the state of every stored slot) and every
page of a layer whose prefill ends (prefill_end stores the state there, before compacting). Graph
capture sizes the decode statistics buffer for the largest bucket first, so a later eager step
never reallocates what a captured graph reads.

Copy-on-write (chain cache, runtime/chains.py): before a step writes into a page that is shared
(another holder, or named by the prefix cache), the runner copies it into one of the sequence's
`spare_pages` (set aside by the scheduler) and drops its reference on the original: at the start
of the step for a partial last page about to be appended to, and before a compaction for the
pages it rewrites. A keep plan's `tail` moves the sequence's `verbatim_from`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kvc.compiler.attention import variant_for_spec
from kvc.runtime.attention.backend import PagedAttention
from kvc.runtime.attention.metadata import AttentionMetadata
from kvc.runtime.decode_graphs import DecodeGraphs
from kvc.runtime.kv.compaction import CompactionBatch, CompactionJob, batch_of_jobs, stack_keeps
from kvc.runtime.kv.executor import KVExecutor
from kvc.runtime.kv.positions import compact_map
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.methods import resolve_method
from kvc.runtime.method_api import (DecodeRow, DecodeView, Hook, KVMethod, LayerCacheView, PrefillView, RewritePlan,
                                    StackedPlan, StepView)
from kvc.runtime.models.base import CausalLM
from kvc.runtime.sampler import sample
from kvc.runtime.scheduler import ScheduledBatch
from kvc.runtime.transfer import PendingTokens, feed_pending, to_device

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    md: AttentionMetadata
    sample_rows: list[int]  # index into the step's tokens of each sampled sequence's last token
    sample_seqs: list[int]  # index into batch.seqs


@dataclass
class StepOutput:
    sampled: dict[int, int]  # seq_id -> sampled token (filled by `resolve`)
    compacted: dict[int, dict[int, int]] = field(default_factory=dict)  # seq_id -> layer -> kept
    rewritten: dict[int, dict[int, int]] = field(default_factory=dict)  # seq_id -> layer -> residual slots left
    tokens: PendingTokens | None = None  # the sampled tokens, in the order of `seq_ids`
    seq_ids: list[int] = field(default_factory=list)

    def resolve(self) -> dict[int, int]:
        """seq_id -> sampled token; waits for the step's sampling kernels."""
        if self.tokens is not None and not self.sampled:
            self.sampled = dict(zip(self.seq_ids, self.tokens.resolve()))
        return self.sampled

    def feed(self, seqs) -> tuple[list[int], list[int]] | None:
        """For a next step over `seqs` (async scheduling): (rows of `seqs` whose input token is
        pending, their rows in this step's tokens), or None when no row's is."""
        if self.tokens is None:
            return None
        where = {seq_id: i for i, seq_id in enumerate(self.seq_ids)}
        dst = [i for i, seq in enumerate(seqs) if seq.num_computed_tokens >= len(seq.token_ids)]
        return (dst, [where[seqs[i].seq_id] for i in dst]) if dst else None


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
        method: KVMethod | None = None,
        pool: PagePool | None = None,
    ) -> None:
        self.pool = pool  # for copy-on-write of shared pages; None: pages are never shared
        self.chain_window = 0  # prefill queries a chained sequence keeps per layer (set by the engine)
        self.method = method or resolve_method("full")
        self.num_layers = model.spec.num_layers
        self.model = model
        self.attention = attention
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.device = device
        self.scale = model.spec.head_dim**-0.5
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.num_kv_heads = model.spec.num_kv_heads
        self.tables = _TableCache(self.num_layers, self.num_kv_heads)
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)
        self.store = attention.store  # every tensor of the method's KV spec (runtime/kv/store.py)
        # the attention kernels, chosen by the spec (dense or encoded K/V), the decode statistics the
        # method reads, and whether its decode hook gives read plans
        attention.use_variant(variant_for_spec(self.store.spec.dense, self.method.attention.decode_stats is not None,
                                               Hook.DECODE_BEFORE_ATTENTION in self.method.hooks))
        self.executor = KVExecutor(self.store, pool, "triton" if attention.backend == "triton" else "auto")
        self.planes = self.store.method_tensors()  # the method's per-token state: every decode row writes it
        self.graphs: DecodeGraphs | None = None
        # a residual window's rows and counts are not among the graphs' static inputs yet: such
        # specs decode eagerly
        if use_cuda_graphs and device.type == "cuda" and self.method.decode_graphs and not self.store.residual_window:
            self.graphs = DecodeGraphs(self, max_num_seqs)
            self.graphs.reserve_stats()  # before a graph captures a view of the statistics buffer

    # ---- per-request sampling state -------------------------------------------------------
    def add_request(self, seq_id: int, seed: int | None) -> None:
        if seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[seq_id] = gen

    def remove_request(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)
        self.tables.drop(seq_id)

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, needs_sample: list[bool], after: StepOutput | None = None,
            defer: bool = False) -> StepOutput:
        """Runs the step: the sampled tokens and the layers a keep plan compacted.

        `after`: the step launched before this one, whose sampled tokens (still on the device) are
        the input of this step's pending rows (async scheduling). `defer`: return once the step is
        queued, its tokens unread (`StepOutput.resolve` reads them)."""
        decode_only = batch.num_decodes == len(batch.seqs)
        output = StepOutput({})
        feed = None if after is None else after.feed(batch.seqs)
        if self.pool is not None:
            self._own_append_pages(batch)
        self._copy_rows(batch)
        if self.graphs is not None and decode_only and self.graphs.fits(len(batch.seqs)):
            logits = self.graphs.run(batch, None if feed is None else (after.tokens.device, feed))
            rows = list(range(len(batch.seqs)))
        elif _replayable(batch):  # every row takes its prefill from a record: no model layers
            inputs = self.prepare(batch, needs_sample)
            self._replay(inputs.md, batch, output)
            rows = inputs.sample_seqs
            logits = torch.stack([batch.seqs[i].replay.logits for i in rows]).to(self.device) if rows else None
        else:
            inputs = self.prepare(batch, needs_sample)
            if feed is not None:
                feed_pending(inputs.input_ids, after.tokens.device, feed, [0, *np.cumsum(batch.num_new_tokens)])
            attn = self._attn_fn(inputs.md, batch, output)
            hidden = self.model(inputs.input_ids, inputs.positions, attn)
            logits = self.model.compute_logits(hidden[inputs.sample_rows])
            rows = inputs.sample_seqs
            _record_logits(batch, rows, logits)
        if Hook.STEP_END in self.method.hooks and batch.num_decodes:
            self._step_end(batch, output)
        if not rows:
            return output
        seqs = [batch.seqs[i] for i in rows]
        tokens = sample(
            logits,
            [s.params for s in seqs],
            [self.generators.get(s.seq_id) for s in seqs],
            self.default_generator,
        )
        output.tokens, output.seq_ids = PendingTokens(tokens), [s.seq_id for s in seqs]
        if not defer:
            output.resolve()
        return output

    def _attn_fn(
        self,
        md: AttentionMetadata,
        batch: ScheduledBatch | None = None,
        output: StepOutput | None = None,
        compute: bool = True,
    ):
        """The model's attention function for this step, with the method's hooks around it.
        `batch` is None in a captured decode graph (only the decode hooks can run there).
        `compute` False: store K/V and run the hooks, but no attention (a replayed prefill's output
        is never read)."""
        attention, scale, method = self.attention, self.scale, self.method
        hooks = method.hooks
        fold = method.attention.decode_stats  # the decode statistics decode_after_attention reads
        decode_hooks = hooks & {Hook.DECODE_BEFORE_ATTENTION, Hook.DECODE_AFTER_ATTENTION}
        prefill_hooks = batch is not None and batch.num_prefills > 0 and bool(
            hooks & {Hook.PREFILL_CHUNK, Hook.PREFILL_END})
        chained = [] if batch is None or not self.chain_window else _chained_prefills(batch)
        recording = [] if batch is None else _recording_prefills(batch)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            d = md.num_decodes
            view = stats = None
            if decode_hooks and d > 0:
                if fold is not None and Hook.DECODE_AFTER_ATTENTION in hooks:  # emitted by the decode kernels
                    stats = attention.stats_request(fold, d, q.shape[1], md.max_context_len)
                view = DecodeView(layer, q[:d], k[:d], v[:d], md.block_tables[layer, :d],
                                  md.context_lens[layer, :d], self.store, scale,
                                  None if batch is None else _decode_rows(batch, layer),
                                  kv_starts=None if md.kv_starts is None else md.kv_starts[layer, :d])
            read = None
            if view is not None and Hook.DECODE_BEFORE_ATTENTION in hooks:
                read = method.decode_before_attention(layer, view)  # a ReadPlan, or None: every slot
            if compute:
                out = attention.forward(layer, q, k, v, md, scale, stats=stats, read=read)
            else:
                out = None
                attention.write(layer, k, v, md)
            for seq, rows in recording:
                seq.record.add(layer, q[rows], k[rows], v[rows])
            if view is not None and Hook.DECODE_AFTER_ATTENTION in hooks:
                view.attn_stats = None if stats is None else stats.out
                method.decode_after_attention(layer, view, out[:d])
            if prefill_hooks:
                self._prefill_hooks(layer, q, k, v, md, batch, output)
            for seq, rows in chained:  # a chain keeps its latest prefill queries (a prune scores with them)
                prev = seq.window_queries[layer]
                both = q[rows] if prev is None else torch.cat([prev, q[rows]])
                seq.window_queries[layer] = both[-self.chain_window:].clone()
            return out

        return attn

    def _replay(self, md: AttentionMetadata, batch: ScheduledBatch, output: StepOutput) -> None:
        """A step of replayed prefill chunks (runtime/prefill_record.py): per layer the recorded
        q/k/v of every row, stored and handed to the method's prefill hooks; no model layers."""
        attn = self._attn_fn(md, batch, output, compute=False)
        spans = [(seq.replay, seq.num_computed_tokens, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        for layer in range(self.num_layers):
            parts = [record.rows(layer, start, n) for record, start, n in spans]
            q, k, v = (torch.cat(x).to(self.device) for x in zip(*parts))
            attn(layer, q, k, v)

    def _prefill_hooks(self, layer, q, k, v, md, batch: ScheduledBatch, output: StepOutput) -> None:
        """prefill_chunk for every prefill chunk of the step, then prefill_end for the chunks that
        end their sequence's prefill; their keep plans are compacted together (one call), their
        rewrite plans re-encoded."""
        method = self.method
        starts = np.cumsum([0, *batch.num_new_tokens]).tolist()  # host rows of each sequence's chunk
        jobs: list[tuple[object, CompactionJob]] = []
        for i in range(batch.num_decodes, len(batch.seqs)):
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            rows = slice(starts[i], starts[i] + n)
            table = seq.page_tables[layer]
            length = seq.kv_lens[layer] + n  # stored after this chunk (postprocess advances it)
            view = PrefillView(
                seq_id=seq.seq_id, layer=layer, num_layers=self.num_layers,
                q=q[rows], k=k[rows], v=v[rows], start=seq.num_computed_tokens,
                prompt_len=seq.prefill_end,
                cache=self._cache_view(seq, layer, length, n),
            )
            if Hook.PREFILL_CHUNK in method.hooks:
                method.prefill_chunk(layer, view)
            if not view.is_last or Hook.PREFILL_END not in method.hooks:
                continue
            if self.planes:  # prefill_end stores the state in the layer's planes
                self._own_pages(seq, layer, len(table))
            plan = method.prefill_end(layer, view)
            if plan is None:
                continue
            if isinstance(plan, RewritePlan):
                self._rewrite(seq, layer, view.cache, plan, output)
                continue
            self._own_pages(seq, layer, -(-plan.kept // self.page_size))  # copy-on-write before compaction
            logical = seq.num_computed_tokens + n
            jobs.append((seq, CompactionJob(table, length, plan.indices, plan.lengths, seq.kv_starts[layer]),
                         logical - plan.tail, logical))
        if jobs:
            batch = batch_of_jobs(self.store.token_tensors()[0], [job for _, job, _, _ in jobs])
            self._compact(layer, batch, [j[0] for j in jobs], [j[2] for j in jobs], [j[3] for j in jobs],
                          output.compacted)

    def _compact(self, layer: int, batch: CompactionBatch, seqs: list, verbatim: list[int], logical: list[int],
                 compacted: dict[int, dict[int, int]]) -> None:
        """Applies one layer's keep plans (one kernel launch on a GPU), reports the kept lengths,
        records the per-head start slots of plans with per-head variable counts and moves each
        sequence's verbatim tail (`verbatim_from`: the first logical token a keep may have dropped
        or moved, for the chain cache's rollback); a chained sequence's position map follows the plan.
        Job j of `batch` is `seqs[j]`'s."""
        physical = self.executor.compact(batch)
        uniform = batch.starts is None and bool((batch.counts == batch.widths[:, None]).all())  # no starts anywhere
        for j, (seq, length, tail_from) in enumerate(zip(seqs, physical.tolist(), verbatim)):
            per_seq = compacted.get(seq.seq_id)
            if per_seq is None:
                compacted[seq.seq_id] = {layer: length}
            else:
                per_seq[layer] = length
            if tail_from > seq.verbatim_from:
                seq.verbatim_from = tail_from
            if uniform and seq.positions is None and seq.kv_starts[layer] is None:
                continue  # equal counts over no starts: nothing more to record
            result = batch.result(j, physical)
            if seq.positions is not None:
                keep = batch.keep_of(j)
                counts = [length] * keep.shape[0] if result.starts is None else [length - s for s in result.starts]
                seq.positions[layer] = compact_map(seq.positions[layer], int(batch.lengths[j]), logical[j], keep,
                                                   counts, length)
            if result.starts is not None or seq.kv_starts[layer] is not None:
                seq.set_kv_starts(layer, result.starts)

    def _cache_view(self, seq, layer: int, length: int, new: int) -> LayerCacheView:
        """seq's layer as a hook sees it once `new` more tokens are stored (`length` slots)."""
        resid = min(seq.resid_lens[layer] + new, self.store.residual_window)
        return LayerCacheView(self.store, seq.page_tables[layer], length, seq.kv_starts[layer], layer, seq.row, resid)

    def _rewrite(self, seq, layer: int, cache: LayerCacheView, plan: RewritePlan, output: StepOutput) -> None:
        """A rewrite plan re-encoded now (copy-on-write first); the residual slots it leaves are
        reported like compacted lengths (the scheduler records them)."""
        self._own_pages(seq, layer, -(-cache.length // self.page_size))
        left = self.executor.rewrite(layer, seq.page_tables[layer], cache.length, seq.row, cache.resid_len, plan)
        output.rewritten.setdefault(seq.seq_id, {})[layer] = left

    def _copy_rows(self, batch: ScheduledBatch) -> None:
        """A chain continuation's row starts as its record's (rows are never shared)."""
        for seq in batch.seqs:
            if seq.row_source is not None:
                self.store.copy_rows([seq.row_source], [seq.row])
                seq.row_source = None

    def _step_end(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """step_end per layer of every sequence that decoded in this step (`step_end_batch`, one call
        per layer, when the method has it); each layer's keep plans are compacted at once and
        reported (the scheduler frees the pages past them). Host work per layer is Python per row
        (views, bookkeeping) plus numpy and a few torch calls: the page tables come from the
        runner's cached arrays, and plans sharing a tensor (`StackedPlan`) move as one."""
        method, page = self.method, self.page_size
        decoded = batch.seqs[: batch.num_decodes]
        batched = method.step_end_batch
        num_layers, cache_view = self.num_layers, self._cache_view
        packed = versions = None  # [L, B, W] page tables of `decoded`, built once the first layer compacts
        due_fn = method.step_end_due
        # host facts of every row and layer, for the method's cheap "may it evict now"
        gaps = np.array([seq.history_gap for seq in decoded], dtype=np.int64)  # [B, L]
        lengths = np.array([seq.kv_lens for seq in decoded], dtype=np.int64) + 1  # the step's token is stored
        contexts = np.array([seq.num_computed_tokens + 1 for seq in decoded], dtype=np.int64)[:, None] - gaps
        prompts = np.array([seq.prefill_end for seq in decoded], dtype=np.int64)[:, None] - gaps
        everyone = list(range(len(decoded)))
        for layer in range(num_layers):
            candidates = everyone
            due = due_fn(layer, lengths[:, layer], prompts[:, layer], contexts[:, layer])
            if due is not None:
                if not due.any():
                    continue  # no row evicts in this layer at this step (an eviction interval's steps between)
                if not due.all():
                    candidates = np.flatnonzero(due).tolist()
            views = [StepView(seq.seq_id, layer, num_layers, seq.num_computed_tokens + 1 - seq.history_gap[layer],
                              seq.prefill_end - seq.history_gap[layer],  # a chain's prompt: stored history + suffix
                              cache_view(seq, layer, seq.kv_lens[layer] + 1, 1))  # the step's token is stored
                     for seq in (decoded if candidates is everyone else [decoded[i] for i in candidates])]
            plans = batched(layer, views)
            if len(plans) != len(views):
                raise RuntimeError(f"method {method.name!r}: step_end_batch gave {len(plans)} plans for "
                                   f"{len(views)} sequences")
            found = [i for i, plan in enumerate(plans) if plan is not None]  # indices into `candidates`
            if found and any(isinstance(plans[i], RewritePlan) for i in found):
                for i in [i for i in found if isinstance(plans[i], RewritePlan)]:
                    self._rewrite(decoded[candidates[i]], layer, views[i].cache, plans[i], output)
                found = [i for i in found if not isinstance(plans[i], RewritePlan)]
            if not found:
                continue
            rows = [candidates[i] for i in found]
            every = len(rows) == len(decoded)  # the common case: every row evicts
            if packed is None:
                width = max(self.tables.longest(seq) for seq in decoded)
                packed, versions = self.tables.pack_numpy(decoded, width), [s.tables_version for s in decoded]
            if self.pool is not None:
                for i, row in zip(found, rows):
                    seq = decoded[row]
                    if seq.spare_pages:  # copy-on-write before compaction; a table it changes is re-read
                        self._own_pages(seq, layer, -(-plans[i].kept // page))
                        if seq.tables_version != versions[row]:
                            self._refresh_table(packed, row, seq)
                            versions[row] = seq.tables_version
            seqs = decoded if every else [decoded[row] for row in rows]
            kept = plans if every else [plans[i] for i in found]
            job_views = views if every else [views[i] for i in found]
            logical = [seq.num_computed_tokens + 1 for seq in seqs]
            jobs = self._plan_batch(layer, kept, job_views, packed[layer] if every else packed[layer, rows])
            self._compact(layer, jobs, seqs, [n - plan.tail for n, plan in zip(logical, kept)], logical,
                          output.compacted)

    def _refresh_table(self, packed: np.ndarray, row: int, seq) -> None:
        """Row `row` of the step's packed tables after copy-on-write changed seq's tables."""
        arr = self.tables.array(seq)
        width = min(packed.shape[2], arr.shape[1])
        packed[:, row] = 0
        packed[:, row, :width] = arr[:, :width]

    def _plan_batch(self, layer: int, plans: list, views: list[StepView], tables: np.ndarray) -> CompactionBatch:
        """One layer's step-end plans as a `CompactionBatch`: plans over one tensor (a `StackedPlan`'s
        stack, or one shared plan) gathered once; counts, lengths and starts as numpy."""
        device = self.store.device
        sources = [(plan.stack, plan.row) if isinstance(plan, StackedPlan) else (plan.indices, None) for plan in plans]
        caches = [view.cache for view in views]
        lengths = np.array([cache.length for cache in caches], dtype=np.int64)
        pages = np.array([len(cache.page_ids) for cache in caches], dtype=np.int64)
        starts = None
        if any(cache.starts is not None for cache in caches):
            starts = np.array([cache.starts or [0] * self.num_kv_heads for cache in caches], dtype=np.int64)
        keep, pos, widths = stack_keeps(sources, device)
        if keep.shape[1] != self.num_kv_heads:
            raise RuntimeError(f"method {self.method.name!r}: keep plans of layer {layer} have {keep.shape[1]} KV "
                               f"heads, the model {self.num_kv_heads}")
        counts = np.repeat(widths[:, None], keep.shape[1], axis=1)
        for j, plan in enumerate(plans):
            if plan.lengths is not None:  # per-head variable counts (compiled methods keep them on the CPU)
                counts[j] = plan.lengths.detach().cpu().numpy()
        return CompactionBatch(keep, pos, widths, counts, lengths, tables, pages, starts)

    # ---- copy-on-write -----------------------------------------------------------------------
    # The scheduler sets aside one spare page per shared page a step writes (`Scheduler._copies`),
    # so a sequence without spare pages writes into no shared page: its tables are not walked
    # (the hot path of every decode step, and of every keep plan of decode-time eviction).
    def _own_append_pages(self, batch: ScheduledBatch) -> None:
        """Each sequence's partial last page, which this step appends to, becomes its own (every
        page of a decode row when the decode hook writes state planes)."""
        page = self.page_size
        for i, seq in enumerate(batch.seqs):
            if not seq.spare_pages:
                continue
            if self.planes and i < batch.num_decodes:
                for layer, table in enumerate(seq.page_tables):
                    self._own_pages(seq, layer, len(table))
                continue
            for layer, kv in enumerate(seq.kv_lens):
                if kv % page:
                    self._own_page(seq, layer, kv // page)

    def _own_pages(self, seq, layer: int, count: int) -> None:
        """The first `count` pages of seq's layer table become its own (a compaction rewrites them)."""
        if self.pool is not None and seq.spare_pages:
            for index in range(min(count, len(seq.page_tables[layer]))):
                self._own_page(seq, layer, index)

    def _own_page(self, seq, layer: int, index: int) -> None:
        if self.executor.own_page(seq.page_tables[layer], index, seq.spare_pages):
            seq.tables_version += 1

    def prepare(self, batch: ScheduledBatch, needs_sample: list[bool]) -> StepInputs:
        """Flattens the batch into token ids, logical positions, and per-layer slots and tables."""
        page = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[np.ndarray] = []  # per sequence [L, n]: new tokens go after each layer's stored ones
        cu = [0]
        ctx: list[list[int]] = []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        tables_np = self.tables.pack_numpy(batch.seqs, max(len(t) for s in batch.seqs for t in s.page_tables))
        starts_np = self.tables.pack_starts(batch.seqs)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            known = seq.token_ids[start : start + n]
            ids.extend(known + [0] * (n - len(known)))  # a pending token: the caller feeds it
            positions.extend(range(start, start + n))
            kv = np.asarray(seq.kv_lens, dtype=np.int64)
            phys = kv[:, None] + np.arange(n, dtype=np.int64)[None, :]  # [L, n] physical offsets
            pages = np.take_along_axis(tables_np[:, i, :], phys // page, axis=1)
            slots.append(pages.astype(np.int64) * page + phys % page)
            ctx.append((kv + n).tolist())
            cu.append(cu[-1] + n)
            if needs_sample[i]:
                sample_rows.append(cu[-1] - 1)
                sample_seqs.append(i)
        tables = torch.from_numpy(tables_np)
        dev = self.device
        ctx = [list(c) for c in zip(*ctx)]  # [L, B]
        slots = np.concatenate(slots, axis=1)

        def to_dev(values, dtype=None):
            return to_device(values, dev, dtype)

        rows = resid = None
        window = self.store.residual_window
        if window:  # the per-sequence rows and each layer's residual slots after the step
            scratch = self.store.scratch_row
            rows = to_dev([scratch if s.row is None else s.row for s in batch.seqs], torch.int32)
            counts = np.minimum(np.array([s.resid_lens for s in batch.seqs], dtype=np.int64).T +
                                np.asarray(batch.num_new_tokens, dtype=np.int64)[None, :], window)
            resid = to_dev(counts, torch.int32)
        md = AttentionMetadata(
            slot_mapping=to_dev(slots),
            block_tables=to_dev(tables),
            cu_seqlens_q=to_dev(cu, torch.int32),
            context_lens=to_dev(ctx, torch.int32),
            num_decodes=batch.num_decodes,
            max_query_len=max(batch.num_new_tokens),
            max_context_len=max(max(c) for c in ctx),
            kv_starts=None if starts_np is None else to_dev(starts_np),
            rows=rows,
            resid_lens=resid,
        )
        return StepInputs(to_dev(ids, torch.int64), to_dev(positions, torch.int64), md, sample_rows, sample_seqs)


def _chained_prefills(batch: ScheduledBatch) -> list[tuple[object, slice]]:
    """The step's prefill chunks of chained sequences, with their rows in the step's tokens."""
    if batch.num_prefills == 0:
        return []
    out, start = [], 0
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        if i >= batch.num_decodes and seq.window_queries is not None:
            out.append((seq, slice(start, start + n)))
        start += n
    return out


def _recording_prefills(batch: ScheduledBatch) -> list[tuple[object, slice]]:
    """The step's prefill chunks of sequences recording their prefill (runtime/prefill_record.py),
    with the rows of their prompt's tokens in the step's tokens. A chunk that does not continue the
    record where it stopped (a prefix-cache hit skipped tokens) invalidates it; a preempted
    sequence's recompute from token 0 starts it again."""
    if batch.num_prefills == 0:
        return []
    out, start = [], 0
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        record = seq.record
        if i >= batch.num_decodes and record is not None and not record.complete and not record.invalid:
            at = seq.num_computed_tokens
            if at == 0 and record.recorded:
                record.start(list(record.tokens), len(seq.kv_lens))
            if at != record.recorded:
                record.invalid = True
            elif at < len(record.tokens):
                out.append((seq, slice(start, start + min(n, len(record.tokens) - at))))
        start += n
    return out


def _record_logits(batch: ScheduledBatch, rows: list[int], logits: torch.Tensor) -> None:
    """Keeps the logits of a recording sequence's last prompt token (its record's first token)."""
    for j, i in enumerate(rows):
        seq = batch.seqs[i]
        record = seq.record
        if record is None or record.logits is not None or record.invalid or i < batch.num_decodes:
            continue
        if seq.num_computed_tokens + batch.num_new_tokens[i] == len(record.tokens) == record.recorded:
            record.logits = logits[j].detach().float().clone()


def _replayable(batch: ScheduledBatch) -> bool:
    """Whether every row of the step is a prefill chunk its sequence's record covers."""
    return batch.num_decodes == 0 and all(
        seq.replay is not None and seq.replay.covers(seq.num_computed_tokens, n)
        for seq, n in zip(batch.seqs, batch.num_new_tokens))


def _decode_rows(batch: ScheduledBatch, layer: int) -> list[DecodeRow]:
    """Host facts of the step's decode rows in one layer (eager steps)."""
    return [DecodeRow(s.seq_id, s.kv_lens[layer] + 1, s.num_computed_tokens + 1 - s.history_gap[layer],
                      s.prefill_end - s.history_gap[layer])
            for s in batch.seqs[: batch.num_decodes]]


class _Tables:
    """One sequence's cached arrays (`_TableCache`) and the tables snapshot they hold."""

    __slots__ = ("version", "mark", "array", "lens", "longest", "starts")

    def __init__(self, version: int, mark: int, array: np.ndarray, lens: list[int]) -> None:
        self.version, self.mark = version, mark  # (tables_version, len(grown_layers)) when last synced
        self.array = array  # [L, W] int32, W >= the longest table; zeros past each table
        self.lens = lens  # pages of each layer's table
        self.longest = max(1, max(lens, default=0))
        self.starts: np.ndarray | None = None  # [L, Hkv] int32, built on first use


class _TableCache:
    """Per-sequence [L, W] int32 copies of the page tables (W >= its longest table) and [L, Hkv]
    KV-head start slots, kept in step with the sequence's `tables_version`: most decode steps reuse
    them, and a step that only appended pages (`Sequence.grown_since`, the scheduler's page-boundary
    growth) writes just those pages; any other change rebuilds them (L list-to-array conversions).
    So with per-layer lengths (PyramidKV, Ada-KV), where some layer of nearly every row crosses a
    page boundary at every step, a step costs a few entries per row, not L x B conversions."""

    def __init__(self, num_layers: int, num_kv_heads: int = 1) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self._entries: dict[int, _Tables] = {}

    def _sync(self, seq) -> _Tables:
        entry = self._entries.get(seq.seq_id)
        if entry is not None and entry.version == seq.tables_version:
            return entry
        grown = None if entry is None else seq.grown_since(entry.version, entry.mark)
        if grown is None:
            entry = self._rebuild(seq)
        else:
            for layer in set(grown):
                self._append(entry, layer, seq.page_tables[layer])
            entry.version, entry.mark = seq.tables_version, len(seq.grown_layers)
        return entry

    def _rebuild(self, seq) -> _Tables:
        tables = seq.page_tables
        lens = [len(t) for t in tables]
        arr = np.zeros((self.num_layers, max(1, max(lens, default=0))), dtype=np.int32)
        for layer, table in enumerate(tables):
            arr[layer, : len(table)] = table
        entry = _Tables(seq.tables_version, len(seq.grown_layers), arr, lens)
        self._entries[seq.seq_id] = entry
        return entry

    @staticmethod
    def _append(entry: _Tables, layer: int, table: list[int]) -> None:
        """Writes the pages appended to `layer`'s table since the entry's copy of it."""
        old, new = entry.lens[layer], len(table)
        width = entry.array.shape[1]
        if new > width:  # widen with slack: the longest layer grows a page at a time
            wider = np.zeros((entry.array.shape[0], max(new, width + max(8, width // 8))), dtype=np.int32)
            wider[:, :width] = entry.array
            entry.array = wider
        entry.array[layer, old:new] = table[old:new]
        entry.lens[layer] = new
        entry.longest = max(entry.longest, new)

    def array(self, seq) -> np.ndarray:
        """seq's [L, W] int32 page tables (W >= its longest table, zeros past each table). The
        array is updated in place by later appends: copy what must stay as it is now."""
        return self._sync(seq).array

    def lengths(self, seq) -> list[int]:
        """Pages of each of seq's layer tables (read-only)."""
        return self._sync(seq).lens

    def longest(self, seq) -> int:
        """Pages of seq's longest layer table (at least 1)."""
        return self._sync(seq).longest

    def starts_array(self, seq) -> np.ndarray:
        """seq's [L, Hkv] int32 KV-head start slots (0 where a layer has none), cached."""
        entry = self._sync(seq)  # appended pages keep the starts; any other change rebuilt the entry
        if entry.starts is None:
            arr = np.zeros((self.num_layers, self.num_kv_heads), dtype=np.int32)
            for layer, starts in enumerate(seq.kv_starts):
                if starts is not None:
                    arr[layer] = starts
            entry.starts = arr
        return entry.starts

    def pack(self, seqs, width: int) -> torch.Tensor:
        """[L, B, width] int32 page tables of `seqs`, zero-padded."""
        return torch.from_numpy(self.pack_numpy(seqs, width))

    def pack_numpy(self, seqs, width: int) -> np.ndarray:
        out = np.zeros((self.num_layers, len(seqs), width), dtype=np.int32)
        for i, seq in enumerate(seqs):
            arr = self.array(seq)
            w = min(width, arr.shape[1])
            out[:, i, :w] = arr[:, :w]
        return out

    def pack_starts(self, seqs) -> np.ndarray | None:
        """[L, B, Hkv] int32 KV-head start slots of `seqs`, or None when every one is 0 (the
        kernels then run without them)."""
        if not any(seq.has_kv_starts for seq in seqs):
            return None
        out = np.zeros((self.num_layers, len(seqs), self.num_kv_heads), dtype=np.int32)
        for i, seq in enumerate(seqs):
            if seq.has_kv_starts:
                out[:, i] = self.starts_array(seq)
        return out

    def drop(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)
