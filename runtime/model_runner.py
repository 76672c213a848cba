"""Runs one scheduled step through the model: the step's rows go to their attention groups
(runtime/spec_group.py: the lanes, runtime/lanes.py, whose attention is one launch per layer), each
builds its rows' tensors and attention with its lanes' hooks around it; the model runs once over
every row, and the sequences that reached the end of their known tokens are sampled together.
Requests that ask for prompt logprobs get the logits of every prompt position of their prefill
chunks (only theirs); the sampler's per-request penalty state lives here (runtime/penalties.py),
and logprobs travel back with the sampled tokens.

Decode-only steps of one group on a GPU replay its CUDA graphs captured per batch-size and context
bucket (runtime/decode_graphs.py); everything else (prefill chunks, mixed steps, steps over several
groups, CPU) runs eagerly. The hooks and what their plans change live in runtime/step_hooks.py; the
KV store and the plan executor in runtime/kv/. docs/design.md, "One step of the engine", "Plans",
"Many methods in one batch".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kvc.runtime.grammar_book import GrammarBook
from kvc.runtime.host_ranges import host_range
from kvc.runtime.method_api import Hook
from kvc.runtime.models.base import CausalLM, LatentQueries
from kvc.runtime.logprobs import LogprobTensors, TokenLogprobs, compute, to_host
from kvc.runtime.penalties import TokenCounts
from kvc.runtime.sampler import RowHistory, sample
from kvc.runtime.scheduler import ScheduledBatch
from kvc.runtime.spec_group import SpecGroup, split_heads
from kvc.runtime.transfer import PendingTensors, PendingTokens, feed_pending, to_device

__all__ = ["ModelRunner", "PromptSpan", "StepOutput", "split_heads"]

log = logging.getLogger(__name__)

PROMPT_LOGITS_ROWS = 512  # prompt positions whose logits are computed at once (a [rows, vocab] float32 block)


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
    def __init__(self, model: CausalLM, groups: list[SpecGroup], device: torch.device, seed: int = 0,
                 grammars: GrammarBook | None = None, fused_sampling: bool = False) -> None:
        """`groups`: the attention groups of the engine's lanes (the first holds the default lane).
        `fused_sampling`: sample through the race kernel where the batch allows (runtime/sampler.py)."""
        self.grammars = grammars  # structured outputs' matchers (runtime/grammar_book.py)
        self.model = model
        self.groups = groups
        self.device = device
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)
        self.race_generator = torch.Generator().manual_seed(seed) if fused_sampling else None
        self.token_counts = TokenCounts(model.spec.vocab_size, device)  # penalties' state

    # the default lane's group (one method: everything the engine runs)
    @property
    def group(self) -> SpecGroup:
        return self.groups[0]

    def __getattr__(self, name: str):
        """The default group's attention, tables, executors, hooks, graphs, layout, replay ... (one method:
        the engine's)."""
        if name in _GROUP_FACTS:
            return getattr(self.groups[0], name)
        raise AttributeError(name)

    @property
    def graphs(self):
        """The default group's decode graphs (tests install uncaptured ones here)."""
        return self.groups[0].graphs

    @graphs.setter
    def graphs(self, value) -> None:
        self.groups[0].graphs = value

    @property
    def hooks(self):
        """The default lane's hooks."""
        return self.groups[0].hooks

    @hooks.setter
    def hooks(self, value) -> None:
        self.groups[0].lanes[0].hooks = value

    @property
    def chain_window(self) -> int:
        return self.groups[0].chain_window

    @chain_window.setter
    def chain_window(self, value: int) -> None:
        """Prefill queries a chained sequence keeps per layer, in every group."""
        for group in self.groups:
            group.chain_window = value

    # ---- per-request sampling state -------------------------------------------------------
    def add_request(self, seq_id: int, seed: int | None) -> None:
        if seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[seq_id] = gen

    def remove_request(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)
        self.token_counts.release(seq_id)
        for group in self.groups:
            group.tables.drop(seq_id)

    # ---- one step --------------------------------------------------------------------------
    def split(self, batch: ScheduledBatch) -> list[tuple[SpecGroup, ScheduledBatch]]:
        """The step's rows by attention group, each a batch of its own (decodes first, then prefill chunks
        by lane); the rows of one lane: `batch` itself."""
        default = self.groups[0]
        if len(self.groups) == 1 and len(default.lanes) == 1:
            return [(default, batch)]
        rows: dict[int, list[int]] = {}
        for i, seq in enumerate(batch.seqs):
            rows.setdefault(id(default if seq.lane is None else seq.lane.group), []).append(i)
        out = []
        for group in self.groups:
            picked = rows.get(id(group))
            if picked is None:
                continue
            if len(rows) == 1 and len(group.lanes) == 1:
                return [(group, batch)]
            lane_order = {id(lane): j for j, lane in enumerate(group.lanes)}
            decodes = [i for i in picked if i < batch.num_decodes]
            prefills = sorted((i for i in picked if i >= batch.num_decodes),
                              key=lambda i: lane_order.get(id(batch.seqs[i].lane), 0))
            order = decodes + prefills
            seqs, counts = [batch.seqs[i] for i in order], [batch.num_new_tokens[i] for i in order]
            out.append((group, ScheduledBatch(seqs, counts, len(decodes))))
        return out

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, needs_sample: list[bool], after: StepOutput | None = None,
            defer: bool = False) -> StepOutput:
        """Runs the step: the sampled tokens and the layers a keep plan compacted.

        `after`: the step launched before this one, whose sampled tokens (still on the device) are
        the input of this step's pending rows (async scheduling). `defer`: return once the step is
        queued, its tokens unread (`StepOutput.resolve` reads them)."""
        output = StepOutput({})
        parts = self.split(batch)
        with host_range("kvc.forward"):
            for group, part in parts:
                group.begin(part)
            if len(parts) == 1:
                group, part = parts[0]  # one lane's rows: the batch itself; several lanes': their prefills by lane
                needs = needs_sample if part is batch else part.needs_sample()
                logits, seqs = self._forward_group(group, part, needs, after, output)
            elif all(_graph_step(group, part) for group, part in parts):  # each group's rows through its graphs
                steps = [self._forward_group(group, part, part.needs_sample(), after, output) for group, part in parts]
                logits, seqs = torch.cat([x for x, _ in steps]), [seq for _, rows in steps for seq in rows]
            else:
                logits, seqs = self._forward_groups(parts, after, output)
        for group, part in parts:
            for lane, rows in group.lane_batches(part):
                if lane.replay is not None and rows.num_prefills:
                    lane.replay.after_prefill(rows, output)
                if Hook.STEP_END in lane.method.hooks and rows.num_decodes:
                    with host_range("kvc.step_end"):
                        lane.hooks.step_end(rows, output)
        if not seqs:
            return output
        with host_range("kvc.sample"):
            self._sample(logits, seqs, output)
        if not defer:
            output.resolve()
        return output

    def _forward_group(self, group: SpecGroup, batch: ScheduledBatch, needs_sample: list[bool],
                       after: StepOutput | None, output: StepOutput) -> tuple[torch.Tensor | None, list]:
        """A step whose rows are all one group's: its decode graphs, a replayed prefill, or the model
        eagerly. The logits of the sampling sequences, and those sequences."""
        decode_only = batch.num_decodes == len(batch.seqs)
        feed = None if after is None else after.feed(batch.seqs)
        if group.graphs is not None and decode_only and group.graphs.fits(len(batch.seqs)):
            logits = group.graphs.run(batch, None if feed is None else (after.tokens.device, feed))
            return logits, list(batch.seqs)
        inputs = group.prepare(batch, needs_sample)
        rows = inputs.sample_seqs
        if _replayable(batch):  # every row takes its prefill from a record: no model layers
            group.replay_prefill(inputs.md, batch, output)
            logits = torch.stack([batch.seqs[i].replay.logits for i in rows]).to(self.device) if rows else None
            return logits, [batch.seqs[i] for i in rows]
        if feed is not None:
            feed_pending(inputs.input_ids, after.tokens.device, feed, [0, *np.cumsum(batch.num_new_tokens)])
        hidden = self.model(inputs.input_ids, inputs.positions, group._attn_fn(inputs.md, batch, output))
        self._prompt_logprobs(batch.seqs, batch.num_new_tokens, batch.num_decodes, hidden, output)
        # the rows' indices go to the device pinned: a list index would copy from pageable memory and wait for the GPU
        logits = self.model.compute_logits(hidden[to_device(inputs.sample_rows, hidden.device, torch.long)])
        _record_logits(batch, rows, logits)
        return logits, [batch.seqs[i] for i in rows]

    def _forward_groups(self, parts: list[tuple[SpecGroup, ScheduledBatch]], after: StepOutput | None,
                        output: StepOutput) -> tuple[torch.Tensor | None, list]:
        """A step over several groups, eagerly: one model forward over every group's rows (in group
        order), each layer's attention one launch per group."""
        inputs = [group.prepare(part, part.needs_sample()) for group, part in parts]
        seqs = [seq for _, part in parts for seq in part.seqs]
        counts = [n for _, part in parts for n in part.num_new_tokens]
        cu = [0, *np.cumsum(counts).tolist()]
        ids = torch.cat([x.input_ids for x in inputs])
        feed = None if after is None else after.feed(seqs)
        if feed is not None:
            feed_pending(ids, after.tokens.device, feed, cu)
        bounds, fns, at, sample_rows, sampled, first = [], [], 0, [], [], 0
        for (group, part), x in zip(parts, inputs):
            n = part.num_tokens
            bounds.append((at, at + n))
            fns.append(group._attn_fn(x.md, part, output))
            sample_rows += [at + r for r in x.sample_rows]
            sampled += [first + i for i in x.sample_seqs]
            at, first = at + n, first + len(part.seqs)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 latent: LatentQueries | None = None) -> torch.Tensor:
            return torch.cat([fn(layer, q[a:b], k[a:b], v[a:b], latent=None if latent is None else latent.rows(a, b))
                              for fn, (a, b) in zip(fns, bounds)])

        hidden = self.model(ids, torch.cat([x.positions for x in inputs]), attn)
        decodes = [i < part.num_decodes for _, part in parts for i in range(len(part.seqs))]
        self._prompt_logprobs(seqs, counts, decodes, hidden, output)
        logits = None
        if sample_rows:
            logits = self.model.compute_logits(hidden[to_device(sample_rows, hidden.device, torch.long)])
        at = 0
        for (_, part), x in zip(parts, inputs):
            if x.sample_seqs:
                _record_logits(part, x.sample_seqs, logits[at:at + len(x.sample_seqs)])
            at += len(x.sample_seqs)
        return logits, [seqs[i] for i in sampled]

    def _sample(self, logits: torch.Tensor, seqs: list, output: StepOutput) -> None:
        """Samples the next token of each of `seqs` (rows of `logits`) into `output`."""
        params = [s.params for s in seqs]
        if self.grammars is not None:  # structured outputs: disallowed tokens at -inf
            logits = self.grammars.constrain(logits, [s.seq_id for s in seqs])
        history, slots = self._history(seqs) if any(p.changes_logits for p in params) else (None, None)
        out = sample(logits, params, [self.generators.get(s.seq_id) for s in seqs], self.default_generator, history,
                     self.race_generator)
        if slots is not None:  # counted on the device, before the next step samples
            pr = to_device(history.penalty_rows, self.device, torch.int64)
            self.token_counts.add(slots, out.tokens.index_select(0, pr))
        extras = None
        if out.logprobs is not None:
            output.logprob_top = {seqs[i].seq_id: seqs[i].params.logprobs for i in out.logprob_rows}
            extras = out.logprobs.tensors()
        output.tokens, output.seq_ids = PendingTokens(out.tokens, extras), [s.seq_id for s in seqs]

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

    def _prompt_logprobs(self, seqs: list, counts: list[int], decodes, hidden: torch.Tensor,
                         output: StepOutput) -> None:
        """The logprobs of the prompt tokens that this step's prefill chunks predict, for the
        sequences that ask (position p's logits give token p + 1's logprob); skips tokens a
        sequence already has (a recompute after preemption). `seqs` with `counts` tokens each are the
        step's rows in order; `decodes`: how many lead as decodes, or per row whether it decodes."""
        spans, chunks = [], []
        start_row = 0
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            have = None if seq.prompt_logprobs is None else len(seq.prompt_logprobs)
            decoding = i < decodes if isinstance(decodes, int) else decodes[i]
            if not decoding and have is not None and have < seq.num_prompt_tokens:
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


def _graph_step(group: SpecGroup, part: ScheduledBatch) -> bool:
    """Do a group's rows of a step replay its decode graphs (decode rows only, a batch its graphs fit)?

    A decode step over several groups then replays each group's graph over its rows (every group reads
    the weights once; an eager forward over all rows reads them once but launches every kernel from the
    host: docs/design.md, "Many methods in one batch")."""
    return group.graphs is not None and part.num_decodes == len(part.seqs) and group.graphs.fits(len(part.seqs))


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


# what `ModelRunner` answers from its default group (`__getattr__`)
_GROUP_FACTS = frozenset({"attention", "tables", "executors", "executor", "layout", "replay", "lanes",
                          "method", "num_layers", "num_kv_heads", "page_size", "max_model_len", "pool", "scale",
                          "hook_scale", "hook_queries", "prepare", "delta_sources", "max_pages_per_seq", "_attn_fn",
                          "_cache_attn_fn"})
