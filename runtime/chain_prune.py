"""Prefix pruning: dropping low-value history (stale tool results) from an idle chain.

A prune names logical token ranges of the chain's history (directly, or as messages by index or
role, through the message segments the server recorded) and how much of each to keep (a fraction
or a token count, per layer and KV head). The kept tokens of a range are the best-scored ones
under a method's token scores (`KVMethod.token_scores`: SnapKV's observation-window votes, H2O's
attention sums, ...), fed the chain's stored window of recent queries and each head's stored keys.
Everything outside the ranges stays. The K/V move with the compaction kernels (in place, after
copy-on-write of pages a fork or the prefix cache shares); the pages past the new length go back
to the pool.

Matching stays valid: the logical history (tokens, digest) does not change, so the next turn that
resends the conversation continues the chain; only its stored form is smaller. The chain's
position maps (runtime/kv/positions.py) say which slots hold which tokens, so a pruned chain can be
pruned again, and the verbatim tail (rollback) starts after the last token a prune dropped.

Layout: a layer stored with one length for every KV head stays so (each head drops as many tokens
of a range as the head that may drop fewest: no head keeps less than asked); a layer already
stored with per-head starts (head-adaptive methods) drops per head. Per-token method state
(`turn_end`'s per-layer [Hkv, T] tensors) moves with the same plan; state kept in the pages'
state planes (`IN_PAGES` layers, runtime/kv/state_planes.py) moves with the K/V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvc.runtime.errors import ChainCapacity, ChainBusy, ConfigError, KvcError
from kvc.runtime.kv.compaction import CompactionJob, batch_of_jobs
from kvc.runtime.kv.page_pool import PoolExhausted
from kvc.runtime.kv.positions import compact_map, full_map
from kvc.runtime.method_api import LayerCacheView

class InvalidPrune(KvcError):
    """A prune request that names nothing prunable, or bad keep options."""


@dataclass(frozen=True)
class Segment:
    """One chat message's tokens in a chain's logical history, [start, end)."""

    role: str
    start: int
    end: int


@dataclass(frozen=True)
class PruneRequest:
    """What to prune and how much to keep. Selectors add up: `token_ranges`, message indices
    `messages`, and every message whose role is in `roles`; `older_than_rounds` N limits the
    message selectors to messages followed by at least N assistant messages."""

    token_ranges: tuple[tuple[int, int], ...] = ()
    messages: tuple[int, ...] = ()
    roles: tuple[str, ...] = ()
    older_than_rounds: int = 0
    keep: float | None = None  # fraction of each range's stored tokens, per layer and KV head
    keep_tokens: int | None = None  # or a count per range, per layer and KV head
    scorer: str | None = None  # a method name; None: the engine's --prune-scorer, else the served method
    scorer_params: dict | None = None
    skip_pruned: bool = False  # leave ranges a prune already covered (the automatic prune)

    def __post_init__(self) -> None:
        if not (self.token_ranges or self.messages or self.roles):
            raise InvalidPrune("name what to prune: token_ranges, messages (indices) or roles", param="roles")
        if (self.keep is None) == (self.keep_tokens is None):
            raise InvalidPrune("give exactly one of keep (a fraction) and keep_tokens (a count)", param="keep")
        if self.keep is not None and not (isinstance(self.keep, (int, float)) and 0.0 <= self.keep < 1.0):
            raise InvalidPrune(f"keep is the fraction of each range to keep, in [0, 1), got {self.keep!r}",
                               param="keep")
        if self.keep_tokens is not None and (isinstance(self.keep_tokens, bool) or not isinstance(
                self.keep_tokens, int) or self.keep_tokens < 0):
            raise InvalidPrune(f"keep_tokens must be a count >= 0, got {self.keep_tokens!r}", param="keep_tokens")
        if isinstance(self.older_than_rounds, bool) or not isinstance(self.older_than_rounds, int) \
                or self.older_than_rounds < 0:
            raise InvalidPrune(f"older_than_rounds must be an integer >= 0, got {self.older_than_rounds!r}",
                               param="older_than_rounds")
        for a, b in self.token_ranges:
            if not (isinstance(a, int) and isinstance(b, int)) or a < 0 or b <= a:
                raise InvalidPrune(f"a token range is [start, end) with 0 <= start < end, got [{a}, {b}]",
                                   param="token_ranges")

    def kept(self, stored: int) -> int:
        """How many of a range's `stored` tokens (one layer, one KV head) survive."""
        if self.keep is not None:
            return min(stored, math.ceil(self.keep * stored))
        return min(stored, self.keep_tokens)


@dataclass
class PruneReport:
    ranges: list[tuple[int, int]]  # the logical ranges pruned
    tokens: int  # the chain's logical history (unchanged)
    stored_before: int  # slots stored, summed over layers (the most-storing head of each)
    stored_after: int
    pages_before: int
    pages_after: int
    dropped: list[int] = field(default_factory=list)  # per range: slots dropped, over layers and heads

    def as_dict(self) -> dict:
        return {"ranges": [list(r) for r in self.ranges], "tokens": self.tokens,
                "stored_tokens_before": self.stored_before, "stored_tokens": self.stored_after,
                "pages_before": self.pages_before, "pages": self.pages_after, "dropped": self.dropped}


def parse_auto_prune(text: str) -> PruneRequest:
    """`role=tool,older_than=2,keep=0.2[,scorer=snapkv]` (the server's --auto-prune) -> a request
    that prunes each matching message once."""
    fields: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--auto-prune: {item!r} is not key=value", param="auto_prune")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - {"role", "older_than", "keep", "keep_tokens", "scorer"}
    if unknown:
        raise ConfigError(f"--auto-prune: unknown key(s) {', '.join(sorted(unknown))}; keys: role, older_than, "
                          "keep, keep_tokens, scorer", param="auto_prune")
    try:
        return PruneRequest(
            roles=tuple(r for r in fields.get("role", "tool").split("|") if r),
            older_than_rounds=int(fields.get("older_than", "1")),
            keep=float(fields["keep"]) if "keep" in fields else None,
            keep_tokens=int(fields["keep_tokens"]) if "keep_tokens" in fields else None,
            scorer=fields.get("scorer"), skip_pruned=True)
    except ValueError as e:
        raise ConfigError(f"--auto-prune {text!r}: {e}", param="auto_prune") from None
    except InvalidPrune as e:
        raise ConfigError(f"--auto-prune {text!r}: {e.message}", param="auto_prune") from None


def resolve_ranges(record, request: PruneRequest) -> list[tuple[int, int]]:
    """The logical token ranges `request` names in `record`'s history, sorted and merged."""
    history = len(record.tokens)
    ranges = []
    for a, b in request.token_ranges:
        if a >= history:
            raise InvalidPrune(f"token range [{a}, {b}) starts past the chain's {history} tokens",
                               param="token_ranges")
        ranges.append((a, min(b, history)))
    if request.messages or request.roles:
        segments = record.segments
        if segments is None:
            raise InvalidPrune("this chain has no message boundaries (it was not opened through "
                               "/v1/chat/completions); prune it by token_ranges", param="messages")
        rounds_after = _rounds_after(segments)
        for index in request.messages:
            if not 0 <= index < len(segments):
                raise InvalidPrune(f"message {index} does not exist; the chain holds {len(segments)} messages",
                                   param="messages")
        chosen = set(request.messages) | {i for i, s in enumerate(segments) if s.role in request.roles}
        for i in sorted(chosen):
            s = segments[i]
            if rounds_after[i] >= request.older_than_rounds and s.end > s.start:
                ranges.append((s.start, s.end))
    if request.skip_pruned:
        ranges = [r for r in ranges if r not in record.pruned]
    return _merge(ranges)


def _rounds_after(segments: list[Segment]) -> list[int]:
    """Per message, how many assistant messages come after it."""
    after, out = 0, [0] * len(segments)
    for i in range(len(segments) - 1, -1, -1):
        out[i] = after
        after += segments[i].role == "assistant"
    return out


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


class Scorer:
    """A method's token scores (`KVMethod.token_scores`) over a chain's stored keys and queries."""

    def __init__(self, method) -> None:
        if not method.scores_tokens:
            raise InvalidPrune(f"method {method.name!r} scores no tokens (it has no prefill_end keep); name a scorer "
                               "(a method that does) in the request, or start the server with --prune-scorer",
                               param="scorer")
        self.method = method

    @property
    def query_window(self) -> int:
        return self.method.query_window

    def __call__(self, layer: int, num_layers: int, q: torch.Tensor, k: torch.Tensor,
                 starts: list[int] | None) -> torch.Tensor:
        """q [Hq, w, D], k [Hkv, L, D] -> float32 [Hkv, L]; each head scored over its own slots
        (padding before a head's start ranks last)."""
        if q.device.type == "cpu":
            q, k = q.float(), k.float()
        score = self.method.token_scores
        if starts is None:
            return score(layer, num_layers, q, k).float()
        kv_heads, length = k.shape[0], k.shape[1]
        group = q.shape[0] // kv_heads
        out = torch.full((kv_heads, length), float("-inf"), dtype=torch.float32, device=k.device)
        for h, start in enumerate(starts):
            if start < length:
                own = k[h : h + 1, start:].contiguous()
                out[h, start:] = score(layer, num_layers, q[h * group : (h + 1) * group], own)[0].float()
        return out


def resolve_scorer(request: PruneRequest, served, default: str | None = None) -> Scorer:
    """The request's scorer method; without one the engine's default (`default`, the server's
    --prune-scorer), else the served method's own token scores."""
    from kvc.runtime.methods import resolve_method

    name = request.scorer or (None if request.scorer_params is not None else default)
    if name is None and request.scorer_params is None:
        return Scorer(served)
    try:
        method = resolve_method(name or served.name, request.scorer_params)
    except ConfigError as e:
        raise InvalidPrune(f"scorer: {e.message}", param="scorer") from None
    return Scorer(method)


class Pruner:
    """Applies prunes to idle chain records of one engine (in the engine thread, between steps)."""

    def __init__(self, store, executors, num_layers: int, layer_class: tuple[int, ...] | None = None,
                 page_starts: list[int] | None = None, ranks=None) -> None:
        self.store = store  # the chain store
        # tensor parallelism: the other ranks' heads (runtime/distributed/group.py HeadCollective; None: one
        # rank), whose counts a layer's drops and width agree with, so every rank's pages stay alike
        self.ranks = ranks
        # each storage class's plan executor (every spec tensor of its store moves with the K/V), the class of
        # each layer, and the pool id of each class's first page (a class's store indexes its pages from 0)
        self.executors = list(executors)
        self.num_layers = num_layers
        self.layer_class = tuple(layer_class) if layer_class is not None else (0,) * num_layers
        self.page_starts = list(page_starts) if page_starts is not None else [0] * len(self.executors)

    def _across(self, value: int, op: str) -> int:
        """`value` combined by `op` (min or max) over the tensor-parallel ranks (itself on one rank)."""
        if self.ranks is None:
            return value
        return int(self.ranks.all_reduce(torch.tensor([value], device=self.ranks.tp.device), op).item())

    def check_prunable(self) -> None:
        """Raises InvalidPrune where the served KV spec cannot drop tokens from a chain: keys stored
        before RoPE are read at their slots' positions, which a prune would shift."""
        if any(e.store.spec.prerope for e in self.executors):
            raise InvalidPrune("the served method stores keys before RoPE, each read at its slot's position: its "
                               "chains cannot drop tokens", param="chain_id")

    def prune(self, record, request: PruneRequest, scorer: Scorer) -> PruneReport:
        from kvc.runtime.chains import ChainState

        if record.state is ChainState.ACTIVE:
            raise ChainBusy(f"a request is running on chain {record.chain_id!r}; prune it when the request is done",
                            param="chain_id")
        self.check_prunable()
        ranges = resolve_ranges(record, request)
        pages_before = sum(len(t) for t in record.page_tables)
        report = PruneReport(ranges, len(record.tokens), sum(record.kv_lens), 0, pages_before, 0,
                             [0] * len(ranges))
        if ranges:
            if scorer.query_window and any(q is None for q in record.window_queries):
                raise InvalidPrune("this chain stores no queries to score with (no turn has run on it, or the "
                                   "served method's query window is 0: start the server with --prune-scorer)",
                                   param="chain_id")
            last_dropped = -1
            for layer in range(self.num_layers):
                last_dropped = max(last_dropped, self._prune_layer(record, layer, ranges, request, scorer, report))
            if last_dropped >= 0:
                record.compressed = True
                record.verbatim_from = max(record.verbatim_from, last_dropped + 1)
            record.pruned |= set(ranges)
            if self.ranks is not None:  # every rank's heads (a replicated KV head counted once)
                dropped = self.ranks.all_reduce(torch.tensor(report.dropped, device=self.ranks.tp.device))
                report.dropped = (dropped // self.ranks.replicas).tolist()
        report.stored_after = sum(record.kv_lens)
        report.pages_after = sum(len(t) for t in record.page_tables)
        self.store.prunes_total += 1
        self.store.pruned_tokens_total += sum(report.dropped)
        return report

    def _prune_layer(self, record, layer: int, ranges, request: PruneRequest, scorer: Scorer,
                     report: PruneReport) -> int:
        """Prunes one layer (through its storage class's store and executor, over its store's page
        indices); returns the largest logical position it dropped (-1: none)."""
        cls = self.layer_class[layer]
        executor = self.executors[cls]
        store, first = executor.store, self.page_starts[cls]
        device, kv_heads, page = store.device, store.num_kv_heads, store.page_size
        table, length = record.page_tables[layer], record.kv_lens[layer]
        local = [p - first for p in table]
        starts = record.kv_starts[layer]
        history = len(record.tokens)
        positions = full_map(record.positions[layer], length, history, kv_heads, device)
        valid = torch.arange(length, device=device)[None, :] >= torch.tensor(starts or [0] * kv_heads,
                                                                             device=device)[:, None]
        candidates = [valid & (positions >= a) & (positions < b) for a, b in ranges]
        stored = torch.stack([c.sum(dim=1) for c in candidates]).tolist()  # [range][head], one sync
        drops = []
        for per_head in stored:
            wanted = [n - request.kept(n) for n in per_head]
            drops.append(wanted if starts is not None else [self._across(min(wanted), "min")] * kv_heads)
        if not self._across(int(any(d for per_head in drops for d in per_head)), "max"):
            return -1
        # the layer (per-layer scales) and the row's window (the newest slots of a spec with one)
        keys = LayerCacheView(store, local, length, starts, layer, row=record.row,
                              resid_len=record.resid_lens[layer]).keys()
        stored = record.window_queries[layer]
        if stored is None or not scorer.query_window:  # a scorer that reads no queries
            stored = keys.new_zeros((0, self.num_heads(keys, stored), keys.shape[-1]))
        q = stored.to(device).transpose(0, 1)  # [Hq, w, D]
        if scorer.query_window > 0:
            q = q[:, -scorer.query_window:]
        scores = scorer(layer, self.num_layers, q, keys, starts)
        # a key the scorer does not reach (-inf: e.g. SnapKV's own observation window, which the
        # method always keeps) is kept before any scored one
        scores = torch.where(torch.isneginf(scores), torch.full_like(scores, float("inf")), scores)
        dropped = torch.zeros((kv_heads, length), dtype=torch.bool, device=device)
        for r, (cand, per_head) in enumerate(zip(candidates, drops)):
            order = scores.argsort(dim=1, stable=True)  # lowest first, ties to the older token
            outside = (~cand).gather(1, order).to(torch.int8)  # then the range's tokens before any other
            ranked = order.gather(1, outside.argsort(dim=1, stable=True))
            for h, d in enumerate(per_head):
                if d:
                    dropped[h, ranked[h, :d]] = True
            report.dropped[r] += sum(per_head)
        kept_mask = valid & ~dropped
        counts = kept_mask.sum(dim=1).tolist()
        physical = self._across(max(counts), "max")  # every rank's layer as wide as the widest head anywhere
        width = physical
        keep = torch.zeros((kv_heads, width), dtype=torch.long, device=device)
        slots = torch.arange(length, device=device)
        for h in range(kv_heads):
            keep[h, : counts[h]] = slots[kept_mask[h]]
        self._own_pages(record, layer, -(-physical // page))
        job = CompactionJob([p - first for p in record.page_tables[layer]], length, keep,
                            None if set(counts) == {width} else torch.tensor(counts), starts)
        batch = batch_of_jobs(store.token_tensors()[0], [job])
        windows = [(record.row, record.resid_lens[layer])]  # a spec written a block at a time re-stores
        done = batch.result(0, executor.compact(batch, layer=layer, windows=windows))
        record.positions[layer] = compact_map(record.positions[layer], length, history, keep, counts, done.length)
        self._move_state(record, layer, keep, counts, done.length, length)
        keep_pages = -(-done.length // page)
        self.store.pool.free(record.page_tables[layer][keep_pages:])
        del record.page_tables[layer][keep_pages:]
        record.kv_lens[layer] = done.length
        record.kv_starts[layer] = done.starts
        record.resid_lens[layer] = store.window_after(done.length)  # moved: codes (or re-stored)
        return int(positions[dropped].max())

    def _own_pages(self, record, layer: int, count: int) -> None:
        """Copy-on-write: the first `count` pages of the record's layer become its own (pages of the
        layer's storage class; pool ids, which the executor's page copy maps to its store)."""
        pool, table, cls = self.store.pool, record.page_tables[layer], self.layer_class[layer]
        for index in range(min(count, len(table))):
            if pool.is_shared(table[index]):
                self.executors[cls].own_page(table, index, [self._allocate(record, cls)])

    def _allocate(self, record, cls: int) -> int:
        pool = self.store.pool
        while pool.free_in(cls) < 1:
            if not self.store.evict_idle(exclude=record):  # never the chain being pruned
                raise ChainCapacity("no free KV page to copy a shared page of the chain before pruning it; "
                                    "retry later", param="chain_id")
        try:
            return pool.allocate(1, cls)[0]
        except PoolExhausted:
            raise ChainCapacity("no free KV page to prune the chain; retry later", param="chain_id") from None

    @staticmethod
    def num_heads(keys: torch.Tensor, stored) -> int:
        return keys.shape[0] if stored is None else stored.shape[1]

    @staticmethod
    def _move_state(record, layer: int, keep: torch.Tensor, counts: list[int], physical: int, length: int) -> None:
        """Per-token method state of the layer ([Hkv, T] tensors aligned with the slots) follows
        the keep plan; other state stays."""
        state = record.method_state
        if not isinstance(state, dict) or not isinstance(state.get(layer), dict):
            return  # no state, or state in the pages' planes (moved with the K/V)
        moved = {}
        for name, value in state[layer].items():
            if not (torch.is_tensor(value) and value.dim() == 2 and value.shape[1] >= length):
                moved[name] = value
                continue
            index = keep.to(value.device)
            out = torch.zeros((value.shape[0], physical), dtype=value.dtype, device=value.device)
            for h, count in enumerate(counts):
                if count:
                    out[h, physical - count:] = value[h, index[h, :count]]
            moved[name] = out
        state = dict(state)  # forks share the record's state dict: never change it in place
        state[layer] = moved
        record.method_state = state
