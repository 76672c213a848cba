"""One attention group of a step: the lanes (runtime/lanes.py) whose attention is one launch per layer.

Pipeline position: the model runner (runtime/model_runner.py) splits a step's rows by group; each
group builds its rows' tensors (`prepare`: slots, tables, lengths, KV-head starts, residual counts)
and gives the model's attention function over them (`attn_fn`): the group's paged attention, with
each lane's hooks around it. A group holds one `PagedAttention` (the pool's stores and the kernels
its lanes' specs need), its page tables, plan executors and decode graphs; every lane of it keeps
its own method, hooks and replay pass. Lanes share a group when their attention is the same launch:
the same storage classes and kernels, and no decode hook (read plans and decode statistics are one
method's); every other lane is a group of its own. docs/design.md, "One step of the engine" and
"Many methods in one batch".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvc.compiler.attention import variant_for_spec
from kvc.runtime.attention.backend import PagedAttention
from kvc.runtime.attention.metadata import AttentionMetadata
from kvc.runtime.decode_graphs import DecodeGraphs
from kvc.runtime.errors import ConfigError
from kvc.runtime.kv.executor import KVExecutor
from kvc.runtime.kv.layout import CacheLayout
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.kv.ring import ring_offsets
from kvc.runtime.kv.tables import TableCache
from kvc.runtime.method_api import DecodeRow, DecodeView, Hook
from kvc.runtime.models.base import CausalLM, LatentQueries
from kvc.runtime.scheduler import ScheduledBatch
from kvc.runtime.step_hooks import StepHooks
from kvc.runtime.transfer import to_device

if TYPE_CHECKING:
    from kvc.runtime.lanes import Lane
    from kvc.runtime.model_runner import StepOutput

DECODE_HOOKS = frozenset({Hook.DECODE_BEFORE_ATTENTION, Hook.DECODE_AFTER_ATTENTION})


def shares_attention(lane: Lane) -> bool:
    """May `lane` share its attention launch with other lanes of its storage: no decode hook (a read
    plan or decode statistics are its method's alone) and no replay pass (which re-runs the model on
    the group's own)."""
    method = lane.method
    return not (method.hooks & DECODE_HOOKS) and method.replay is None


def variants_of(lane: Lane, stores) -> list[str]:
    """The attention variant of each store for `lane`'s method (those its layers do not use: plain)."""
    method, used = lane.method, set(lane.layer_class)
    return [variant_for_spec(st.spec.dense, method.attention.decode_stats is not None,
                             Hook.DECODE_BEFORE_ATTENTION in method.hooks, st.spec.low_rank, st.spec.delta is not None,
                             st.spec.latent) if c in used else "plain"
            for c, st in enumerate(stores)]


class SpecGroup:
    def __init__(self, lanes: list[Lane], model: CausalLM, attention: PagedAttention, page_size: int,
                 max_model_len: int, max_num_seqs: int, device: torch.device, use_cuda_graphs: bool,
                 pool: PagePool | None) -> None:
        """`attention`: over every store of the pool, the layers' classes those of the lanes (all alike)."""
        self.lanes = lanes
        self.method = lanes[0].method  # the group's decode kernels are its first lane's (every lane's, when shared)
        self.pool = pool
        self.chain_window = 0  # prefill queries a chained sequence keeps per layer (set by the runner)
        self.layout = CacheLayout.of(model.spec, self.method)
        self.num_layers = self.layout.layers
        self.model = model
        self.attention = attention
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.device = device
        self.scale = model.spec.scale
        # hooks score with the language's q . k / sqrt(d) (docs/language.md); where the model's softmax scale
        # is another (MLA: qk_head_dim^-1/2 over wider absorbed queries) they see q times scale * sqrt(d), so
        # their logits and attention are the model's (docs/design.md, "MLA")
        spec = model.spec
        self.hook_scale = None if spec.attention_scale is None else spec.scale * spec.head_dim ** 0.5
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.num_kv_heads = self.layout.kv_heads
        # the tables the kernels see index each layer's store: pool ids less its class's first page
        self.tables = TableCache(self.num_layers, self.num_kv_heads,
                                 [attention.page_starts[c] for c in attention.layer_class])
        if any(st.spec.prerope for st in attention.used):  # keys stored before RoPE: rotated with the model's RoPE
            rotary = getattr(model, "rotary", None)
            if rotary is None:
                raise ConfigError(f"method {self.method.name!r} stores keys before RoPE; the model "
                                  f"{type(model).__name__} has no rotary embedding to read them with", param="method")
            attention.use_rope(rotary.inv_freq)
        # the attention kernels of each storage class, chosen by its spec (dense or encoded K/V), the
        # decode statistics the method reads, and whether its decode hook gives read plans
        attention.use_variants(variants_of(lanes[0], attention.stores))
        # a plan executor per storage class its layers use (each moves its store's tensors; pages by store index)
        used = set(attention.layer_class)
        self.executors = [KVExecutor(st, pool, "triton" if attention.backend == "triton" else "auto",
                                     restore=attention.store_fresh, copy_pages=attention.copy_pages)
                          if c in used else None for c, st in enumerate(attention.stores)]
        self.executor = self.executors[attention.layer_class[0]]
        for lane in lanes:
            lane.group = self
            lane.hooks = StepHooks(lane.method, attention.stores, self.executors, self.tables, pool, self.num_layers,
                                   copy_rows=attention.copy_rows, layer_class=attention.layer_class)
        # delta-coded layers' stores: their decode rows' due blocks are compressed before each step (`compress_due`)
        self.delta_sources = {layer: source for layer in range(self.num_layers)
                              if (source := attention.delta_source(layer)) is not None}
        self.graphs: DecodeGraphs | None = None
        # the torch backend decodes eagerly: its writes sync with the host
        if (use_cuda_graphs and device.type == "cuda" and attention.backend != "torch"
                and all(lane.method.decode_graphs for lane in lanes)):
            self.graphs = DecodeGraphs(self, max_num_seqs)
            self.graphs.reserve_stats()  # before a graph captures a view of the statistics buffer

    @property
    def hooks(self) -> StepHooks:
        """The first lane's hooks (a group of one lane: its method's)."""
        return self.lanes[0].hooks

    @property
    def replay(self):
        """The replay pass of a one-lane group (runtime/context_replay.py); None: none."""
        return self.lanes[0].replay

    def lane_batches(self, batch: ScheduledBatch) -> list[tuple[Lane, ScheduledBatch]]:
        """Each lane's rows of the group's `batch` as a batch of their own (decodes first); one lane: `batch`."""
        if len(self.lanes) == 1:
            return [(self.lanes[0], batch)]
        out = []
        for lane in self.lanes:
            rows = [i for i, seq in enumerate(batch.seqs) if seq.lane is lane]
            if rows:
                out.append((lane, ScheduledBatch([batch.seqs[i] for i in rows], [batch.num_new_tokens[i] for i in rows],
                                                 sum(i < batch.num_decodes for i in rows))))
        return out

    def begin(self, batch: ScheduledBatch) -> None:
        """Before the forward: pages the step writes become the rows' own, continuations' rows are
        copied, delta-coded blocks that come due are compressed."""
        for lane, rows in self.lane_batches(batch):
            if self.pool is not None:
                lane.hooks.own_append_pages(rows)
            lane.hooks.copy_rows(rows)
        self.compress_due(batch)

    def compress_due(self, batch: ScheduledBatch) -> None:
        """Delta-coded layers (runtime/kv/delta_pages.py): the blocks the decode rows' new tokens bring
        due, compressed before the step, eagerly, so that the step itself stores only the tokens, on the
        device (a CUDA graph replays it)."""
        for seq in batch.seqs[:batch.num_decodes] if self.delta_sources else ():
            for layer, source in self.delta_sources.items():
                if source.due(seq.kv_lens[layer]):
                    table = torch.tensor(self.tables.local(layer, seq.page_tables[layer]), device=self.device)
                    source.compress_due(table, seq.row, seq.kv_lens[layer])

    def _attn_fn(self, md: AttentionMetadata, batch: ScheduledBatch | None = None,
                 output: StepOutput | None = None):
        """The model's attention function for this step (`attn(layer, q, k, v)` over model layers),
        with the lanes' hooks around it. `batch` is None in a captured decode graph (only the
        decode hooks can run there)."""
        attn = self._cache_attn_fn(md, batch, output)
        return split_heads(attn, self.layout) if self.layout.per_head else attn

    def _cache_attn_fn(
        self,
        md: AttentionMetadata,
        batch: ScheduledBatch | None = None,
        output: StepOutput | None = None,
        compute: bool = True,
    ):
        """`attn(cache_layer, q, k, v)`: one cache layer's attention with the lanes' hooks around it.
        `compute` False: store K/V and run the hooks, but no attention (a replayed prefill's output is
        never read)."""
        attention, scale, method = self.attention, self.scale, self.method
        hooks = method.hooks if len(self.lanes) == 1 else frozenset()  # decode hooks: a lane of its own
        fold = method.attention.decode_stats  # the decode statistics decode_after_attention reads
        decode_hooks = hooks & DECODE_HOOKS
        prefills = [] if batch is None or batch.num_prefills == 0 else _lane_prefills(self, batch)
        chained = [] if batch is None or not self.chain_window else _chained_prefills(batch)
        recording = [] if batch is None else _recording_prefills(batch)
        records_queries = attention.keeps_queries  # a spec with decode query windows (runtime/kv/query_window.py)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 latent: LatentQueries | None = None) -> torch.Tensor:
            d = md.num_decodes
            view = stats = None
            hq = self.hook_queries(q)
            if decode_hooks and d > 0:
                if fold is not None and Hook.DECODE_AFTER_ATTENTION in hooks:  # emitted by the decode kernels
                    stats = attention.stats_request(fold, d, q.shape[1], md.max_context_len)
                view = DecodeView(layer, hq[:d], k[:d], v[:d], md.block_tables[layer, :d],
                                  md.context_lens[layer, :d], attention.store_of(layer),
                                  scale if self.hook_scale is None else q.shape[-1] ** -0.5,
                                  None if batch is None else _decode_rows(batch, layer),
                                  kv_starts=None if md.kv_starts is None else md.kv_starts[layer, :d],
                                  prompt_lens=None if md.prompt_lens is None else md.prompt_lens[layer, :d],
                                  max_context_len=md.max_context_len,
                                  seq_rows=None if md.rows is None else md.rows[:d],
                                  write_slots=md.slot_mapping[layer, :d],
                                  ring_leave=None if md.ring_leave is None else md.ring_leave[layer, :d],
                                  ring_first=None if md.ring_first is None else md.ring_first[layer, :d])
            read = None
            if view is not None and Hook.DECODE_BEFORE_ATTENTION in hooks:
                read = method.decode_before_attention(layer, view)  # a ReadPlan, or None: every slot
            if compute:
                out = attention.forward(layer, q, k, v, md, scale, stats=stats, read=read, latent=latent)
            else:
                out = None
                attention.write(layer, k, v, md)
            if records_queries:  # the newest queries a step_end reads (runtime/kv/query_window.py)
                attention.record_queries(layer, hq, md)
            for seq, rows in recording:
                seq.record.add(layer, q[rows], k[rows], v[rows])
            if view is not None and Hook.DECODE_AFTER_ATTENTION in hooks:
                view.attn_stats = None if stats is None else stats.out
                method.decode_after_attention(layer, view, out[:d])
            for lane_hooks, rows, part in prefills:
                lane_hooks.prefill(layer, hq[rows], k[rows], v[rows], part, output)
            for seq, rows in chained:  # a chain keeps its latest prefill queries (a prune scores with them)
                prev = seq.window_queries[layer]
                both = hq[rows] if prev is None else torch.cat([prev, hq[rows]])
                seq.window_queries[layer] = both[-self.chain_window:].clone()
            return out

        return attn

    def hook_queries(self, q: torch.Tensor) -> torch.Tensor:
        """The queries the method's hooks see (`hook_scale`)."""
        return q if self.hook_scale is None else q * self.hook_scale

    def replay_prefill(self, md: AttentionMetadata, batch: ScheduledBatch, output: StepOutput) -> None:
        """A step of replayed prefill chunks (runtime/prefill_record.py): per layer the recorded
        q/k/v of every row, stored and handed to the method's prefill hooks; no model layers."""
        attn = self._cache_attn_fn(md, batch, output, compute=False)
        spans = [(seq.replay, seq.num_computed_tokens, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        for layer in range(self.num_layers):
            parts = [record.rows(layer, start, n) for record, start, n in spans]
            q, k, v = (torch.cat(x).to(self.device) for x in zip(*parts))
            attn(layer, q, k, v)

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
        leave = None  # ([L, B] leaving slots, [L, B] ranked counts) of ranked rings (runtime/kv/ring.py `ring_offsets`)
        starts_np = self.tables.pack_starts(batch.seqs)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            known = seq.token_ids[start : start + n]
            ids.extend(known + [0] * (n - len(known)))  # a pending token: the caller feeds it
            positions.extend(range(start, start + n))
            kv = np.asarray(seq.kv_lens, dtype=np.int64)
            phys = kv[:, None] + np.arange(n, dtype=np.int64)[None, :]  # [L, n] physical offsets
            after = kv + n
            if seq.ring is not None and i < batch.num_decodes:  # a decode row's ringed layers (runtime/kv/ring.py)
                phys, after, ranked = ring_offsets(kv[:, None], [seq.ring], [start])
                after = after[:, 0]
                if ranked is not None:
                    if leave is None:
                        leave = (np.full((len(kv), len(batch.seqs)), -1, dtype=np.int64),
                                 np.zeros((len(kv), len(batch.seqs)), dtype=np.int64))
                    leave[0][:, i], leave[1][:, i] = ranked[0][:, 0], ranked[1][:, 0]
            pages = np.take_along_axis(tables_np[:, i, :], phys // page, axis=1)
            slots.append(pages.astype(np.int64) * page + phys % page)
            ctx.append(after.tolist())
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

        rows = resid = host_rows = None
        if self.attention.num_rows:  # the per-sequence rows (the scratch row: a sequence without one)
            scratch = self.attention.scratch_row
            host_rows = [scratch if s.row is None else s.row for s in batch.seqs]
            rows = to_dev(host_rows, torch.int32)
        window = self.attention.residual_window
        if window:  # each layer's residual slots before the step (the ops add the step's own)
            resid = to_dev(np.array([s.resid_lens for s in batch.seqs], dtype=np.int64).T, torch.int32)
        prompts = [[s.prefill_end - gap for gap in s.history_gap] for s in batch.seqs]  # as `_decode_rows`
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
            prompt_lens=to_dev([list(p) for p in zip(*prompts)], torch.int32),
            host_cu_seqlens=cu, host_context_lens=ctx, host_rows=host_rows,
            positions=to_dev(positions, torch.int64),
            ring_leave=None if leave is None else to_dev(leave[0]),
            ring_first=None if leave is None else to_dev(leave[1]),
        )
        return StepInputs(to_dev(ids, torch.int64), md.positions, md, sample_rows, sample_seqs)


class StepInputs:
    """One group's rows of a step: token ids, logical positions, attention metadata, and which rows sample
    (`sample_rows`: the index of each sampling sequence's last token; `sample_seqs`: its index in the batch)."""

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                 sample_rows: list[int], sample_seqs: list[int]) -> None:
        self.input_ids, self.positions, self.md = input_ids, positions, md
        self.sample_rows, self.sample_seqs = sample_rows, sample_seqs


def split_heads(attn, layout: CacheLayout):
    """A model layer's attention over per-head cache layers: KV head h of layer l (its query group
    and its K/V) goes to cache layer `layout.cache_layers(l)[h]`; the outputs join in head order."""

    def by_head(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                latent: LatentQueries | None = None) -> torch.Tensor:
        layers = layout.cache_layers(layer)
        if latent is not None:  # MLA: one latent KV head, one cache layer
            (cache_layer,) = layers
            return attn(cache_layer, q, k, v, latent=latent)
        group = q.shape[1] // len(layers)
        outs = [attn(cache_layer, q[:, h * group:(h + 1) * group], k[:, h:h + 1], v[:, h:h + 1])
                for h, cache_layer in enumerate(layers)]  # views: the ops take strided rows
        return torch.cat(outs, dim=1)

    return by_head


def _lane_prefills(group: SpecGroup, batch: ScheduledBatch) -> list[tuple[StepHooks, slice, ScheduledBatch]]:
    """Per lane with prefill hooks: its hooks, the step rows of its prefill chunks and those chunks as a
    batch (one lane: the whole batch and every row). The runner orders a group's prefills by lane, so
    each lane's are one run of rows."""
    lanes = [lane for lane in group.lanes if lane.method.hooks & {Hook.PREFILL_CHUNK, Hook.PREFILL_END}]
    if not lanes:
        return []
    if len(group.lanes) == 1:
        return [(lanes[0].hooks, slice(None), batch)]
    starts = np.cumsum([0, *batch.num_new_tokens]).tolist()
    out = []
    for lane in lanes:
        rows = [i for i in range(batch.num_decodes, len(batch.seqs)) if batch.seqs[i].lane is lane]
        if rows:
            part = ScheduledBatch([batch.seqs[i] for i in rows], [batch.num_new_tokens[i] for i in rows], 0)
            out.append((lane.hooks, slice(starts[rows[0]], starts[rows[-1] + 1]), part))
    return out


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


def _decode_rows(batch: ScheduledBatch, layer: int) -> list[DecodeRow]:
    """Host facts of the step's decode rows in one layer (eager steps)."""
    return [DecodeRow(s.seq_id, s.kv_lens[layer] + 1, s.num_computed_tokens + 1 - s.history_gap[layer],
                      s.prefill_end - s.history_gap[layer])
            for s in batch.seqs[: batch.num_decodes]]
