"""One request as the scheduler sees it: its tokens, how far its K/V are computed, its pages.

A `Sequence` is created by the engine for each request, handed to the `Scheduler`, and moves
WAITING -> RUNNING -> FINISHED (RUNNING -> WAITING again when it is preempted). The scheduler owns
the bookkeeping fields (`num_computed_tokens`, `page_tables`, `kv_lens`, `page_hashes`, `status`);
the model runner only reads them to build a step.

Logical vs physical length: `num_computed_tokens` counts the tokens whose K/V were computed (RoPE
positions continue from it), while `kv_lens[layer]` counts the tokens layer `layer` actually
stores in `page_tables[layer]` (fewer once a method compacted the layer). For `full` they agree.

Readers cache arrays of the page tables (the runner's `TableCache`, the decode graphs' mirror, the
scheduler's `Room`) by `tables_version`, which every change of `page_tables` bumps. Appending pages
to a layer (`grow_table`, the scheduler's growth at a page boundary: with per-layer lengths, some
layer of nearly every row at every step) or dropping its last ones (`truncate_table`, the pages a
keep plan freed: decode-time eviction's, every few steps) also logs the layer in `resized_layers`,
so a reader applies just those changes at the tables' ends (`resized_since`); any other change
(copy-on-write, clone, chains, preemption) is a bare version bump, and readers rebuild.

Per-head variable counts (a keep plan with `lengths`): `kv_starts[layer]` lists, per KV head, the
first slot that head uses (its kept tokens are right-aligned below `kv_lens[layer]`); None means
every head starts at slot 0. The model runner records it when it compacts the layer (in the
forward that computed the plan); it goes with the cache (`reset_cache`).

Chained requests (runtime/chains.py): `chain` is the chain record the request continues (or
opens); at admission the scheduler starts it from the record's pages (`num_computed_tokens` =
the record's history, `kv_lens` its physical lengths), so only the suffix is prefilled.
`history_gap[layer]` is logical minus physical length of that reused history: the method sees the
turn as a request whose prompt is the stored history plus the suffix. `verbatim_from` is the
logical position from which every layer's stored tail equals the logical tokens in order (what
a rollback may cut). `spare_pages` are fresh pages the scheduler set aside for one step's
copy-on-write of shared pages (the runner takes them; the rest go back after the step).

Logprobs (runtime/logprobs.py): `logprobs` holds one entry per generated token and
`prompt_logprobs` one per prompt token (None for the first), for requests that ask; `stop_reason`
is the stop token id that ended the request (None for EOS, length or abort), as vLLM reports it.

Async scheduling (runtime/engine.py): `pending` counts sampled tokens still on the device, not yet
in `token_ids`. The scheduler advances a step's bookkeeping when the step is launched and appends
its tokens when they arrive (`Scheduler.advance` / `commit`), so between the two a decoding
sequence has `num_computed_tokens == len(token_ids)` and one pending token, which the next step
feeds straight from the device. Readers of `token_ids` only ever see committed tokens.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence as Seq
from typing import Protocol

from kvc.runtime.errors import KvcError

FINISH_STOP = "stop"  # a stop token or an end-of-sequence token was sampled
FINISH_LENGTH = "length"  # max_tokens reached, or the context (model or KV pool) is full
FINISH_ABORT = "abort"  # the user or the engine cancelled the request

_RESIZED_LOG_CAP = 4096  # resizes a sequence logs (`resized_layers`) before its readers rebuild once


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # queued; holds no pages
    RUNNING = enum.auto()  # admitted; holds pages for its computed tokens
    FINISHED = enum.auto()  # done; `finish_reason` says why; holds no pages


class StopParams(Protocol):
    """What a sequence reads from the engine's `SamplingParams`."""

    max_tokens: int
    stop_token_ids: Seq[int]
    ignore_eos: bool


class Sequence:
    """A request's token history and cache bookkeeping.

    Invariant while RUNNING: `page_tables[l]` holds enough pages for `kv_lens[l]` tokens (page i
    holds stored tokens [i * page_size, (i + 1) * page_size)). The K/V of the last sampled token
    is computed by the next step, so a decoding sequence has
    `num_computed_tokens == len(token_ids) - 1` between steps.
    """

    _ids = itertools.count()

    def __init__(
        self,
        prompt_token_ids: Seq[int],
        params: StopParams,
        *,
        eos_token_ids: Seq[int] = (),
        max_model_len: int,
        arrival: int | None = None,
        num_layers: int = 1,
        seq_id: int | None = None,
    ) -> None:
        """`seq_id`: the id another rank's engine gave it (tensor parallelism: followers take the leader's)."""
        if len(prompt_token_ids) == 0:
            raise KvcError("the prompt is empty; give at least one token", param="prompt")
        self.seq_id: int = next(Sequence._ids) if seq_id is None else seq_id
        self.arrival: int = self.seq_id if arrival is None else arrival  # FCFS order
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens: int = len(self.token_ids)
        self.params = params
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.max_model_len: int = max_model_len

        # its method's lane (runtime/lanes.py) and the scheduler's facts of it; None: the engine's default
        self.lane = None
        self.rules = None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prefix-cache hits at the last admission (for reporting)
        self.num_preemptions = 0
        self.page_tables: list[list[int]] = [[] for _ in range(num_layers)]
        self.tables_version = 0  # bumped on every change of page_tables (the runner caches arrays)
        # One layer per version bump that only appended pages to that layer or dropped its last ones
        # (`grow_table`, `truncate_table`), in order: readers of the tables update their copies
        # incrementally (`resized_since`).
        self.resized_layers: list = []  # layer (pages appended) or (layer, pages) (truncated to that many)
        self.room = None  # the scheduler's cache of free slots per layer (runtime/kv/room.py)
        self.kv_lens: list[int] = [0] * num_layers  # physical tokens stored per layer
        self.kv_starts: list[list[int] | None] = [None] * num_layers  # per layer, per KV head; None: 0
        # decode rings (runtime/kv/ring.py): where a layer at its window's capacity writes its next token
        # (its kv_lens then stay); None: every layer appends
        self.ring = None
        self.compressed = False  # a method compacted it: pages no longer equal the logical tokens
        # Chained hashes of the full pages of `token_ids`, filled by the scheduler as pages are
        # computed. Tokens never change once appended, so the list survives preemption.
        self.page_hashes: list[bytes] = []
        # Tokens the current admission prefills: the prompt, or prompt + generated after a
        # preemption (recompute). Past it the sequence decodes one token per step.
        self.prefill_end = self.num_prompt_tokens
        self.chain = None  # the chain record this request continues or opens (runtime/chains.py)
        self.chain_id: str | None = None
        self.history_gap: list[int] = [0] * num_layers
        self.verbatim_from = 0
        self.spare_pages: list[int] = []
        # The KV spec's per-sequence tensors (runtime/kv/rows.py): this sequence's row, the row the
        # runner copies into it before its first step (a chain continuation starts from its record's),
        # and per layer how many of the newest stored slots that row's residual window holds in full
        # precision (attention reads them from there).
        self.row: int | None = None
        self.row_source: int | None = None
        self.resid_lens: list[int] = [0] * num_layers
        self.pending = 0  # sampled tokens on the device, not yet appended (async scheduling)
        # Chained sequences only (runtime/kv/positions.py, runtime/chain_prune.py): per layer, the
        # position map of the stored slots and the last prefill queries; the prompt's messages.
        self.positions: list | None = None
        self.window_queries: list | None = None
        self.segments: tuple | None = None
        # Prefill records (runtime/prefill_record.py): this request's prefill is recorded into
        # `record`, or taken from `replay` instead of running the model.
        self.record = None
        self.replay = None
        # Requests that ask (SamplingParams.logprobs / prompt_logprobs): one TokenLogprobs per
        # generated token, per prompt token (the first has none: None)
        self.logprobs: list | None = None if getattr(params, "logprobs", None) is None else []
        self.prompt_logprobs: list | None = None if getattr(params, "prompt_logprobs", None) is None else [None]
        self.stop_reason: int | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.name}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, pages={self.page_tables[0]})"
        )

    @property
    def page_table(self) -> list[int]:
        """Layer 0's page table (with one layer, the page table)."""
        return self.page_tables[0]

    @property
    def num_layers(self) -> int:
        return len(self.page_tables)

    @property
    def holds_pages(self) -> bool:
        return any(self.page_tables)

    def reset_cache(self) -> list[list[int]]:
        """Forgets all stored K/V (preemption, finish); returns the tables to free."""
        tables = self.page_tables
        self.page_tables = [[] for _ in tables]
        self.tables_version += 1
        self.resized_layers = []
        self.kv_lens = [0] * len(tables)
        self.kv_starts = [None] * len(tables)
        self.ring = None
        self.compressed = False
        self.history_gap = [0] * len(tables)
        self.resid_lens = [0] * len(tables)
        self.row_source = None
        self.verbatim_from = 0
        self.positions = self.window_queries = None  # a chained re-admission takes its record's again
        return tables

    def grow_table(self, layer: int, pages: list[int]) -> None:
        """Appends fresh pages to layer `layer`'s table: the change readers may apply incrementally.

        Every other change of `page_tables` but `truncate_table` bumps `tables_version` alone, which
        `resized_since` reports as "rebuild"."""
        self.page_tables[layer] += pages
        self._resized(layer)

    def truncate_table(self, layer: int, pages: int) -> list[int]:
        """Keeps the first `pages` pages of layer `layer`'s table; returns the dropped ones (the caller
        frees them). Readers apply it incrementally, as an append."""
        table = self.page_tables[layer]
        dropped = table[pages:]
        if dropped:
            del table[pages:]
            self._resized((layer, pages))
        return dropped

    def _resized(self, entry: int | tuple[int, int]) -> None:
        self.tables_version += 1
        self.resized_layers.append(entry)
        if len(self.resized_layers) >= _RESIZED_LOG_CAP:  # bound the log: readers rebuild once
            self.resized_layers = []
            self.tables_version += 1

    def resized_since(self, version: int, mark: int) -> list[int] | None:
        """The layers whose tables only changed at their ends (pages appended or dropped) since a
        reader's snapshot at (`tables_version`, len(`resized_layers`)) = (version, mark): the log's
        entries, with repeats (`split_resized` sorts them); None when anything else changed since (the
        reader rebuilds its copy).

        Sound whatever bumps the version: each `grow_table` / `truncate_table` adds one bump and one
        log entry, any other change a bump alone (and a cleared log only shrinks), so the two counts
        advance equally exactly when every change since was a resize."""
        log = self.resized_layers
        if self.tables_version - version != len(log) - mark:
            return None
        return log[mark:]

    def set_kv_starts(self, layer: int, starts: list[int] | None) -> None:
        """Layer `layer`'s KV head h now uses slots [starts[h], kv_lens[layer]) (all 0: None)."""
        self.kv_starts[layer] = starts if starts is not None and any(starts) else None
        self.tables_version += 1  # the runner caches the step arrays by this version

    @property
    def has_kv_starts(self) -> bool:
        return any(s is not None for s in self.kv_starts)

    @property
    def physical_prompt_len(self) -> int:
        """Tokens the most-storing layer holds once the prompt is prefilled: the prompt, or for a
        chain continuation the record's stored history plus the new suffix."""
        chain = self.chain
        if chain is None:
            return len(self.token_ids)
        return max(chain.kv_lens, default=0) + len(self.token_ids) - len(chain.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True until the current admission's prefill (prompt, or recompute) is computed."""
        return self.num_computed_tokens < self.prefill_end

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens known (committed or pending on the device) whose K/V are not computed yet."""
        return len(self.token_ids) + self.pending - self.num_computed_tokens

    @property
    def stops_by_length(self) -> bool:
        """With its pending tokens appended, will it stop by length (max_tokens or the context)
        whatever they are? Such a sequence is not scheduled ahead of its tokens."""
        n = len(self.token_ids) + self.pending
        return n - self.num_prompt_tokens >= self.params.max_tokens or n >= self.max_model_len

    def append_token(self, token_id: int, logprobs=None) -> None:
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)

    def add_prompt_logprobs(self, first: int, entries: list) -> None:
        """Prompt logprobs of tokens [first, first + len(entries)), from one prefill chunk."""
        if self.prompt_logprobs is not None and first == len(self.prompt_logprobs):
            self.prompt_logprobs.extend(entries)

    def check_stop(self) -> str | None:
        """Why the sequence should stop after its last token, or None to go on."""
        if self.num_generated == 0:
            return None
        last = self.token_ids[-1]
        if last in self.params.stop_token_ids:
            self.stop_reason = last
            return FINISH_STOP
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return FINISH_STOP
        if self.num_generated >= self.params.max_tokens or len(self.token_ids) >= self.max_model_len:
            return FINISH_LENGTH
        return None

    def finish(self, reason: str) -> None:
        """Marks the sequence FINISHED; the scheduler has already taken its pages back."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.pending = 0
