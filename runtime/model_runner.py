"""Runs one scheduled step through the model: builds the step's tensors (token ids, logical
positions, per-layer slots, tables, lengths, KV-head starts, residual counts), calls the model with
paged attention and the method's hooks around it, and samples the sequences that reached the end
of their known tokens. Requests that ask for prompt logprobs get the logits of every prompt
position of their prefill chunks (only theirs); the sampler's per-request penalty state lives here
(runtime/penalties.py), and logprobs travel back with the sampled tokens.

Decode-only steps on a GPU replay CUDA graphs captured per batch-size and context bucket
(runtime/decode_graphs.py); everything else (prefill chunks, mixed steps, CPU) runs eagerly. The
hooks and what their plans change live in runtime/step_hooks.py; the KV store and the plan
executor in runtime/kv/. docs/design.md, "One step of the engine", "Plans".
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
from kvc.runtime.errors import ConfigError
from kvc.runtime.grammar_book import GrammarBook
from kvc.runtime.kv.executor import KVExecutor
from kvc.runtime.kv.layout import CacheLayout
from kvc.runtime.kv.tables import TableCache
from kvc.runtime.step_hooks import StepHooks
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.methods import resolve_method
from kvc.runtime.method_api import (DecodeRow, DecodeView, Hook, KVMethod)
from kvc.runtime.models.base import CausalLM
from kvc.runtime.logprobs import LogprobTensors, TokenLogprobs, compute, to_host
from kvc.runtime.penalties import TokenCounts
from kvc.runtime.sampler import RowHistory, sample
from kvc.runtime.scheduler import ScheduledBatch
from kvc.runtime.transfer import PendingTensors, PendingTokens, feed_pending, to_device

log = logging.getLogger(__name__)

PROMPT_LOGITS_ROWS = 512  # prompt positions whose logits are computed at once (a [rows, vocab] float32 block)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    md: AttentionMetadata
    sample_rows: list[int]  # index into the step's tokens of each sampled sequence's last token
    sample_seqs: list[int]  # index into batch.seqs


@dataclass
class PromptSpan:
    """Prompt logprobs a step computed for one sequence: of its tokens [first, first + count)."""

    seq_id: int
    first: int
    count: int
    num_top: int


@dataclass
class StepOutput:
    sampled: dict[int, int]  # seq_id -> sampled token (filled by `resolve`)
    compacted: dict[int, dict[int, int]] = field(default_factory=dict)  # seq_id -> layer -> kept
    rewritten: dict[int, dict[int, int]] = field(default_factory=dict)  # seq_id -> layer -> residual slots left
    tokens: PendingTokens | None = None  # the sampled tokens, in the order of `seq_ids`
    seq_ids: list[int] = field(default_factory=list)
    logprob_top: dict[int, int] = field(default_factory=dict)  # seq_id -> top logprobs asked, in the sampler's order
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    prompt_pending: PendingTensors | None = None
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # seq_id -> its sampled token's (`resolve`)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)  # seq_id -> (first, ...)

    def resolve(self) -> dict[int, int]:
        """seq_id -> sampled token; waits for the step's sampling kernels. Also fills `logprobs`
        and `prompt_logprobs` for the sequences that asked."""
        if self.tokens is not None and not self.sampled:
            self.sampled = dict(zip(self.seq_ids, self.tokens.resolve()))
            if self.logprob_top:
                entries = to_host(self.tokens.resolve_extras(), list(self.logprob_top.values()))
                self.logprobs = dict(zip(self.logprob_top, entries))
        if self.prompt_pending is not None:
            entries = to_host(self.prompt_pending.resolve(), [s.num_top for s in self.prompt_spans for _ in
                                                              range(s.count)])
            self.prompt_pending, at = None, 0
            for span in self.prompt_spans:
                self.prompt_logprobs[span.seq_id] = (span.first, entries[at : at + span.count])
                at += span.count
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
        grammars: GrammarBook | None = None,
    ) -> None:
        self.grammars = grammars  # structured outputs' matchers (runtime/grammar_book.py)
        self.pool = pool  # for copy-on-write of shared pages; None: pages are never shared
        self.chain_window = 0  # prefill queries a chained sequence keeps per layer (set by the engine)
        self.method = method or resolve_method("full")
        # the cache's layers: the model's, or one per KV head (runtime/kv/layout.py); every per-layer
        # table, length and hook below counts cache layers
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
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)
        self.token_counts = TokenCounts(model.spec.vocab_size, device)  # penalties' state
        if any(st.spec.prerope for st in attention.stores):  # keys stored before RoPE: rotated with the model's RoPE
            rotary = getattr(model, "rotary", None)
            if rotary is None:
                raise ConfigError(f"method {self.method.name!r} stores keys before RoPE; the model "
                                  f"{type(model).__name__} has no rotary embedding to read them with", param="method")
            attention.use_rope(rotary.inv_freq)
        # the attention kernels of each storage class, chosen by its spec (dense or encoded K/V), the
        # decode statistics the method reads, and whether its decode hook gives read plans
        attention.use_variants([variant_for_spec(st.spec.dense, self.method.attention.decode_stats is not None,
                                                 Hook.DECODE_BEFORE_ATTENTION in self.method.hooks,
                                                 st.spec.low_rank, st.spec.delta is not None, st.spec.latent)
                                for st in attention.stores])
        # a plan executor per storage class (each moves its store's tensors; pages by their store index)
        self.executors = [KVExecutor(st, pool, "triton" if attention.backend == "triton" else "auto",
                                     restore=attention.store_fresh, copy_pages=attention.copy_pages)
                          for st in attention.stores]
        self.executor = self.executors[0]
        self.hooks = StepHooks(self.method, attention.stores, self.executors, self.tables, pool, self.num_layers,
                               copy_rows=attention.copy_rows, layer_class=attention.layer_class)
        # delta-coded layers' stores: their decode rows' due blocks are compressed before each step (`_compress_due`)
        self.delta_sources = {layer: source for layer in range(self.num_layers)
                              if (source := attention.delta_source(layer)) is not None}
        self.replay = None  # a method's replay pass after prefill (runtime/context_replay.py; set by the engine)
        self.graphs: DecodeGraphs | None = None
        # the torch backend decodes eagerly: its writes sync with the host
        if use_cuda_graphs and device.type == "cuda" and attention.backend != "torch" and self.method.decode_graphs:
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
        self.token_counts.release(seq_id)
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
            self.hooks.own_append_pages(batch)
        self.hooks.copy_rows(batch)
        self._compress_due(batch)
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
            self._prompt_logprobs(batch, hidden, output)
            logits = self.model.compute_logits(hidden[inputs.sample_rows])
            rows = inputs.sample_seqs
            _record_logits(batch, rows, logits)
        if self.replay is not None and batch.num_prefills:
            self.replay.after_prefill(batch, output)
        if Hook.STEP_END in self.method.hooks and batch.num_decodes:
            self.hooks.step_end(batch, output)
        if not rows:
            return output
        seqs = [batch.seqs[i] for i in rows]
        params = [s.params for s in seqs]
        if self.grammars is not None:  # structured outputs: disallowed tokens at -inf
            logits = self.grammars.constrain(logits, [s.seq_id for s in seqs])
        history, slots = self._history(seqs) if any(p.changes_logits for p in params) else (None, None)
        out = sample(logits, params, [self.generators.get(s.seq_id) for s in seqs], self.default_generator, history)
        if slots is not None:  # counted on the device, before the next step samples
            pr = to_device(history.penalty_rows, self.device, torch.int64)
            self.token_counts.add(slots, out.tokens.index_select(0, pr))
        extras = None
        if out.logprobs is not None:
            output.logprob_top = {seqs[i].seq_id: seqs[i].params.logprobs for i in out.logprob_rows}
            extras = out.logprobs.tensors()
        output.tokens, output.seq_ids = PendingTokens(out.tokens, extras), [s.seq_id for s in seqs]
        if not defer:
            output.resolve()
        return output

    def _compress_due(self, batch: ScheduledBatch) -> None:
        """Delta-coded layers (runtime/kv/delta_pages.py): the blocks the decode rows' new tokens bring
        due, compressed before the step, eagerly, so that the step itself stores only the tokens, on the
        device (a CUDA graph replays it)."""
        for seq in batch.seqs[:batch.num_decodes] if self.delta_sources else ():
            for layer, source in self.delta_sources.items():
                if source.due(seq.kv_lens[layer]):
                    table = torch.tensor(self.tables.local(layer, seq.page_tables[layer]), device=self.device)
                    source.compress_due(table, seq.row, seq.kv_lens[layer])

    def _history(self, seqs) -> tuple[RowHistory, torch.Tensor | None]:
        """What the sampler reads about `seqs` beyond their params: tokens generated so far (a pending
        one included), the ids min_tokens masks, and the penalised rows' counts; and those rows in
        `token_counts` (None: no row has a penalty)."""
        penalised = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        history = RowHistory(
            num_generated=[s.num_generated + s.pending for s in seqs],
            stop_ids=[(*s.params.stop_token_ids, *(() if s.params.ignore_eos else s.eos_token_ids))
                      if s.params.min_tokens else () for s in seqs],
            penalty_rows=penalised,
        )
        if not penalised:
            return history, None
        slots = self.token_counts.rows([seqs[i] for i in penalised])
        history.counts = self.token_counts.counts.index_select(0, slots)
        history.prompt = self.token_counts.prompt.index_select(0, slots)
        return history, slots

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor, output: StepOutput) -> None:
        """The logprobs of the prompt tokens that this step's prefill chunks predict, for the
        sequences that ask (position p's logits give token p + 1's logprob); skips tokens a
        sequence already has (a recompute after preemption)."""
        spans, chunks = [], []
        start_row = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            have = None if seq.prompt_logprobs is None else len(seq.prompt_logprobs)
            if i >= batch.num_decodes and have is not None and have < seq.num_prompt_tokens:
                start = seq.num_computed_tokens
                first, end = max(start + 1, have), min(start + n + 1, seq.num_prompt_tokens)
                if first < end:
                    spans.append(PromptSpan(seq.seq_id, first, end - first, seq.params.prompt_logprobs))
                    rows = torch.arange(start_row + first - 1 - start, start_row + end - 1 - start, device=self.device)
                    targets = to_device(seq.token_ids[first:end], self.device, torch.int64)
                    chunks.append((rows, targets, seq.params.prompt_logprobs))
            start_row += n
        if not spans:
            return
        k = max(c[2] for c in chunks)
        rows = torch.cat([c[0] for c in chunks])
        targets = torch.cat([c[1] for c in chunks])
        parts = []
        for at in range(0, len(rows), PROMPT_LOGITS_ROWS):
            block = slice(at, at + PROMPT_LOGITS_ROWS)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows[block]]).float(), dim=-1)
            parts.append(compute(logprobs, targets[block], k))
        joined = LogprobTensors(*(torch.cat(t) for t in zip(*(p.tensors() for p in parts))))
        output.prompt_spans, output.prompt_pending = spans, PendingTensors(joined.tensors())

    def _attn_fn(self, md: AttentionMetadata, batch: ScheduledBatch | None = None,
                 output: StepOutput | None = None):
        """The model's attention function for this step (`attn(layer, q, k, v)` over model layers),
        with the method's hooks around it. `batch` is None in a captured decode graph (only the
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
        """`attn(cache_layer, q, k, v)`: one cache layer's attention with the method's hooks around
        it. `compute` False: store K/V and run the hooks, but no attention (a replayed prefill's
        output is never read)."""
        attention, scale, method = self.attention, self.scale, self.method
        hooks = method.hooks
        fold = method.attention.decode_stats  # the decode statistics decode_after_attention reads
        decode_hooks = hooks & {Hook.DECODE_BEFORE_ATTENTION, Hook.DECODE_AFTER_ATTENTION}
        prefill_hooks = batch is not None and batch.num_prefills > 0 and bool(
            hooks & {Hook.PREFILL_CHUNK, Hook.PREFILL_END})
        chained = [] if batch is None or not self.chain_window else _chained_prefills(batch)
        recording = [] if batch is None else _recording_prefills(batch)
        records_queries = attention.keeps_queries  # a spec with decode query windows (runtime/kv/query_window.py)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
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
                                  seq_rows=None if md.rows is None else md.rows[:d])
            read = None
            if view is not None and Hook.DECODE_BEFORE_ATTENTION in hooks:
                read = method.decode_before_attention(layer, view)  # a ReadPlan, or None: every slot
            if compute:
                out = attention.forward(layer, q, k, v, md, scale, stats=stats, read=read)
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
            if prefill_hooks:
                self.hooks.prefill(layer, hq, k, v, batch, output)
            for seq, rows in chained:  # a chain keeps its latest prefill queries (a prune scores with them)
                prev = seq.window_queries[layer]
                both = hq[rows] if prev is None else torch.cat([prev, hq[rows]])
                seq.window_queries[layer] = both[-self.chain_window:].clone()
            return out

        return attn

    def hook_queries(self, q: torch.Tensor) -> torch.Tensor:
        """The queries the method's hooks see (`hook_scale`)."""
        return q if self.hook_scale is None else q * self.hook_scale

    def _replay(self, md: AttentionMetadata, batch: ScheduledBatch, output: StepOutput) -> None:
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
        )
        return StepInputs(to_dev(ids, torch.int64), md.positions, md, sample_rows, sample_seqs)


def split_heads(attn, layout: CacheLayout):
    """A model layer's attention over per-head cache layers: KV head h of layer l (its query group
    and its K/V) goes to cache layer `layout.cache_layers(l)[h]`; the outputs join in head order."""

    def by_head(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layers = layout.cache_layers(layer)
        group = q.shape[1] // len(layers)
        outs = [attn(cache_layer, q[:, h * group:(h + 1) * group], k[:, h:h + 1], v[:, h:h + 1])
                for h, cache_layer in enumerate(layers)]  # views: the ops take strided rows
        return torch.cat(outs, dim=1)

    return by_head


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
