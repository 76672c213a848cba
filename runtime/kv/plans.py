"""Plans: what a method's hooks answer, carried out by the executor (runtime/kv/executor.py).

- `KeepPlan`: which stored tokens of one sequence's layer survive (eviction); the executor moves
  every per-token tensor of the KV spec to the kept slots and frees the pages past them.
- `ReadPlan`: which pages or tokens each decode row's KV heads attend to in this step (sparse
  attention); static in shape, so decode steps stay inside CUDA graphs. It may add an `Estimate`:
  pseudo-keys standing for tokens not read (a cluster index's estimated clusters).
- `RewritePlan`: re-encode a range of one sequence's layer in place from its full-precision copy
  (a quantization residual window that filled).

docs/design.md, "Plans", has the rules.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch


@dataclass
class KeepPlan:
    """Which stored tokens of one layer survive: `indices[h]` are physical token indices of KV
    head h, ascending.

    Equal counts: `indices [Hkv, kept]`, `lengths` None. Per-head variable counts (Ada-KV):
    `lengths [Hkv]` says head h keeps `indices[h, :lengths[h]]` (the rest is padding), and the
    layer's physical length becomes the largest count; the engine stores each head right-aligned
    and records per-head start slots (runtime/attention/metadata.py). `from_heads` builds either."""

    indices: torch.Tensor  # [Hkv, max kept] int64
    lengths: torch.Tensor | None = None  # [Hkv] int64, or None: every head keeps indices.shape[1]
    # The plan keeps the last `tail` stored tokens of every head, in order, as the newest kept
    # (a keep's `+ last N`): the chain cache's rollback relies on it (0: no such promise).
    tail: int = 0

    @property
    def kept(self) -> int:
        """Physical tokens per head slot after compaction: the most-keeping head's count (or, where a
        tensor-parallel rank's heads keep fewer than another rank's, that rank's: `HeadKeeps.width`)."""
        return self.indices.shape[1]

    @classmethod
    def from_heads(cls, kept: Seq[torch.Tensor]) -> KeepPlan:
        """A plan from one 1-D index tensor per KV head; `lengths` only when the counts differ."""
        counts = [int(t.numel()) for t in kept]
        width = max(counts, default=0)
        indices = torch.zeros((len(kept), width), dtype=torch.long, device=kept[0].device if kept else None)
        for head, t in enumerate(kept):
            indices[head, : counts[head]] = t.to(torch.long)
        if len(set(counts)) <= 1:
            return cls(indices)
        return cls(indices, torch.tensor(counts, dtype=torch.long, device=indices.device))


class StackedPlan(KeepPlan):
    """Row `row` of a selection that several sequences' plans of one step share, `stack [G, Hkv,
    kept]` (a batched `step_end_batch`): equal counts; `indices` is `stack[row]`, made only when
    read. The engine hands every row of a stack to the compaction at once (one tensor moved and
    gathered per layer, not one per sequence)."""

    def __init__(self, stack: torch.Tensor, row: int, tail: int = 0, order: torch.Tensor | None = None,
                 order_row: int | None = None) -> None:
        self.stack, self.row, self.lengths, self.tail = stack, row, None, tail
        # [R, Hkv, n]: the slots of the rows it was selected among in time order, where the selection sorted
        # them (a spec with positions, runtime/kv/slot_order.py), this plan's at `order_row` (default: `row`):
        # the executor maps the plan through it rather than sorting again
        self.order, self.order_row = order, row if order_row is None else order_row

    @property
    def indices(self) -> torch.Tensor:  # type: ignore[override]
        return self.stack[self.row]

    @property
    def kept(self) -> int:
        return self.stack.shape[2]


@dataclass
class ReadPlan:
    """What each decode row's KV heads read this step, exactly one of: `pages [B, Hkv, P]` int32,
    indices into the row's page table of the layer (-1: none), or `tokens [B, Hkv, T]` int32, slots
    of the layer (-1: none). Head h of row b attends to the listed slots that are stored (below the
    row's length, at or past the head's start), in any order, each at most once. Shapes are static
    (P, T fixed by the method's budget), device tensors only: built inside captured decode graphs.

    `last [B]` int32 (token plans only; None: none): every head of row b also reads the row's
    `last[b]` newest stored slots (a per-row range whose length varies, such as the tokens generated
    since the prompt), which `tokens` must not list again.

    `last_bound` (host int; None: none known): no row's `last` exceeds it, so the torch path gathers
    the newest `last_bound` slots instead of masking whole rows.

    `counts [B, Hkv]` int32 (token plans only; None: every entry may be listed): head h of row b
    lists its slots in `tokens[b, h, :counts[b, h]]` and nothing after them (-1), so a kernel walks
    only those entries (a plan whose count varies by row, as many tokens as the chosen clusters
    hold, in a static width).

    `estimate` (None: none): extra entries of each head's softmax that stand for tokens not read
    (`Estimate`: a cluster's pseudo-key, weighted by its size)."""

    pages: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    last: torch.Tensor | None = None
    estimate: Estimate | None = None
    last_bound: int | None = None
    counts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.pages is None) == (self.tokens is None):
            raise ValueError("a ReadPlan lists pages or tokens (exactly one of them)")
        plan = self.pages if self.pages is not None else self.tokens
        if plan.dim() != 3:
            raise ValueError(f"a ReadPlan is [rows, kv_heads, n], got shape {tuple(plan.shape)}")
        if self.last is not None and (self.tokens is None or self.last.shape != plan.shape[:1]):
            raise ValueError("a ReadPlan's `last` is [rows] and goes with a token plan")
        if self.counts is not None and (self.tokens is None or tuple(self.counts.shape) != tuple(plan.shape[:2])):
            raise ValueError("a ReadPlan's `counts` is [rows, kv_heads] and goes with a token plan")
        if self.estimate is not None and self.estimate.log_weights.shape[:2] != plan.shape[:2]:
            raise ValueError(f"a ReadPlan's estimate is for {tuple(self.estimate.log_weights.shape[:2])} rows x KV "
                             f"heads, its plan for {tuple(plan.shape[:2])}")


@dataclass
class Estimate:
    """E pseudo-keys per decode row and KV head that the attention treats as extra softmax entries:
    entry e of head h stands for n_e = exp(log_weights[e]) tokens (-inf: none) with key `keys[e]` and
    values that sum to `values[e]`; it enters every query head of its group with logit `q . keys[e] *
    scale + log_weights[e]` and value `values[e] / n_e`. A cluster of n tokens estimated by its mean
    key and its values' sum: the paper's estimate of those n tokens' attention (the sum is what a
    kernel multiplies by exp(q . key * scale), so no mean is ever materialised)."""

    keys: torch.Tensor  # [B, Hkv, E, D] (with `rows`: [R, Hkv, E, D])
    values: torch.Tensor  # [B, Hkv, E, D]: each entry's value sum (with `rows`: [R, Hkv, E, D])
    log_weights: torch.Tensor  # [B, Hkv, E] float32
    rows: torch.Tensor | None = None  # [B]: decode row b's entries are keys[rows[b]], values[rows[b]]

    def __post_init__(self) -> None:
        shape = tuple(self.log_weights.shape)
        lead = shape if self.rows is None else (self.keys.shape[0], *shape[1:])
        if (len(shape) != 3 or tuple(self.keys.shape[:3]) != lead or tuple(self.values.shape[:3]) != lead
                or self.rows is not None and tuple(self.rows.shape) != shape[:1]):
            raise ValueError(f"an Estimate is keys/values [B, Hkv, E, D] (or [R, Hkv, E, D] with rows [B]) and "
                             f"log_weights [B, Hkv, E], got {tuple(self.keys.shape)}, {tuple(self.values.shape)}, "
                             f"{shape}" + ("" if self.rows is None else f", rows {tuple(self.rows.shape)}"))

    def gathered(self) -> Estimate:
        """The same estimate with each decode row's entries of its own ([B, Hkv, E, D], no `rows`)."""
        if self.rows is None:
            return self
        rows = self.rows.long()
        return Estimate(self.keys[rows], self.values[rows], self.log_weights)


@dataclass(frozen=True)
class RewritePlan:
    """Re-encode slots [start, end) of one sequence's layer into the spec's encoding from their
    full-precision copies (the residual window); the residual then holds the slots past `end`.
    The range must lie inside the stored residual window and end at the layer's length."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"a RewritePlan covers [start, end) with 0 <= start <= end, got [{self.start}, "
                             f"{self.end})")


Plan = KeepPlan | RewritePlan


class HeadKeeps(list):
    """One rank's KV heads' kept indices out of a selection over every rank's heads (tensor parallelism,
    docs/design.md): `width` is the widest head's count over all of them, the layer's stored length on
    every rank, and `drop` the most tokens any head drops (whether a keep is due, alike on every rank)."""

    def __init__(self, kept: list[torch.Tensor], width: int, drop: int) -> None:
        super().__init__(kept)
        self.width, self.drop = width, drop


def keep_plan(kept: list[torch.Tensor], device: torch.device, tail: int = 0) -> KeepPlan:
    """A `KeepPlan` without a device sync: the counts are the tensors' sizes (host facts), and
    per-head counts stay a CPU tensor, so the engine learns the layer's new physical length and
    start slots without reading the device (`KeepPlan.from_heads` would copy them to it)."""
    whole = getattr(kept, "stack", None)  # every head keeps the same count (`KeptRows`)
    if whole is not None and getattr(kept, "width", None) in (None, whole.shape[1]):
        return KeepPlan(whole.to(device=device, dtype=torch.long), tail=tail)
    counts = [int(t.numel()) for t in kept]
    width = getattr(kept, "width", None) or max(counts)
    if len(set(counts)) <= 1 and counts[0] == width:
        return KeepPlan(torch.stack(list(kept)).to(device=device, dtype=torch.long), tail=tail)
    indices = torch.zeros((len(kept), width), dtype=torch.long, device=device)
    for head, t in enumerate(kept):
        indices[head, : counts[head]] = t
    return KeepPlan(indices, torch.tensor(counts, dtype=torch.long), tail=tail)


def keep_plan_if_due(kept: list[torch.Tensor], length: int, starts: Seq[int] | None, interval: int,
                     device: torch.device, tail: int = 0) -> KeepPlan | None:
    """`keep_plan` of a layer whose KV head h stores slots [starts[h], length), or None when no head
    would drop `interval` or more of its own tokens (a per-head keep is not due yet)."""
    starts = starts or [0] * len(kept)
    drop = getattr(kept, "drop", None)  # over every rank's heads (HeadKeeps)
    if drop is None:
        drop = max(length - start - int(t.numel()) for start, t in zip(starts, kept))
    if drop < interval:
        return None
    return keep_plan(kept, device, tail)
