"""The lifecycle contract between the engine and a KV-cache method (docs/design.md, "The lifecycle
contract": one table of everything the runtime reads from a method).

The engine knows nothing about any method: it calls an object satisfying `KVMethod` at fixed
points, with the typed views below, and carries out the plans the hooks answer with
(runtime/kv/plans.py, runtime/kv/executor.py). Every shipped method, `full` included, is compiled
code adapted to this Protocol by `methods_compiled.py`; `MethodBase` gives the no-op defaults, and
tests/runtime/contract_methods.py holds two methods written against it directly.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np
import torch

from kvc.runtime.attention.metadata import StatsFold
from kvc.runtime.kv import query_window, slot_order, state_planes
from kvc.runtime.kv.spec import K, V, KVSpec, StorageClasses, dense_spec
from kvc.runtime.kv.store import KVStore
from kvc.runtime.kv.ring import Ring  # noqa: F401 -- the contract's decode ring
from kvc.runtime.kv.plans import Estimate, KeepPlan, Plan, ReadPlan, RewritePlan, StackedPlan  # noqa: F401 -- the contract's plans


class Hook(enum.Enum):
    PREFILL_CHUNK = "prefill_chunk"
    PREFILL_END = "prefill_end"
    DECODE_BEFORE_ATTENTION = "decode_before_attention"
    DECODE_AFTER_ATTENTION = "decode_after_attention"
    STEP_END = "step_end"
    TURN = "turn"  # turn_end / turn_resume
    CLONE = "clone"  # the engine cloned a running sequence (its state must follow)
    RELEASE = "release"


@dataclass(frozen=True)
class AttentionKernels:
    """The engine's attention kernels a method runs: a variant of the generated paged-attention
    module (kernels_generated/_attention/<variant>.py, named by the method's manifest; the
    triton backend loads it) and, when its decode hook reads `attn`, the statistics the decode
    kernels emit (None: none)."""

    variant: str = "plain"
    decode_stats: StatsFold | None = None


@runtime_checkable
class KVBudget(Protocol):
    """Physical tokens per layer a request holds (what its pages must cover)."""

    def peak_tokens(self, prompt_len: int, layer: int) -> int:
        """At the prefill peak: before prefill_end compacts, the whole prompt is resident."""
        ...

    def steady_tokens(self, prompt_len: int, context_len: int, layer: int) -> int:
        """After compression, for a request whose prefill compressed `prompt_len` tokens and whose
        logical context is now `context_len` tokens."""
        ...


@dataclass(frozen=True)
class FullBudget:
    """Every token stays: physical length = logical length."""

    def peak_tokens(self, prompt_len: int, layer: int) -> int:
        return prompt_len

    def steady_tokens(self, prompt_len: int, context_len: int, layer: int) -> int:
        return context_len


@dataclass
class LayerCacheView:
    """One sequence's stored KV in one layer: `page_ids` of the store hold `length` slots. Where the
    spec stores positions (a keep that evicts in place: runtime/kv/slot_order.py) the slots may be out
    of time order; `keys`, `values` and `read_plane` then give them in time order, and a plan's
    indices are in that order too (the engine maps them to slots)."""

    store: KVStore  # every tensor of the method's KV spec (runtime/kv/store.py)
    page_ids: list[int]
    length: int  # physical tokens stored (slot i of the sequence = page i // S, offset i % S)
    # Per-head variable counts (a layer compacted by a per-head plan): KV head h stores its
    # tokens in slots [starts[h], length); the slots before are padding. None: every head from 0.
    starts: list[int] | None = None
    # where a spec with a residual window keeps the newest slots in full precision: the layer, the
    # sequence's row, and how many of the newest slots the window holds
    layer: int | None = None
    row: int | None = None
    resid_len: int = 0
    _order: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # `order`, once read

    @property
    def order(self) -> torch.Tensor | None:
        """[Hkv, length] int64: the physical slots in time order (None: the spec keeps slots in order)."""
        name = self.store.spec.positions
        if not self.store.spec.in_place:
            return None
        if self._order is None:
            tables = np.asarray([self.page_ids], dtype=np.int64).reshape(1, -1)
            self._order = slot_order.orders(self.store[name], tables, np.asarray([self.length]))[0]
        return self._order

    def in_order(self, x: torch.Tensor) -> torch.Tensor:
        """Per-slot x [Hkv, length, ...] in time order (as it is where slots are in order)."""
        order = self.order
        return x if order is None else slot_order.in_order(x, order.to(x.device))

    def read_plane(self, plane: torch.Tensor) -> torch.Tensor:
        """A per-token plane's values of the stored slots, [Hkv, length], in time order."""
        return self.in_order(state_planes.read(plane, self.page_ids, self.length))

    def positions(self) -> torch.Tensor:
        """[Hkv, length] int64: each stored slot's logical position, in time order (a spec that records them:
        KVSpec.positions; a head's slots below its start hold no token of it)."""
        name = self.store.spec.positions
        if name is None:
            raise RuntimeError("the KV spec records no positions")
        return self.read_plane(self.store[name]).long()

    def keys(self) -> torch.Tensor:
        """Dense copy [Hkv, length, D] in time order (post-RoPE keys; decoded when the spec stores them encoded)."""
        return self.in_order(self.store.decoded(K, self.page_ids, self.length, self.layer, self.row, self.resid_len))

    def values(self) -> torch.Tensor:
        return self.in_order(self.store.decoded(V, self.page_ids, self.length, self.layer, self.row, self.resid_len))

    def queries(self) -> torch.Tensor:
        """The sequence's newest queries in this layer, oldest first [Hq, n, D] (a spec with a decode query
        window: runtime/kv/query_window.py)."""
        return query_window.read(self.store.tensors, self.layer, self.row)

    @property
    def num_kv_heads(self) -> int:
        return self.store.num_kv_heads

    @property
    def device(self) -> torch.device:
        return self.store.device


@dataclass
class PrefillView:
    """One sequence's prefill chunk in one layer, after its K/V are stored."""

    seq_id: int
    layer: int
    num_layers: int
    q: torch.Tensor  # [n, Hq, D] post-RoPE queries of the chunk
    k: torch.Tensor  # [n, Hkv, D]
    v: torch.Tensor  # [n, Hkv, D]
    start: int  # logical position of the chunk's first token (0: a new prefill; reset state)
    prompt_len: int  # tokens this prefill covers (prompt, or prompt + generated on recompute)
    cache: LayerCacheView  # includes the chunk
    # a replayed prefill's cache shared by the engines replaying one record: what a hook computes from
    # the recorded q/k/v alone may be kept there, keyed by what it depends on (None: not replayed)
    memo: dict | None = None

    @property
    def is_last(self) -> bool:
        return self.start + self.q.shape[0] == self.prompt_len


@dataclass(frozen=True)
class DecodeRow:
    """Host facts of one decode row in one layer (eager steps only)."""

    seq_id: int
    length: int  # physical tokens stored in this layer after the step's token
    context_len: int  # logical tokens after the step's token
    prompt_len: int  # tokens the sequence's prefill covered


@dataclass
class DecodeView:
    """A decode step's tensors in one layer (static shapes: CUDA-graph safe, no host values),
    plus, in eager steps only, the pool and each row's host facts (`rows`; None when captured)."""

    layer: int
    q: torch.Tensor  # [B, Hq, D]
    k: torch.Tensor  # [B, Hkv, D]
    v: torch.Tensor
    block_tables: torch.Tensor  # [B, max_pages] this layer's tables
    context_lens: torch.Tensor  # [B] physical lengths after the step's token
    store: KVStore | None = None  # every tensor of the method's KV spec (runtime/kv/store.py)
    scale: float | None = None  # the attention's softmax scale
    rows: list[DecodeRow] | None = None
    kv_starts: torch.Tensor | None = None  # [B, Hkv] first slot each KV head uses (None: all 0)
    # [B, R, W] float32: the step's attention probabilities over each row's keys, folded as the
    # method's `attention.decode_stats` says; filled by the decode attention before
    # decode_after_attention (None when the method asks for none, and in decode_before_attention)
    attn_stats: torch.Tensor | None = None
    # [B] int32: the tokens each row's prefill covered in this layer (the hook's `prompt`; the step's
    # generated tokens are the slots from there to `context_lens`)
    prompt_lens: torch.Tensor | None = None
    # a host bound on context_lens (the step's longest row, or a decode graph's context bucket): how
    # many slots of the tables a hook that reads the stored keys needs (None: the whole table)
    max_context_len: int | None = None
    # [B] int32: each row's row of the spec's SEQ tensors (runtime/kv/rows.py; None: the spec has none)
    seq_rows: torch.Tensor | None = None
    # [B] int64: where each row's token of the step was stored (page * page_size + offset; None: unknown, the
    # slot after the row's earlier ones)
    write_slots: torch.Tensor | None = None
    # [B] int64: the slot each row's ranked decode ring hands to the method's ranking after the step (-1: none;
    # runtime/kv/ring.py `promote`), and the ranked slots [0, first) it competes with; None: no ranked ring
    ring_leave: torch.Tensor | None = None
    ring_first: torch.Tensor | None = None


@dataclass
class StepView:
    """One sequence's layer after a decode step's forward (its new token stored)."""

    seq_id: int
    layer: int
    num_layers: int
    context_len: int  # logical tokens (RoPE positions keep growing after eviction)
    prompt_len: int
    cache: LayerCacheView  # `length` = physical tokens, the step's token included
    # a text partition's name -> the span of each logical position [0, the step's token] (int64 numpy), for a
    # method with `text_partitions` (runtime/text_spans.py); None: the engine has no tokenizer
    spans: Callable[[str], np.ndarray] | None = None


class StepViews(Seq[StepView]):
    """One layer's step-end rows as `step_end_batch` gets them (or several layers' of one storage class, for a
    method with `step_end_layers`): a sequence of `StepView`s, each made only when read (a decode batch of
    hundreds of rows x every layer would otherwise build as many objects at every step), and the rows' host
    facts as arrays for a method that batches from them: `seq_ids`, `lengths` (physical, the step's token
    included), `contexts`, `prompts` ([n] int64), `tables` ([n, W] int32 store indices, zero past each row's
    `pages`), `rows` ([n] int64: each sequence's row of the spec's per-sequence tensors, its query window's; -1:
    none), `layers` ([n] int64: each row's layer) and the layers' `store`. `layer` is the first row's layer (every
    row's, unless `layers` was given)."""

    def __init__(self, layer: int, store: KVStore, seq_ids: list[int], lengths: np.ndarray, contexts: np.ndarray,
                 prompts: np.ndarray, tables: np.ndarray, pages: np.ndarray, make: Any, rows: np.ndarray,
                 layers: np.ndarray | None = None) -> None:
        self.layer, self.store, self.seq_ids = layer, store, seq_ids
        self.lengths, self.contexts, self.prompts, self.tables, self.pages = lengths, contexts, prompts, tables, pages
        self.rows = rows
        self.layers = np.full(len(seq_ids), layer, dtype=np.int64) if layers is None else layers
        self._make = make  # row i -> its StepView
        self._views: dict[int, StepView] = {}

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        view = self._views.get(i)
        if view is None:
            view = self._views[i] = self._make(i)
        return view

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def subset(self, rows: Seq[int]) -> StepViews:
        """The rows `rows` (indices into these), as StepViews of their own."""
        rows = list(rows)
        index = np.asarray(rows, dtype=np.int64)
        layers = self.layers[index]
        return StepViews(int(layers[0]) if len(rows) else self.layer, self.store, [self.seq_ids[r] for r in rows],
                         self.lengths[index], self.contexts[index], self.prompts[index], self.tables[index],
                         self.pages[index], lambda i: self[rows[i]], self.rows[index], layers)


@runtime_checkable
class KVMethod(Protocol):
    """Everything the engine reads from a method (docs/design.md, "The lifecycle contract", has the
    table). The engine reads nothing else and calls only the points listed in `hooks`."""

    name: str
    params: dict[str, Any]  # the method's parameters (defaults and overrides), for reports and scorers
    fingerprint: str  # what makes two instances store the same KV: prefix-cache salt, chain records
    hooks: frozenset[Hook]
    compacts: bool  # may physical length drop below logical? (then no prefix caching)
    rewrites: bool  # may prefill_end / step_end return RewritePlans (writes into pages before the newest)?
    chunk_keeps: bool  # may prefill_chunk return KeepPlans (the prompt cut while prefilled; its forward then differs)
    decode_graphs: bool  # may decode steps (and the decode hooks) be CUDA-graph captured?
    # may `step_end_batch` take the rows of several layers of one storage class in one call (`StepViews.layers`)?
    # The engine then calls it once for the layers due in the same rows (one scoring, selection and compaction)
    step_end_layers: bool
    # is every KV head a cache layer of its own (runtime/kv/layout.py)? Then the budget, the hooks
    # and every per-layer argument below count cache layers, each of one KV head
    kv_head_layers: bool
    budget: KVBudget
    attention: AttentionKernels  # the attention kernels it runs and the decode statistics it reads
    evict_interval: int  # decode-time eviction every N tokens of growth (set by the engine; module docstring)
    scores_tokens: bool  # does `token_scores` rank stored tokens (a chain prune's scorer)?
    query_window: int  # the newest prefill queries `token_scores` reads (0: none)
    tuned_kernels: frozenset[str]  # `kvc tune` groups beyond attention it launches ("compaction", "scores")
    # a pass re-reading the stored prompt after prefill (KVzip's context reconstruction): its prompts and counts
    # ({"prompt", "then", "chunk", "overlap", "sink"}), or None; the engine runs it (runtime/context_replay.py)
    replay: dict[str, Any] | None
    # text partitions whose spans its step_end reads: name -> the strings that end a span (runtime/text_spans.py)
    text_partitions: dict[str, tuple[str, ...]]

    def bind(self, num_layers: int, num_kv_heads: int, model_dir: Path | None = None,
             max_context: int | None = None, num_heads: int | None = None, heads: Any = None) -> None: ...

    def page_tokens(self) -> int | None: ...

    def layer_inputs(self, spec: KVSpec, num_layers: int, num_kv_heads: int) -> dict[str, torch.Tensor]: ...

    def kv_spec(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int) -> KVSpec: ...

    def storage_classes(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        page_size: int) -> StorageClasses: ...

    def prefill_chunk(self, layer: int, view: PrefillView) -> Plan | None: ...

    def prefill_end(self, layer: int, view: PrefillView) -> Plan | None: ...

    def decode_before_attention(self, layer: int, view: DecodeView) -> ReadPlan | None: ...

    def decode_after_attention(self, layer: int, view: DecodeView, out: torch.Tensor) -> None: ...

    def step_end(self, layer: int, view: StepView) -> Plan | None: ...

    def step_end_batch(self, layer: int, views: Seq[StepView]) -> list[Plan | None]: ...

    def step_end_due(self, layer: int, lengths: np.ndarray, prompt_lens: np.ndarray,
                     context_lens: np.ndarray) -> np.ndarray | None: ...

    def decode_ring(self, layer: int, prompt_len: int) -> Ring | None: ...

    def replay_chunk(self, seq_id: int, layer: int, num_layers: int, q: torch.Tensor, attn: torch.Tensor,
                     start: int, context_len: int, num_kv_heads: int) -> None: ...

    def replay_end(self, seq_id: int, num_layers: int, context_len: int, num_kv_heads: int) -> list[KeepPlan]: ...

    def token_scores(self, layer: int, num_layers: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor: ...

    def turn_end(self, seq_id: int) -> Any: ...

    def turn_resume(self, seq_id: int, state: Any, lengths: Seq[int]) -> None: ...

    def clone(self, src_seq_id: int, dst_seq_id: int) -> None: ...

    def release(self, seq_id: int) -> None: ...


class MethodBase:
    """Default no-op hooks and dense K/V; methods override what they use."""

    name = "base"
    params: dict[str, Any] = {}
    hooks: frozenset[Hook] = frozenset()
    compacts = False
    rewrites = False
    chunk_keeps = False
    decode_graphs = True
    step_end_layers = False
    kv_head_layers = False
    budget: KVBudget = FullBudget()
    attention = AttentionKernels()
    evict_interval = 1
    scores_tokens = False
    query_window = 0
    tuned_kernels: frozenset[str] = frozenset()
    replay: dict[str, Any] | None = None
    text_partitions: dict[str, tuple[str, ...]] = {}

    @property
    def fingerprint(self) -> str:
        params = ",".join(f"{k}={self.params[k]!r}" for k in sorted(self.params))
        return f"{self.name}({params})"

    def bind(self, num_layers: int, num_kv_heads: int, model_dir: Path | None = None,
             max_context: int | None = None, num_heads: int | None = None, heads: Any = None) -> None:
        if heads is not None and self.hooks:
            from kvc.runtime.errors import ConfigError

            raise ConfigError(f"method {self.name!r} does not say how its hooks split over tensor-parallel ranks",
                              param="tensor_parallel_size")

    def page_tokens(self) -> int | None:
        return None

    def layer_inputs(self, spec: KVSpec, num_layers: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
        """Values of the spec's LAYER tensors that come from the method's input files (none)."""
        return {}

    def kv_spec(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int) -> KVSpec:
        return dense_spec(head_dim, dtype)

    def storage_classes(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        page_size: int) -> StorageClasses:
        """Each layer's KV spec: `kv_spec`'s in every layer (one class)."""
        return StorageClasses.single(self.kv_spec(num_kv_heads, head_dim, dtype, page_size), num_layers)

    def prefill_chunk(self, layer: int, view: PrefillView) -> Plan | None:
        return None

    def prefill_end(self, layer: int, view: PrefillView) -> Plan | None:
        return None

    def decode_before_attention(self, layer: int, view: DecodeView) -> ReadPlan | None:
        return None

    def decode_after_attention(self, layer: int, view: DecodeView, out: torch.Tensor) -> None:
        return None

    def step_end(self, layer: int, view: StepView) -> Plan | None:
        return None

    def step_end_batch(self, layer: int, views: Seq[StepView]) -> list[Plan | None]:
        """`step_end` of each view (at its own layer), in order; a method overrides it to batch across sequences."""
        return [self.step_end(view.layer, view) for view in views]

    def step_end_due(self, layer: int, lengths: np.ndarray, prompt_lens: np.ndarray,
                     context_lens: np.ndarray) -> np.ndarray | None:
        """Which decoded rows' step_end may give a plan (None: all of them)."""
        return None

    def decode_ring(self, layer: int, prompt_len: int) -> Ring | None:
        """Ring(first, capacity, ranked) when layer `layer`'s decode-time keep, for a row whose prefill covered
        `prompt_len` tokens, is exactly `first a + last b` at every step, or `top(score, a) + last b` (`ranked`:
        the method then moves a slot leaving the recent window into a ranked one, runtime/kv/ring.py
        `promote`), and its prefill keeps at most a + b: the
        engine may then write each decode token over the oldest recent one once the layer holds capacity =
        a + b + 1 tokens, and skip its step end (runtime/kv/ring.py). None: no such keep."""
        return None

    def token_scores(self, layer: int, num_layers: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Scores [Hkv, n] of stored keys k [Hkv, n, D] given queries q [Hq, w, D] (higher: keep)."""
        raise NotImplementedError(f"method {self.name!r} scores no tokens")

    def turn_end(self, seq_id: int) -> Any:
        return None

    def turn_resume(self, seq_id: int, state: Any, lengths: Seq[int]) -> None:
        return None

    def clone(self, src_seq_id: int, dst_seq_id: int) -> None:
        return None

    def release(self, seq_id: int) -> None:
        return None
