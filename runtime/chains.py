"""The chain cache: a session's KV cache kept between turns, so a new turn prefills only its suffix.

Where it sits: the engine validates a chained request with `ChainStore.begin` (synchronously, so
errors reach the caller at once), the scheduler starts the admitted sequence from the record's
pages (`attach` + `resume`) and hands the sequence's state back when the request finishes, stops
or is aborted (`end_turn`); under memory pressure it evicts idle records oldest first
(`evict_idle`) before it preempts anything. The method's per-sequence state crosses turns only
through the contract's `turn_end` / `turn_resume` (methods listing `Hook.TURN`).

A `ChainRecord` holds page references (one table per layer, in the pool's reference counts),
physical lengths and per-head start slots, the method state, the logical token history (with a
digest), the fingerprint of model + method + parameters, active/idle state, last use and owner.

Semantics (docs/design.md, "Chain cache"):
- Continue: the prompt must extend the history. The record stays untouched for the whole turn
  (its pages are pinned by its own references); the sequence shares them and copies a page before
  writing into it (the partial last page, or compaction in place): copy-on-write. So a turn that
  is preempted, or aborted before it computed anything, leaves the chain's state intact, and
  forks share pages for free.
- Rollback: where the prompt diverges from the history, the chain rolls back to the common
  prefix when every token after it is stored verbatim (appended after the last compaction, or
  inside a keep's `+ last N`: `verbatim_from`); otherwise `ChainDiverged`.
- Turn end: the sequence's computed tokens, pages and method state become the record's; the
  record's previous pages are released (shared ones stay with whoever else holds them).
- Automatic chains (`ChainSpec(auto=True)`, `kvc serve --auto-chain`): a request that names no
  chain continues the owner's idle chain whose history it extends (`find`: the rule is there),
  else opens one. Limits (`ChainLimits`: a TTL, a count) drop idle chains (`expire`).
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import secrets
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from kvc.runtime.errors import (
    ChainBusy,
    ChainCapacity,
    ChainDiverged,
    ChainMethodMismatch,
    ChainEvicted,
    ChainNotFound,
    KvcError,
)
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.kv.positions import full_map, tail_is_verbatim, truncate_map
from kvc.runtime.kv.rows import RowPool
from kvc.runtime.method_api import Hook, KVMethod

_GONE_LIMIT = 65536  # evicted / dropped ids remembered for their 410


@dataclass(frozen=True)
class ChainSpec:
    """What a request asks of the chain cache; exactly one of `open`, `continue_id`, `fork_id`, `auto`."""

    open: bool = False  # {"chain": true}: record this request's KV as a new chain
    continue_id: str | None = None  # {"chain_id": ID}
    fork_id: str | None = None  # {"chain_fork": ID}: a new chain starting from ID's state
    # continue the owner's idle chain this prompt extends (`ChainStore.find`, at least
    # `auto_min_tokens` tokens in common), else open a new one
    auto: bool = False
    auto_min_tokens: int = 1
    owner: str | None = None  # opaque owner key (the server passes a hash of the API key)
    # the prompt's chat messages as logical token ranges (chain_prune.Segment), for prunes by
    # message index or role; None when unknown (a raw prompt)
    segments: tuple | None = None

    def __post_init__(self) -> None:
        if sum((bool(self.open), self.continue_id is not None, self.fork_id is not None, bool(self.auto))) != 1:
            raise KvcError("a chained request opens, continues or forks exactly one chain", param="chain")
        if self.auto_min_tokens < 1:
            raise KvcError("auto_min_tokens must be at least 1", param="chain")


@dataclass(frozen=True)
class ChainLimits:
    """Bounds on idle chains (the server's --chain-ttl, --max-chains); None: unbounded. Active
    chains are never dropped, so a store may hold more than `max_chains` while they run."""

    ttl: float | None = None  # seconds an idle chain is kept after its last use
    max_chains: int | None = None  # chains kept at most; the least recently used idle ones go first

    def __post_init__(self) -> None:
        if self.ttl is not None and not self.ttl > 0:
            raise KvcError("the chain TTL must be a positive number of seconds", param="chain_ttl")
        if self.max_chains is not None and self.max_chains < 1:
            raise KvcError("the chain limit must be at least 1", param="max_chains")


class ChainState(enum.Enum):
    ACTIVE = "active"  # a request runs on it (busy); never evicted
    IDLE = "idle"  # waiting for the next turn; evictable under memory pressure


@dataclass
class ChainRecord:
    chain_id: str
    owner: str | None
    fingerprint: str
    page_tables: list[list[int]]  # per layer, the pages this record holds a reference on
    kv_lens: list[int]  # physical tokens per layer
    kv_starts: list[list[int] | None]  # per layer, per KV head first slot (None: all 0)
    tokens: list[int] = field(default_factory=list)  # logical history: tokens whose K/V are stored
    turn_prompt: int = 0  # tokens[:turn_prompt] is the last turn's prompt (the client's); after it, its reply
    verbatim_from: int = 0  # logical position from which every layer's stored tail is verbatim
    compressed: bool = False  # pages no longer equal the logical tokens
    method_state: Any = None  # KVMethod.turn_end's opaque value
    lane: Any = None  # the engine's lane it was recorded in (runtime/lanes.py; None: the default one)
    # the KV spec's per-sequence tensors (runtime/kv/rows.py): the record's row (None: none) and,
    # per layer, the newest stored slots its residual window holds in full precision
    row: int | None = None
    resid_lens: list = field(default_factory=list)
    # Per layer: the logical position of each stored slot (runtime/kv/positions.py; None: verbatim)
    # and the newest post-RoPE queries of the history's prefills [w, Hq, D] (a prune's
    # scorer reads them).
    positions: list = field(default_factory=list)
    window_queries: list = field(default_factory=list)
    segments: list | None = None  # chat messages as token ranges (chain_prune.Segment); None: unknown
    pruned: set = field(default_factory=set)  # logical ranges pruned so far
    state: ChainState = ChainState.ACTIVE
    last_use: int = 0  # a logical clock: LRU order
    last_used: float = field(default_factory=time.time)  # unix time of the last use, for clients
    digest: str = field(default="", init=False)

    def __post_init__(self) -> None:
        self.set_tokens(self.tokens)
        layers = len(self.page_tables)
        self.resid_lens = self.resid_lens or [0] * layers
        self.positions = self.positions or [None] * layers
        self.window_queries = self.window_queries or [None] * layers

    def set_tokens(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.digest = hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).hexdigest()

    def pages(self) -> set[int]:
        return {p for table in self.page_tables for p in table}


def _turn_segments(seq, history: int) -> list | None:
    """The messages of a finished turn: the prompt's (given by the server) and the reply."""
    if seq.segments is None:
        return None
    from kvc.runtime.chain_prune import Segment

    segments = [s for s in seq.segments if s.start < history]
    if history > seq.num_prompt_tokens:
        segments.append(Segment("assistant", seq.num_prompt_tokens, history))
    return segments


def _describe(record: ChainRecord) -> dict:
    return {"tokens": len(record.tokens), "state": record.state.value, "last_used": record.last_used,
            "pages": sum(len(table) for table in record.page_tables), "stored_tokens": sum(record.kv_lens),
            "messages": None if record.segments is None else len(record.segments)}


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChainStore:
    """Every chain of one engine, keyed by an unguessable id."""

    def __init__(self, pool: PagePool, num_layers: int, method: KVMethod, fingerprint: str,
                 rows: RowPool | None = None, copy_row=None) -> None:
        self.pool = pool
        self.rows = rows  # the per-sequence rows; a record holds the row of its last turn
        self.copy_row = copy_row  # (src, dst): a row's content copied on the device (a fork's)
        # (seq): its layers back in time order before its pages become the record's, where a keep evicted in
        # place (StepHooks.settle; runtime/kv/slot_order.py); None: nothing to do
        self.settle = None
        self.num_layers = num_layers
        self.method = method
        self.fingerprint = fingerprint
        self._records: dict[str, ChainRecord] = {}
        self.next_id: str | None = None  # the next record's id where another rank chose it (tensor parallelism)
        self._gone: OrderedDict[str, str | None] = OrderedDict()  # id -> owner, for 410
        self._clock = itertools.count(1)
        self.limits = ChainLimits()
        # the TTL applies only in `expire(sweep=True)`, between steps (tensor parallelism: the leader's clock
        # decides and the other ranks drop what it dropped, `forget`); the count cap is a logical clock's
        self.ttl_by_sweep = False
        self.evicted_total = 0
        self.expired_total = 0  # idle chains dropped by `limits`
        self.reused_tokens_total = 0
        self.prefilled_tokens_total = 0
        self.prunes_total = 0  # runtime/chain_prune.py counts its work here
        self.pruned_tokens_total = 0  # slots dropped by prunes, over layers and KV heads

    # ---- lookup ------------------------------------------------------------------------------
    def get(self, chain_id: str, owner: str | None) -> ChainRecord:
        """The record, or ChainNotFound (unknown, or another owner's) / ChainEvicted."""
        record = self._records.get(chain_id)
        if record is not None and record.owner == owner:
            return record
        if record is None and chain_id in self._gone and self._gone[chain_id] == owner:
            raise ChainEvicted(f"chain {chain_id!r} was evicted or dropped; start a new chain", param="chain_id")
        raise ChainNotFound(f"no chain {chain_id!r}", param="chain_id")

    def _touch(self, record: ChainRecord) -> None:
        record.last_use = next(self._clock)
        record.last_used = time.time()

    def info(self, chain_id: str, owner: str | None) -> dict:
        """What a client may see of its chain (ChainNotFound / ChainEvicted as `get`)."""
        return _describe(self.get(chain_id, owner))

    def owned(self, owner: str | None) -> list[dict]:
        """What `info` shows of each of the owner's chains (with its id), most recently used first."""
        mine = sorted((r for r in self._records.values() if r.owner == owner), key=lambda r: -r.last_use)
        return [{"id": r.chain_id, **_describe(r)} for r in mine]

    def __contains__(self, chain_id: str) -> bool:
        return chain_id in self._records

    def records(self) -> list[ChainRecord]:
        return list(self._records.values())

    # ---- a request starts --------------------------------------------------------------------
    def begin(self, spec: ChainSpec, prompt: Seq[int], lane=None) -> ChainRecord:
        """The record the request runs on, now active; rolls back to the prompt's common prefix
        with the history where it may. Raises the chain errors; changes nothing when it does
        (except a rollback, which leaves a valid, shorter chain). `lane`: the request's method's
        (runtime/lanes.py; None: the engine's default): a chain continues only in the lane that
        recorded it (ChainMethodMismatch)."""
        self.expire()
        fingerprint = self.fingerprint if lane is None else lane.fingerprint
        if spec.auto:
            found = self.find(spec.owner, prompt, spec.auto_min_tokens, fingerprint)
            if found is not None:
                spec = ChainSpec(continue_id=found.chain_id, owner=spec.owner)
        if spec.open or spec.auto:
            record = self._new(spec.owner, [[] for _ in range(self.num_layers)], [0] * self.num_layers,
                               [None] * self.num_layers, fingerprint, lane)
            self.expire()  # one more chain: the least recently used idle one may go
            return record
        if spec.continue_id is not None:
            record = self.get(spec.continue_id, spec.owner)
            self._check_usable(record, fingerprint, lane)
            self._match(record, prompt)
            record.state = ChainState.ACTIVE
            return record
        source = self.get(spec.fork_id, spec.owner)
        self._check_usable(source, fingerprint, lane)
        for table in source.page_tables:
            self.pool.acquire(table)
        fork = self._new(spec.owner, [list(t) for t in source.page_tables], list(source.kv_lens),
                         [None if s is None else list(s) for s in source.kv_starts], fingerprint, lane)
        fork.set_tokens(list(source.tokens))
        fork.turn_prompt = source.turn_prompt
        fork.verbatim_from, fork.compressed = source.verbatim_from, source.compressed
        if source.row is not None:  # rows are never shared: the fork gets a copy of the source's
            try:
                fork.row = self._fresh_row(exclude=source)
            except ChainCapacity:
                self._remove(fork, remember=False)
                raise
            self.copy_row([source.row], [fork.row])
            fork.resid_lens = list(source.resid_lens)
        fork.method_state = source.method_state  # turn_resume copies it
        fork.positions, fork.window_queries = list(source.positions), list(source.window_queries)
        fork.segments = None if source.segments is None else list(source.segments)
        fork.pruned = set(source.pruned)
        self._touch(source)
        try:
            self._match(fork, prompt)
        except ChainDiverged:
            self._remove(fork, remember=False)
            raise
        self.expire()
        return fork

    def find(self, owner: str | None, prompt: Seq[int], min_tokens: int = 1,
             fingerprint: str | None = None) -> ChainRecord | None:
        """The idle chain of `owner` that `prompt` continues, for an automatic chain; None when none.

        The rule: the chain's history up to the end of its last turn's prompt is a prefix of
        `prompt`; its last reply may differ from what the client resent (re-tokenized, cut by a stop
        string), so the chain rolls back to the common prefix, which must be allowed (the tokens
        after it stored verbatim, as for an explicit continuation) and at least `min_tokens` long.
        Of several, the longest common prefix wins, then the most recent use. Another owner's
        chains, active ones, and a history the prompt does not extend (another branch of the
        conversation) never match."""
        prompt = list(prompt)
        fingerprint = fingerprint or self.fingerprint  # chains of the request's lane only
        best: ChainRecord | None = None
        best_common = 0
        for record in self._records.values():
            if record.owner != owner or record.state is not ChainState.IDLE or record.fingerprint != fingerprint:
                continue
            anchor = min(record.turn_prompt, len(record.tokens))
            if len(prompt) < anchor or prompt[:anchor] != record.tokens[:anchor]:  # compared in C: cheap
                continue
            common = anchor + common_prefix(record.tokens[anchor:], prompt[anchor:])
            common = min(common, len(prompt) - 1)
            if common < min_tokens or not self._can_roll_back(record, common):
                continue
            if common > best_common or (common == best_common and best is not None
                                        and record.last_use > best.last_use):
                best, best_common = record, common
        return best

    def _fresh_row(self, exclude: ChainRecord) -> int:
        """A free row, evicting idle chains for it (never `exclude`); ChainCapacity when none frees one."""
        while self.rows.num_free == 0:
            if not self.evict_idle(exclude=exclude):
                raise ChainCapacity("no per-sequence row is free for the fork; retry later", param="chain_id")
        return self.rows.allocate()

    def abandon(self, record: ChainRecord, spec: ChainSpec) -> None:
        """Undoes `begin` for a request that was refused afterwards (capacity, bad options)."""
        continued = spec.continue_id is not None or (spec.auto and bool(record.tokens))  # an opened one has none
        if continued:
            record.state = ChainState.IDLE
            self._touch(record)
        else:
            self._remove(record, remember=False)

    def _new(self, owner, tables, kv_lens, kv_starts, fingerprint: str, lane) -> ChainRecord:
        chain_id, self.next_id = self.next_id or "chain-" + secrets.token_urlsafe(24), None
        record = ChainRecord(chain_id, owner, fingerprint, tables, kv_lens, kv_starts,
                             last_use=next(self._clock), lane=lane)
        self._records[chain_id] = record
        return record

    def _check_usable(self, record: ChainRecord, fingerprint: str, lane) -> None:
        if record.state is ChainState.ACTIVE:
            raise ChainBusy(f"a request is already running on chain {record.chain_id!r}; one at a time",
                            param="chain_id")
        if record.fingerprint != fingerprint:
            if record.lane is not None or lane is not None:
                raise ChainMethodMismatch(
                    f"chain {record.chain_id!r} was recorded by method {self.method_of(record).name!r}"
                    f"{_params(record.lane)}; continue it with that method and parameters (asked: "
                    f"{(lane.method if lane is not None else self.method).name!r}{_params(lane)})", param="method")
            raise ChainDiverged(f"chain {record.chain_id!r} was recorded with another model, method or "
                                "parameters", param="chain_id")

    def method_of(self, record: ChainRecord) -> KVMethod:
        """The method a record's turns run (its lane's)."""
        return self.method if record.lane is None else record.lane.method

    def _match(self, record: ChainRecord, prompt: Seq[int]) -> None:
        """Makes the record's history a prefix of `prompt` (leaving at least the prompt's last
        token to compute, for its logit), rolling back where allowed."""
        history = len(record.tokens)
        common = min(common_prefix(record.tokens, prompt), len(prompt) - 1)
        if common == history:
            return
        if not self._can_roll_back(record, common):
            why = ("the prompt ends inside the history" if common == len(prompt) - 1 else
                   f"the prompt differs from the history at token {common}")
            raise ChainDiverged(
                f"{why} of chain {record.chain_id!r} ({history} tokens); the method "
                f"{self.method_of(record).name!r} compressed "
                f"the history before token {record.verbatim_from}, so the chain can roll back to token "
                f"{record.verbatim_from} or later only; resend the conversation as recorded, or start a new chain",
                param="chain_id")
        self._truncate(record, common)

    def _can_roll_back(self, record: ChainRecord, common: int) -> bool:
        """Whether the record may roll back to its first `common` tokens (every later one verbatim)."""
        return common >= len(record.tokens) or common >= record.verbatim_from or self._tail_stored(record, common)

    def _tail_stored(self, record: ChainRecord, common: int) -> bool:
        """Whether every layer still stores the history's tokens from `common` on, as its last
        slots in order (a method without a `+ last N` promise may still hold them: TOVA evicts one
        token per step, rarely the newest); read from the position maps."""
        history = len(record.tokens)
        for layer, head in enumerate(record.positions):
            length = record.kv_lens[layer]
            if head is None:
                continue  # stored verbatim: the newest slots are the newest tokens
            full = full_map(head, length, history, head.shape[0], head.device)
            if not tail_is_verbatim(full, record.kv_starts[layer], length, common, history):
                return False
        return True

    def _truncate(self, record: ChainRecord, length: int) -> None:
        """Rolls the record back to its first `length` logical tokens (all dropped ones verbatim)."""
        drop = len(record.tokens) - length
        for layer, table in enumerate(record.page_tables):
            kv = record.kv_lens[layer] - drop
            if kv < 0:
                raise RuntimeError(f"chain {record.chain_id}: rollback below the stored tokens of layer {layer}")
            keep = self.pool.pages_for(kv)
            self.pool.free(table[keep:])
            del table[keep:]
            record.kv_lens[layer] = kv
            record.resid_lens[layer] = max(0, record.resid_lens[layer] - drop)
            record.positions[layer] = truncate_map(record.positions[layer], kv)
        record.set_tokens(record.tokens[:length])
        record.turn_prompt = min(record.turn_prompt, length)
        if record.segments is not None:
            record.segments = [s if s.end <= length else type(s)(s.role, s.start, length)
                               for s in record.segments if s.start < length]
        record.pruned = {(a, min(b, length)) for a, b in record.pruned if a < length}

    # ---- the scheduler: admission, turn end ----------------------------------------------------
    def attach(self, seq) -> None:
        """Starts an admitted sequence from its record: shared pages (one more reference each),
        physical lengths and starts; the history counts as computed."""
        record: ChainRecord = seq.chain
        for table in record.page_tables:
            self.pool.acquire(table)
        seq.page_tables = [list(t) for t in record.page_tables]
        seq.kv_lens = list(record.kv_lens)
        seq.kv_starts = [None if s is None else list(s) for s in record.kv_starts]
        seq.tables_version += 1
        history = len(record.tokens)
        seq.num_computed_tokens = seq.num_cached_tokens = history
        seq.compressed = record.compressed
        seq.verbatim_from = record.verbatim_from
        seq.history_gap = [history - kv for kv in record.kv_lens]
        seq.positions = list(record.positions)
        seq.window_queries = list(record.window_queries)

    def resume(self, seq) -> None:
        """The admission went through: the method gets the chain's state for this sequence."""
        record: ChainRecord = seq.chain
        method = self.method_of(record)
        hooks = method.hooks
        if Hook.RELEASE in hooks:
            method.release(seq.seq_id)  # what a preempted attempt of this turn left behind
        if Hook.TURN in hooks:
            method.turn_resume(seq.seq_id, record.method_state, list(seq.kv_lens))
        history = len(record.tokens)
        self.reused_tokens_total += history
        self.prefilled_tokens_total += len(seq.token_ids) - history

    def end_turn(self, seq) -> None:
        """The request finished, stopped or was aborted. A running sequence's computed tokens, pages
        and method state become the chain's (its tables are taken: the caller frees nothing of
        them); a waiting one (never admitted, or preempted) leaves the chain as it was."""
        from kvc.runtime.sequence import SequenceStatus

        record: ChainRecord = seq.chain
        if record is None or self._records.get(record.chain_id) is not record:
            return
        if seq.status is SequenceStatus.RUNNING:
            if self.settle is not None:
                self.settle(seq)
            old = record.page_tables
            tables = seq.page_tables
            for layer, table in enumerate(tables):  # pages taken for a step that never ran
                keep = self.pool.pages_for(seq.kv_lens[layer])
                self.pool.free(table[keep:])
                del table[keep:]
            seq.page_tables = [[] for _ in tables]
            seq.tables_version += 1
            record.page_tables = tables
            record.kv_lens = list(seq.kv_lens)
            record.kv_starts = [None if s is None else list(s) for s in seq.kv_starts]
            record.set_tokens(list(seq.token_ids[: seq.num_computed_tokens]))
            record.turn_prompt = min(seq.num_prompt_tokens, len(record.tokens))
            record.verbatim_from = min(seq.verbatim_from, len(record.tokens))
            record.compressed = seq.compressed
            record.positions = seq.positions
            record.window_queries = seq.window_queries
            record.segments = _turn_segments(seq, len(record.tokens))
            method = self.method_of(record)
            record.method_state = method.turn_end(seq.seq_id) if Hook.TURN in method.hooks else None
            for table in old:
                self.pool.free(table)
            if seq.row is not None:  # the record takes the sequence's row (its residual windows)
                if record.row is not None:
                    self.rows.free(record.row)
                record.row, seq.row = seq.row, None
                record.resid_lens = list(seq.resid_lens)
        record.state = ChainState.IDLE
        self._touch(record)
        self.expire()

    # ---- memory ------------------------------------------------------------------------------
    def expire(self, now: float | None = None, sweep: bool = False) -> list[str]:
        """Drops the idle chains `limits` no longer allows: unused for `ttl` seconds (with `ttl_by_sweep`,
        only in a `sweep`), then the least recently used beyond `max_chains`. Their pages are freed and
        their ids answer 410 (like an eviction). Returns the ids dropped."""
        ttl, cap = self.limits.ttl, self.limits.max_chains
        if self.ttl_by_sweep and not sweep:
            ttl = None
        if ttl is None and cap is None:
            return []
        now = time.time() if now is None else now
        idle = sorted((r for r in self._records.values() if r.state is ChainState.IDLE), key=lambda r: r.last_use)
        drop = [r for r in idle if ttl is not None and now - r.last_used >= ttl]
        if cap is not None:
            expired = {id(r) for r in drop}  # records compare by identity here (their fields hold tensors)
            kept = [r for r in idle if id(r) not in expired]
            drop += kept[: max(0, len(self._records) - len(drop) - cap)]
        for record in drop:
            self._remove(record, remember=True)
        self.expired_total += len(drop)
        return [record.chain_id for record in drop]

    def forget(self, chain_ids: Seq[str]) -> None:
        """Drops these idle chains as `expire` did on another rank (tensor parallelism)."""
        for chain_id in chain_ids:
            self._remove(self._records[chain_id], remember=True)
        self.expired_total += len(chain_ids)

    def evict_idle(self, exclude: ChainRecord | None = None) -> bool:
        """Evicts the idle chain used longest ago (never `exclude`); False when there is none."""
        idle = [r for r in self._records.values() if r.state is ChainState.IDLE and r is not exclude]
        if not idle:
            return False
        self._remove(min(idle, key=lambda r: r.last_use), remember=True)
        self.evicted_total += 1
        return True

    def drop(self, chain_id: str, owner: str | None) -> None:
        """Forgets a chain and releases its pages (later use: 410)."""
        record = self.get(chain_id, owner)
        if record.state is ChainState.ACTIVE:
            raise ChainBusy(f"a request is running on chain {chain_id!r}; drop it when the request is done",
                            param="chain_id")
        self._remove(record, remember=True)

    def _remove(self, record: ChainRecord, remember: bool) -> None:
        for table in record.page_tables:
            self.pool.free(table)
        if record.row is not None:
            self.rows.free(record.row)
            record.row = None
        record.page_tables = [[] for _ in record.page_tables]
        del self._records[record.chain_id]
        if remember:
            self._gone[record.chain_id] = record.owner
            while len(self._gone) > _GONE_LIMIT:
                self._gone.popitem(last=False)

    def pinned_pages(self, exclude: ChainRecord | None = None) -> list[int]:
        """Distinct pages held by active chains other than `exclude` (never evicted), per storage class."""
        pages: set[int] = set()
        for r in self._records.values():
            if r.state is ChainState.ACTIVE and r is not exclude:
                pages |= r.pages()
        return self.pool.count_by_class(pages)

    def extra_pages(self, seq) -> list[int]:
        """Pages seq's chain pins beyond those the sequence itself holds, per storage class."""
        if seq.chain is None:
            return [0] * self.pool.num_classes
        own = {p for table in seq.page_tables for p in table}
        return self.pool.count_by_class(seq.chain.pages() - own)

    def references(self) -> Counter:
        """page -> references the records hold (for invariant checks)."""
        return Counter(p for r in self._records.values() for table in r.page_tables for p in table)

    def stats(self) -> dict[str, int]:
        records = self._records.values()
        pages: set[int] = set()
        for r in records:
            pages |= r.pages()
        return {
            "active": sum(r.state is ChainState.ACTIVE for r in records),
            "idle": sum(r.state is ChainState.IDLE for r in records),
            "evicted_total": self.evicted_total,
            "expired_total": self.expired_total,
            "pages": len(pages),
            "reused_tokens_total": self.reused_tokens_total,
            "prefilled_tokens_total": self.prefilled_tokens_total,
            "prunes_total": self.prunes_total,
            "pruned_tokens_total": self.pruned_tokens_total,
        }


def _params(lane) -> str:
    """A lane's parameters as the error names them (none where it runs the loaded ones)."""
    params = getattr(lane, "params", None)
    return f" with parameters {params}" if params else ""
