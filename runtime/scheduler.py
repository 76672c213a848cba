"""Continuous batching: which sequences run in the next step, and how many tokens each.

The engine calls `schedule()` for a `ScheduledBatch`, runs it through the model, and hands the
sampled tokens to `postprocess()` (= `advance()`, what the step changes whatever its tokens, then
`commit()`, which appends them). An async engine advances a step at its launch and, while it runs,
`schedule_ahead()` builds the next decode step over its pending tokens; it commits them later.
One step mixes decodes and prefill chunks under a token budget:

1. running sequences that decode (one token each), oldest first;
2. running sequences still prefilling, a chunk each: min(remaining, budget left, chunk cap);
3. waiting sequences, first come first served, while seats, budget and pages allow; the first one
   that does not fit stops admission (no skipping ahead, so a long prompt cannot starve).

Pages are taken lazily, as many as the tokens computed after this step need. When a running
sequence needs a page and none is free, the most recently arrived running sequence is preempted
(possibly the one asking): its pages go back, and it rejoins the front of the waiting queue to be
recomputed from all its tokens later, through the prefix cache where its pages survived.

Memory is per layer: each sequence has a page table per layer over one global pool, and a layer
needs pages for its physical length `kv_lens[layer]`, which a method's prefill_end compaction can
shrink (the runner reports it; `postprocess` frees the pages past the kept tokens at once). A
layer takes its pages from its storage class's range of the pool (`layer_class`): page counts
are per class, and a step fits when every class has the pages it needs.
Admission sizes a request by the method's budget (`pages_needed`), whose decode-time bound
already counts the engine's eviction interval (a row holds up to its kept count + N tokens per
layer); growth (`_growth`) takes pages by the real stored lengths, so a row between evictions
simply holds more pages until the eviction step frees them. Which layers are at a page boundary
comes from each sequence's `Room` (runtime/kv/room.py), not from a walk over the layers, and
their new pages are logged as appends (`Sequence.grow_table`).

Chains (runtime/chains.py): a chained request is admitted from its chain record's pages (only
the suffix is prefilled) and at its end hands its pages to the record instead of freeing them.
Pages can be shared (chain records, forks, the prefix cache): a step that writes into a shared
page gets fresh `spare_pages` for the runner's copy-on-write (the partial last page of an append;
every shared page when the step may compact), and `postprocess` returns the unused ones. When
pages run out, idle chains are evicted oldest-last-use first, then running sequences without a
chain are preempted, chained ones last (a chained one restarts its turn from its record, which
stayed intact: copy-on-write).

Clones (`clone`, for `Engine.clone_sequence`): new sequences admitted straight as RUNNING decodes
with the bookkeeping of a decoding source and fresh pages of the same shape (the engine copies the
K/V into them); refused whole, before any change, when seats or free pages do not cover them all.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass, field

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvc.runtime.errors import ConfigError, OutOfKVMemory, PromptTooLongError
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.kv.ring import Rings
from kvc.runtime.kv.room import Room
from kvc.runtime.kv.rows import RowPool
from kvc.runtime.kv.spec import flushed
from kvc.runtime.method_api import FullBudget, KVBudget
from kvc.runtime.sequence import FINISH_ABORT, FINISH_LENGTH, Sequence, SequenceStatus

if TYPE_CHECKING:
    from kvc.runtime.chains import ChainStore

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # seats: running sequences at once
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_prefill_chunk: int | None = None  # one sequence's prefill tokens per step; None: the budget
    enable_prefix_caching: bool = True
    prefill_first: bool = False  # EngineConfig.prefill_first: no decodes while prefills can run

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            value = getattr(self, name)
            if value is None and name == "max_prefill_chunk":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"invalid {name}={value!r}: must be a positive integer", param=name)


@dataclass
class ScheduledBatch:
    """One step: decodes first (one token each), then prefill chunks.

    Sequence i feeds `token_ids[c : c + num_new_tokens[i]]` with c = its `num_computed_tokens`;
    the sequences' fields describe the step until `postprocess` advances them.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_decodes: int
    _needs_sample: list[bool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Captured now: advance moves num_computed_tokens on.
        self._needs_sample = [n == s.num_uncomputed_tokens for s, n in zip(self.seqs, self.num_new_tokens)]

    def needs_sample(self) -> list[bool]:
        """Per sequence: does its chunk reach its last known token, so it samples the next one."""
        return list(self._needs_sample)

    @property
    def num_prefills(self) -> int:
        return len(self.seqs) - self.num_decodes

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def _no_window(kept: int) -> int:
    return 0


@dataclass
class LaneRules:
    """What the scheduler knows of a sequence's method (its lane, runtime/lanes.py; docs/design.md,
    "Many methods in one batch"): its budget, the pool class of each layer's pages, when its plans
    may write into pages, its per-sequence row and residual window, and how it uses the prefix cache.
    Every sequence carries its lane's (`Sequence.rules`); None: the scheduler's own."""

    budget: KVBudget = field(default_factory=FullBudget)
    layer_class: tuple[int, ...] = ()  # each layer's storage class (the pool's page-id range it takes pages from)
    # may compaction write into a sequence's pages: at a prefill's last chunk, at decode steps, at
    # any prefill chunk (a method whose prefill_chunk keeps)?
    compacts_prefill: bool = False
    compacts_decode: bool = False
    compacts_chunks: bool = False
    rows: bool = False  # takes a row of the per-sequence tensors
    residual: int = 0  # slots its residual window holds (0: none)
    # what a sequence's residual window holds after a keep plan left n slots (KVExecutor.window_after)
    window_after: Callable[[int], int] = _no_window
    # codes written a block of this many tokens at a time (0: token by token): a page is named in the
    # prefix cache once its block's codes are (spec.flushed)
    flush_block: int = 0
    prefix_caching: bool = False  # takes prefix-cache hits and names its computed full pages
    # a method that compacts at prefill end reads hits but names nothing (its pages are cut); the last
    # `hit_margin` prompt tokens (its query window) are always computed; -1: no hits at all
    registers: bool = True
    hit_margin: int = 0
    salt: bytes | None = None  # its pages' prefix-cache salt (runtime/kv/page_pool.py); None: the pool's
    # its decode-time keep's rings, per prompt length and layer (runtime/kv/ring.py `Rings`); None: none rings
    rings: Rings | None = None


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, pool: PagePool, num_layers: int = 1, budget: KVBudget | None = None,
        chains: ChainStore | None = None, compacts: tuple[bool, ...] = (False, False),
        rows: RowPool | None = None, residual: int = 0, window_after: Callable[[int], int] | None = None,
        layer_class: tuple[int, ...] | None = None, flush_block: int = 0, rules: LaneRules | None = None,
    ) -> None:
        """The default lane's facts come as `rules`, or (one method) as the separate arguments."""
        self.config = config
        self.num_classes = pool.num_classes
        if rules is None:
            rules = LaneRules(
                budget=budget or FullBudget(),
                layer_class=tuple(layer_class) if layer_class is not None else (0,) * num_layers,
                compacts_prefill=compacts[0], compacts_decode=compacts[1], compacts_chunks=(*compacts, False)[2],
                rows=rows is not None, residual=residual, window_after=window_after or (lambda n: 0),
                flush_block=flush_block, prefix_caching=True)
        self.rules = rules
        self.check_rules(rules, num_layers)
        self._zero = [0] * self.num_classes
        self._held_memo: dict[tuple, list[int]] = {}  # `_held_pages`
        self.chains = chains
        self.rows = rows  # the per-sequence rows of every lane's tensors (None: no lane has any)
        self.pool = pool
        self.num_layers = num_layers
        self.prefix_caching = config.enable_prefix_caching and pool.enable_prefix_caching
        self.waiting: deque[Sequence] = deque()  # by arrival; preempted ones rejoin the front
        self.running: list[Sequence] = []  # by arrival; the last one is preempted first
        self._live: dict[int, Sequence] = {}
        self.num_preemptions = 0  # since start, for metrics and tests
        self.num_scheduled_tokens = 0  # tokens of every step advanced since start (metrics: tokens per step)

    def check_rules(self, rules: LaneRules, num_layers: int) -> None:
        if len(rules.layer_class) != num_layers or max(rules.layer_class, default=0) >= self.num_classes:
            raise ValueError(f"layer classes {rules.layer_class} for {num_layers} layers and {self.num_classes} "
                             "pool classes")

    def rules_of(self, seq: Sequence) -> LaneRules:
        """seq's lane's rules (the scheduler's own where it has none)."""
        return seq.rules or self.rules

    # the default lane's facts (one method: the engine's)
    @property
    def budget(self) -> KVBudget:
        return self.rules.budget

    @property
    def layer_class(self) -> tuple[int, ...]:
        return self.rules.layer_class

    @property
    def compacts_prefill(self) -> bool:
        return self.rules.compacts_prefill

    @property
    def compacts_decode(self) -> bool:
        return self.rules.compacts_decode

    @property
    def residual(self) -> int:
        return self.rules.residual

    # ---- queue -------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence; raises if it could never run, even alone."""
        if seq.status is not SequenceStatus.WAITING or seq.holds_pages or seq.seq_id in self._live:
            raise ValueError(f"{seq} cannot be added: it is not a fresh waiting sequence")
        n = len(seq.token_ids)
        if n + 1 > seq.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens, but the model's context is {seq.max_model_len} tokens "
                "(prompt plus at least one new token must fit)",
                param="prompt",
            )
        if seq.num_layers != self.num_layers:
            raise ValueError(f"{seq} has {seq.num_layers} page tables, the model {self.num_layers} layers")
        physical = seq.physical_prompt_len
        needed = self.pages_needed_by_class(physical, physical + 1, self.rules_of(seq))
        c = self.pool.oversized(needed)
        if c is not None:
            where = f" of storage class {c}" if self.num_classes > 1 else ""
            raise OutOfKVMemory(
                f"a prompt of {n} tokens plus one new token needs {needed[c]} KV pages{where} of "
                f"{self.pool.page_size} tokens, but the whole pool has {self.pool.sizes[c]}; "
                "give the engine more KV cache memory or shorten the prompt"
            )
        self._live[seq.seq_id] = seq
        if not self.waiting or self.waiting[-1].arrival <= seq.arrival:
            self.waiting.append(seq)
        else:  # rare: added out of arrival order
            i = bisect.bisect_right([s.arrival for s in self.waiting], seq.arrival)
            self.waiting.insert(i, seq)

    def pages_needed(self, prompt_len: int, context_len: int, rules: LaneRules | None = None) -> int:
        """Pages (all layers) a request holds at its worst: its prefill peak or its steady state at
        `context_len` tokens, by its method's budget (`rules`: its lane's; None: the default lane's)."""
        return sum(self.pages_needed_by_class(prompt_len, context_len, rules))

    def pages_needed_by_class(self, prompt_len: int, context_len: int, rules: LaneRules | None = None) -> list[int]:
        """`pages_needed` per storage class."""
        rules = rules or self.rules
        b, size = rules.budget, self.pool.page_size
        return self.by_class(
            (-(-max(b.peak_tokens(prompt_len, layer), b.steady_tokens(prompt_len, context_len, layer)) // size)
             for layer in range(self.num_layers)), rules)

    def by_class(self, per_layer, rules: LaneRules | None = None) -> list[int]:
        """Per-layer counts summed by storage class (of `rules`' layers; None: the default lane's)."""
        if self.num_classes == 1:
            return [sum(per_layer)]
        layer_class = (rules or self.rules).layer_class
        out = list(self._zero)
        for layer, n in enumerate(per_layer):
            out[layer_class[layer]] += n
        return out

    def _spares(self, seq: Sequence) -> list[int]:
        """seq's spare pages per class."""
        return self.pool.count_by_class(seq.spare_pages)

    def _growth(self, seq: Sequence, n: int) -> int:
        """Fresh pages seq needs so every layer can store n more tokens."""
        room = self._room(seq)
        if n <= room.least:
            return 0  # the common decode step: no layer is at a page boundary
        return room.growth(n)

    def _growth_by_class(self, seq: Sequence, n: int) -> list[int]:
        """`_growth` per storage class."""
        room = self._room(seq)
        if n <= room.least:
            return self._zero
        if self.num_classes == 1:
            return [room.growth(n)]
        return room.growth_by(n, self.rules_of(seq).layer_class, self.num_classes)

    def _room(self, seq: Sequence) -> Room:
        """seq's free slots per layer in the pages it holds. Walks the layers once per change of
        its tables other than `_take`'s appends (which update it); a step's tokens use it up in
        `advance`."""
        room = seq.room
        if room is not None and room.version == seq.tables_version:
            return room
        size = self.pool.page_size
        free = [len(t) * size - kv for kv, t in zip(seq.kv_lens, seq.page_tables)]
        # a ringed layer's tokens go into slots it holds (runtime/kv/ring.py)
        fixed = frozenset() if seq.ring is None else frozenset(np.flatnonzero(seq.ring.on).tolist())
        room = Room(seq.tables_version, free, size, fixed)
        seq.room = room
        return room

    def _copies(self, seq: Sequence, n: int) -> list[int]:
        """Spare pages (per storage class) seq's next step of n tokens may need for copy-on-write:
        its partial last pages when they are shared, or every shared page when the step may compact."""
        rules = self.rules_of(seq)
        if seq.chain is None and (not (self.prefix_caching and rules.prefix_caching)
                                  or (rules.hit_margin < 0 and not rules.registers)):
            return self._zero  # nothing shares its pages: no chain, no prefix-cache hit taken or given
        pool, size = self.pool, self.pool.page_size
        if seq.is_prefill:
            last = seq.num_computed_tokens + n == seq.prefill_end
            compacts = rules.compacts_chunks or (rules.compacts_prefill and last)
        else:
            compacts = rules.compacts_decode
        if compacts:
            return self.by_class((sum(pool.is_shared(p) for p in table) for table in seq.page_tables), rules)
        return self.by_class((kv % size != 0 and kv // size < len(t) and pool.is_shared(t[kv // size])
                              for kv, t in zip(seq.kv_lens, seq.page_tables)), rules)

    def _need(self, seq: Sequence, n: int) -> list[int]:
        """Pages of each storage class seq's next step of n tokens needs beyond its spare ones."""
        growth, copies = self._growth_by_class(seq, n), self._copies(seq, n)
        if self.num_classes == 1:
            return [growth[0] + copies[0] - len(seq.spare_pages)]
        return [g + c - s for g, c, s in zip(growth, copies, self._spares(seq))]

    def _take(self, seq: Sequence, n: int) -> None:
        """Allocates what `_need` counted: table growth and spare pages for copy-on-write."""
        copies = [c - s for c, s in zip(self._copies(seq, n), self._spares(seq))]
        room = self._room(seq)
        if n > room.least:
            short = room.short(n)
            if self.num_classes == 1:
                fresh = self.pool.allocate(sum(count for _, count in short))
                at = 0
                for layer, count in short:  # in layer order: the pages each layer always got
                    seq.grow_table(layer, fresh[at : at + count])
                    at += count
            else:
                layer_class = self.rules_of(seq).layer_class
                for layer, count in short:
                    seq.grow_table(layer, self.pool.allocate(count, layer_class[layer]))
            room.grew(short, seq.tables_version)
        for cls, count in enumerate(copies):
            if count > 0:
                seq.spare_pages += self.pool.allocate(count, cls)

    def _victim(self) -> Sequence:
        """The running sequence to preempt: the newest without a chain, else the newest."""
        for seq in reversed(self.running):
            if seq.chain is None:
                return seq
        return self.running[-1]

    def _evict_idle_chain(self, exclude=None) -> bool:
        return self.chains is not None and self.chains.evict_idle(exclude=exclude)

    def _row_free(self, seq: Sequence) -> bool:
        return not self.rules_of(seq).rows or self.rows.num_free > 0

    def _take_row(self, seq: Sequence) -> None:
        """seq's row of the per-sequence tensors; a chain continuation's starts as a copy of its
        record's (the runner copies it before the step)."""
        if not self.rules_of(seq).rows:
            return
        seq.row = self.rows.allocate()
        record = seq.chain
        if record is not None and record.row is not None:
            seq.row_source = record.row
            seq.resid_lens = [min(r, kv) for r, kv in zip(record.resid_lens, seq.kv_lens)]

    def abort(self, seq_id: int) -> Sequence | None:
        """Finishes a waiting or running sequence at once, freeing its pages. Unknown ids: None."""
        seq = self._live.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, FINISH_ABORT)
        return seq

    def clone(self, seq: Sequence, clones: list[Sequence]) -> list[tuple[int, int]]:
        """Admits `clones` (fresh sequences with seq's tokens) as running decodes, each with its
        own pages for every page seq holds; returns the (source page, clone page) pairs whose K/V
        the caller must copy. Raises (changing nothing) when seq is not a decoding, unchained
        running sequence, when the seats (`max_num_seqs`) or the free pages do not cover them."""
        if seq.status is not SequenceStatus.RUNNING or seq.is_prefill or seq.seq_id not in self._live:
            raise ValueError(f"{seq} cannot be cloned: only a running sequence past its prefill can")
        if seq.chain is not None or seq.spare_pages:
            raise ValueError(f"{seq} cannot be cloned: it continues a chain (its pages are shared)")
        if seq.pending:
            raise ValueError(f"{seq} cannot be cloned while its sampled token is pending (commit the step first)")
        seats = self.config.max_num_seqs - len(self.running)
        if len(clones) > seats:
            raise ConfigError(f"cloning {len(clones)} sequences needs {len(clones)} free seats, {seats} are left; "
                              "raise max_num_seqs", param="max_num_seqs")
        rules = self.rules_of(seq)
        per_clone = self.by_class((len(t) for t in seq.page_tables), rules)
        if not self.pool.fits([n * len(clones) for n in per_clone]):
            raise OutOfKVMemory(f"cloning {len(clones)} sequences of {sum(per_clone)} KV pages each needs "
                                f"{sum(per_clone) * len(clones)} pages, {self.pool.num_free} are free; "
                                "give the engine more KV cache memory or clone fewer")
        if rules.rows and self.rows.num_free < len(clones):
            raise OutOfKVMemory(f"cloning {len(clones)} sequences needs as many per-sequence rows, "
                                f"{self.rows.num_free} are free")
        for clone in clones:
            if clone.status is not SequenceStatus.WAITING or clone.holds_pages or clone.seq_id in self._live:
                raise ValueError(f"{clone} cannot receive a clone: it is not a fresh sequence")
        pairs: list[tuple[int, int]] = []
        for clone in clones:
            clone.rules, clone.lane = seq.rules, seq.lane
            clone.page_tables = [self.pool.allocate(len(table), rules.layer_class[layer])
                                 for layer, table in enumerate(seq.page_tables)]
            for src, dst in zip(seq.page_tables, clone.page_tables):
                pairs += zip(src, dst)
            clone.tables_version += 1
            clone.token_ids = list(seq.token_ids)
            clone.num_prompt_tokens = seq.num_prompt_tokens
            clone.num_computed_tokens = seq.num_computed_tokens
            clone.prefill_end = seq.prefill_end
            clone.kv_lens = list(seq.kv_lens)
            clone.kv_starts = [None if s is None else list(s) for s in seq.kv_starts]
            clone.ring = None if seq.ring is None else seq.ring.copy()
            clone.compressed = seq.compressed
            clone.page_hashes = list(seq.page_hashes)
            clone.history_gap = list(seq.history_gap)
            clone.verbatim_from = seq.verbatim_from
            clone.resid_lens = list(seq.resid_lens)
            if rules.rows:  # the caller copies the row with the pages
                clone.row = self.rows.allocate()
            clone.status = SequenceStatus.RUNNING
            self._live[clone.seq_id] = clone
            bisect.insort(self.running, clone, key=lambda s: s.arrival)
        return pairs

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Picks the next step's sequences and token counts; None when there is nothing to run.

        A sequence whose pending tokens (async scheduling, `schedule_ahead`) stop it by length is left out:
        its step would compute a token past its end."""
        budget = self.config.max_num_batched_tokens
        chunk_cap = self._chunk_cap()
        step: dict[int, int] = {}  # seq_id -> new tokens, in scheduling order
        preempted = False

        def reserve(seq: Sequence, n: int) -> bool:
            """Pages for seq's next n tokens, preempting the newest running sequences for them."""
            nonlocal budget, preempted
            while not self.pool.fits(self._need(seq, n)):
                if self._evict_idle_chain():
                    continue
                victim = self._victim()
                budget += step.pop(victim.seq_id, 0)  # it may already be in this step
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    return False
            self._take(seq, n)
            return True

        def run(queue: list[Sequence]) -> None:
            nonlocal budget
            for seq in queue:
                if budget == 0:
                    break
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # preempted for an older sequence in this loop
                n = min(seq.num_uncomputed_tokens, budget, chunk_cap)
                if reserve(seq, n):
                    step[seq.seq_id] = n
                    budget -= n

        decoding = [s for s in self.running if not s.is_prefill and not self._ends_ahead(s)]
        prefilling = [s for s in self.running if s.is_prefill]
        prefill_first = self.config.prefill_first and bool(prefilling or self.waiting)
        run(prefilling if prefill_first else decoding + prefilling)

        # Right after a preemption the pool is tight: admitting now would only thrash.
        if not preempted or not step:
            self._admit(step, budget, chunk_cap)
        if prefill_first and not step:  # nothing could prefill (no seat or pages): decode instead
            run(decoding)

        if not step:
            return None
        seqs = [self._live[i] for i in step]
        decodes = [s for s in seqs if not s.is_prefill]
        prefills = [s for s in seqs if s.is_prefill]
        return ScheduledBatch(
            seqs=decodes + prefills,
            num_new_tokens=[step[s.seq_id] for s in decodes + prefills],
            num_decodes=len(decodes),
        )

    def _admit(self, step: dict[int, int], budget: int, chunk_cap: int) -> None:
        """Moves waiting sequences to running, first come first served, into `step`."""
        pool = self.pool
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if seq.chain is not None:
                if not self._admit_chained(seq, step, budget, chunk_cap):
                    break
                budget -= step[seq.seq_id]
                continue
            layers, rules = self.num_layers, self.rules_of(seq)
            cached = self._hit_tokens(seq, rules)
            hits = pool.lookup_layers(cached, layers, rules.salt) if cached else [[]] * layers
            computed = len(hits[0]) * pool.page_size
            n = min(len(seq.token_ids) - computed, budget, chunk_cap)
            # the prompt stays resident until prefill_end: every layer needs pages for computed + n
            fresh = pool.pages_for(computed + n) - len(hits[0])
            revived = [sum(pool.ref_count(p) == 0 for p in table) for table in hits]  # cached hits, per layer
            if not pool.fits(self.by_class((fresh + r for r in revived), rules)) or not self._row_free(seq):
                if self._evict_idle_chain():
                    continue  # evicted chains' pages may also be prefix hits now: look again
                break
            self.waiting.popleft()
            self._take_row(seq)
            if cached:
                hits = pool.match_prefix_layers(cached, layers, rules.salt)
            seq.page_tables = [table + pool.allocate(fresh, rules.layer_class[layer])
                               for layer, table in enumerate(hits)]
            seq.tables_version += 1
            seq.kv_lens = [computed] * layers
            seq.compressed = False
            seq.num_computed_tokens = seq.num_cached_tokens = computed
            seq.prefill_end = len(seq.token_ids)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            step[seq.seq_id] = n
            budget -= n

    def _hit_tokens(self, seq: Sequence, rules: LaneRules) -> list[int]:
        """The prompt tokens seq may take from the prefix cache (none: []): a request still owed prompt
        logprobs computes every prompt position; a lane that compacts at prefill end computes its query
        window (`hit_margin`) and takes hits only where the pool also holds the copies its compaction
        makes of them (copy-on-write; docs/design.md, "Many methods in one batch")."""
        if not (self.prefix_caching and rules.prefix_caching) or rules.hit_margin < 0 or _wants_prompt_logits(seq):
            return []
        tokens = seq.token_ids[:len(seq.token_ids) - rules.hit_margin]
        if rules.compacts_prefill and tokens:
            n = len(seq.token_ids)
            peak = self.pages_needed_by_class(n, n + 1, rules)
            copies = self.by_class([self.pool.pages_for(len(tokens))] * self.num_layers, rules)
            if self.pool.oversized([a + b for a, b in zip(peak, copies)]) is not None:
                return []
        return tokens

    def _admit_chained(self, seq: Sequence, step: dict[int, int], budget: int, chunk_cap: int) -> bool:
        """Admits the head of the queue from its chain record (only its suffix to prefill); False
        when its pages do not fit, even with every idle chain evicted."""
        self.chains.attach(seq)
        seq.prefill_end = len(seq.token_ids)
        n = min(seq.num_uncomputed_tokens, budget, chunk_cap)
        while not self.pool.fits(self._need(seq, n)) or not self._row_free(seq):
            if not self._evict_idle_chain(exclude=seq.chain):
                self._free(seq)  # the record keeps its own references
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                return False
        self.waiting.popleft()
        self._take(seq, n)
        self._take_row(seq)
        self.chains.resume(seq)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)
        step[seq.seq_id] = n
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Back to the front of the waiting queue, without pages; it will recompute everything."""
        log.debug("preempting %s", seq)
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled: dict[int, int],
        compacted: dict[int, dict[int, int]] | None = None,
        rewritten: dict[int, dict[int, int]] | None = None,
    ) -> list[Sequence]:
        """Advances the step's sequences, appends their sampled tokens; returns the finished.

        `compacted[seq_id][layer]` is the physical length a method's keep plan left in that layer
        during the step: the pages past it go back to the pool now. (`advance` then `commit`: an
        async engine calls them apart, the step's launch between.)"""
        self.advance(batch, compacted, rewritten)
        return self.commit(batch, sampled)

    def advance(self, batch: ScheduledBatch, compacted: dict[int, dict[int, int]] | None = None,
                rewritten: dict[int, dict[int, int]] | None = None) -> None:
        """What a launched step changes whatever its tokens are: computed tokens, stored lengths,
        the pages a keep plan freed, the prefix cache's full pages; a sampling sequence's token
        becomes `pending` (its K/V is the next step's to compute)."""
        compacted, rewritten = compacted or {}, rewritten or {}
        self.num_scheduled_tokens += batch.num_tokens
        for i, (seq, n, samples) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.needs_sample())):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted (or finished by an earlier step's tokens) while the step ran
            before = seq.num_computed_tokens
            seq.num_computed_tokens += n
            rules = self.rules_of(seq)
            ring = seq.ring
            if ring is None:
                seq.kv_lens = [kv + n for kv in seq.kv_lens]
            elif not ring.steady:  # a ringed layer writes over its oldest recent token (runtime/kv/ring.py)
                seq.kv_lens = [kv if on else kv + n for kv, on in zip(seq.kv_lens, ring.on.tolist())]
            if rules.residual:  # the step's tokens joined each layer's residual window
                seq.resid_lens = [min(r + n, rules.residual) for r in seq.resid_lens]
            if seq.room is not None and seq.room.version == seq.tables_version:
                seq.room.use(n)
            if seq.spare_pages:  # copy-on-write pages the step did not need
                self.pool.free(seq.spare_pages)
                seq.spare_pages = []
            shrunk = compacted.get(seq.seq_id)
            if shrunk:
                self._shrink(seq, shrunk, decoding=i < batch.num_decodes)
                for layer, kept in shrunk.items():
                    seq.resid_lens[layer] = rules.window_after(kept)  # moved slots: codes (or re-stored)
            for layer, resid in rewritten.get(seq.seq_id, {}).items():
                seq.resid_lens[layer] = resid
            if (rules.rings is not None and (i < batch.num_decodes or samples) and seq.chain is None
                    and (ring is None or not ring.full)):  # a decoding row (or one from its first step on)
                ringed = ring.rules if ring is not None else rules.rings.of(seq.prefill_end)
                if ringed is not None:  # its keep's counts at its prompt ring (runtime/kv/ring.py `Rings`)
                    seq.ring = ringed.enter(seq.kv_lens, seq.num_computed_tokens, ring)
                    if seq.ring is not ring:
                        seq.room = None  # a ringed layer needs no room (`_room`)
            if self.prefix_caching and rules.prefix_caching and rules.registers and not seq.compressed:
                self._register_full_pages(seq, before, rules)
            if samples:
                seq.pending += 1

    def commit(self, batch: ScheduledBatch, sampled: dict[int, int], logprobs: dict | None = None) -> list[Sequence]:
        """Appends the advanced step's sampled tokens (with their logprobs, for the sequences that
        asked) and stops the sequences they end; returns the finished."""
        finished = []
        for seq, samples in zip(batch.seqs, batch.needs_sample()):
            if seq.status is not SequenceStatus.RUNNING or not samples:
                continue
            if seq.seq_id not in sampled:
                raise ValueError(f"sequence {seq.seq_id} reached its last token but got no sample")
            seq.pending -= 1
            seq.append_token(sampled[seq.seq_id], None if logprobs is None else logprobs.get(seq.seq_id))
            reason = seq.check_stop()
            growth = self._growth(seq, 1)  # 0: the pages it holds take the token (no need to count them)
            if reason is None and growth and self._outgrows(seq):
                # The pool could not hold this token's K/V even with the sequence alone in it.
                reason = FINISH_LENGTH
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _chunk_cap(self) -> int:
        """Tokens one sequence may compute in a step (its prefill chunk at most)."""
        budget = self.config.max_num_batched_tokens
        return min(self.config.max_prefill_chunk or budget, budget)

    @staticmethod
    def _ends_ahead(seq: Sequence) -> bool:
        """Does seq's pending token (async scheduling) stop it by length? Then no step computes past it."""
        return bool(seq.pending) and seq.stops_by_length

    @staticmethod
    def may_run_ahead(batch: ScheduledBatch) -> bool:
        """Can `batch` stay running while the next step is scheduled: none chained, none with structured
        outputs (whose next mask needs this step's token). Prefill chunks may: the next step continues
        them from the host's tokens."""
        return all(seq.chain is None and seq.params.structured_outputs is None for seq in batch.seqs)

    def schedule_ahead(self, launched: ScheduledBatch) -> ScheduledBatch | None:
        """The next step while `launched`'s tokens are still pending on the device (async scheduling):
        `schedule` over the running sequences' known and pending tokens (a decoding row decodes its
        pending token, a prefill goes on with its next chunk) and the waiting ones it admits, when
        nothing in it can preempt: the free pages take every running sequence's next step at its
        largest. None (the caller commits first and schedules normally) when they do not, when
        `launched` may not run ahead, or when a chained request waits (its admission attaches the
        chain's record)."""
        if not self.may_run_ahead(launched) or any(seq.chain is not None for seq in self.waiting):
            return None
        cap, need = self._chunk_cap(), [0] * self.num_classes
        for seq in self.running:
            n = min(seq.num_uncomputed_tokens, cap)
            if n and not self._ends_ahead(seq):
                need = [a + b for a, b in zip(need, self._need(seq, n))]
        if not self.pool.fits(need):
            return None
        return self.schedule()

    def _register_full_pages(self, seq: Sequence, computed_before: int, rules: LaneRules) -> None:
        """Names in the prefix cache each page that this step filled (under a flush block: whose block's
        codes this step wrote)."""
        size = self.pool.page_size
        first, end = computed_before // size, seq.num_computed_tokens // size
        if rules.flush_block:  # the pages of blocks with codes (the newest block's are in the window only)
            first, end = (flushed(n, rules.flush_block) // size for n in (computed_before, seq.num_computed_tokens))
        while len(seq.page_hashes) < end:
            i = len(seq.page_hashes)
            prev = seq.page_hashes[i - 1] if i else None
            seq.page_hashes.append(self.pool.page_hash(prev, seq.token_ids[i * size : (i + 1) * size], rules.salt))
        for i in range(first, end):
            for layer, table in enumerate(seq.page_tables):
                self.pool.register(table[i], self.pool.layer_key(seq.page_hashes[i], layer))

    def _outgrows(self, seq: Sequence) -> bool:
        """Could some storage class not hold seq's next token even with seq alone in the pool (its
        pages, the growth, and those its chain record pins)?"""
        growth = self._growth_by_class(seq, 1)
        held = self.by_class((len(t) for t in seq.page_tables), self.rules_of(seq))
        pinned = self._zero if seq.chain is None or self.chains is None else self.chains.extra_pages(seq)
        return any(g and g + h + p > size for g, h, p, size in zip(growth, held, pinned, self.pool.sizes))

    def _shrink(self, seq: Sequence, kept: dict[int, int], decoding: bool = False) -> None:
        """seq's layers now store `kept[layer]` tokens: free the pages past them. A decoding row
        (`decoding`: its keep ran at step end) keeps the pages it holds up to its budget's bound at its
        context (`_held_pages`: what the layer may hold before its keep runs again; else the next token's
        page), since it would take them again as it grows (a decode-time keep of 2,048 tokens every 128
        steps would free 8 pages a layer at each keep and take one back every 16 steps; one run every step,
        the page its step's token started). The
        truncation is logged, and its table readers apply it incrementally. Where no page is freed the
        tables keep their version and the room takes the freed slots (a decode-time keep in steady state:
        the same tokens in and out, every layer alike)."""
        version, drops, held = seq.tables_version, set(), None
        for layer, n in kept.items():
            pages = self.pool.pages_for(n)
            if decoding and len(seq.page_tables[layer]) > pages:  # pages it takes again before its next keep
                held = held or self._held_pages(seq)
                bound = n + 1 if held[layer] is None else held[layer]
                pages = max(pages, min(len(seq.page_tables[layer]), self.pool.pages_for(bound)))
            dropped = seq.truncate_table(layer, pages)
            if dropped:
                self.pool.free(dropped)
            drops.add(seq.kv_lens[layer] - n)
            seq.kv_lens[layer] = n
        seq.compressed = True
        if seq.tables_version == version and seq.room is not None and seq.room.version == version:
            if len(kept) == len(seq.kv_lens) and len(drops) == 1:
                seq.room.use(-drops.pop())
            else:
                seq.room = None  # rebuilt from the tables when next asked

    def _held_pages(self, seq: Sequence) -> list[int | None]:
        """Tokens each layer of a decoding row may hold before its keep runs again: its budget's
        `steady_tokens` at the row's next step, where that bound stays put over the next page of context (a
        decode-time keep bounds the layer); None where it grows with the context (a budget that does not
        bound decode: only the next token's page is kept). Memoised per lane, prompt length and context:
        rows that began decoding together share it."""
        key = (id(self.rules_of(seq)), seq.prefill_end, seq.num_computed_tokens)
        held = self._held_memo.get(key)
        if held is None:
            budget, size = self.rules_of(seq).budget, self.pool.page_size
            context, prompt = seq.num_computed_tokens + 1, seq.prefill_end
            held = []
            for layer in range(self.num_layers):
                bound = budget.steady_tokens(prompt, context, layer)
                held.append(bound if budget.steady_tokens(prompt, context + size, layer) == bound else None)
            if len(self._held_memo) >= 256:
                self._held_memo.clear()
            self._held_memo[key] = held
        return held

    def _free(self, seq: Sequence) -> None:
        if seq.spare_pages:
            self.pool.free(seq.spare_pages)
            seq.spare_pages = []
        if seq.row is not None:
            self.rows.free(seq.row)
            seq.row = None
        for table in seq.reset_cache():
            self.pool.free(table)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.chain is not None and self.chains is not None:
            if seq.spare_pages:
                self.pool.free(seq.spare_pages)
                seq.spare_pages = []
            self.chains.end_turn(seq)  # a running sequence's pages become the chain's
        self._free(seq)
        seq.finish(reason)
        del self._live[seq.seq_id]


def _wants_prompt_logits(seq: Sequence) -> bool:
    """Does the sequence still need the logits of prompt positions (prompt logprobs not all held)?"""
    return seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens
