"""Decode rings: a window keep evicted by where the next token is written, not by a step-end plan.

A decode-time keep `first a + last b` at every step (StreamingLLM's, interval 1) leaves each layer
the a oldest tokens and the b newest: after a row stores a + b + 1 tokens, every step drops its
oldest recent token and adds one. Eviction in place (runtime/kv/slot_order.py) already makes that a
ring of the recent slots; here nothing is evicted at all. Once a layer holds its capacity a + b + 1,
the step's token is written over the slot of the oldest recent one, the token the step end would
drop after the previous step; the layer's length stays at the capacity, attention reads every slot,
and it sees exactly the tokens per-step eviction leaves (sinks, the b newest before the step, the
step's own). No step end, no selection, no page-table change, no host-to-device copy: a decode step
of a full ring costs what a step of a method that does not evict costs, and runs in the decode
graphs as it does.

The slot a layer writes next is a function of the logical position alone: slot
`first + (position - base) % (capacity - first)`, `base` the position of the first token written in
the ring (set when the layer reached its capacity in time order: slot `first` then holds the oldest
recent token). Keys are stored after RoPE, so slot order does not matter to attention, and nothing
reads a ringed layer in time order (no step end, no decode hook, no chain); a spec with positions still
records each slot's.

Who rings (the compiled method's `decode_ring(layer, prompt)`, the scheduler's `LaneRules.rings`, a `Rings`
giving each prompt length its `RingRules`): the step-end keep reads no scores, no `where`, counts that read
nothing of a row but its prompt (or a role's, on a cache layer of one KV head of the role: DuoAttention's
streaming heads, beside retrieval heads that append); the prefill keeps at most a + b; interval 1; the
method has no decode hooks; the sequence is not chained (a chain's turn end reads its layers in time order,
through the step-end path).

Ranked rings (`Ring.ranked`): a keep `top(score, a) + last b` (H2O's with a budget, TOVA's) drops one token
a step, the lowest scored of the a ranked ones and the one leaving the window. The recent slots ring as
above; the slot the next token takes (`ring_offsets`) is handed to the method's decode hook, whose `promote`
moves the leaving token into the lowest ranked slot where it scores higher. docs/design.md, "Decode rings".
"""

from __future__ import annotations

import importlib.util
from typing import Callable, NamedTuple

import numpy as np
import torch

from kvc.runtime.kv.spec import Extent

NONE = -1  # a layer without a ring (or not yet full)


class Ring(NamedTuple):
    """One layer's ring (the contract's `decode_ring`): slots [0, first) are the sinks, or, `ranked`, the
    ranked slots; the ring cycles slots [first, capacity)."""

    first: int
    capacity: int
    ranked: bool = False


class RingRules:
    """A lane's rings, per layer: the sinks `first` and the `capacity` (a + b + 1); -1 where a layer has
    none; `ranked` where the first slots are ranked (`Ring`)."""

    def __init__(self, rings: list[Ring | tuple[int, int] | None]) -> None:
        rings = [None if r is None else Ring(*r) for r in rings]
        self.first = np.array([NONE if r is None else r.first for r in rings], dtype=np.int64)
        self.capacity = np.array([NONE if r is None else r.capacity for r in rings], dtype=np.int64)
        self.ranked = np.array([r is not None and r.ranked for r in rings], dtype=bool)
        self.size = np.where(self.capacity >= 0, self.capacity - self.first, 1)  # the recent slots a ring cycles

    def slot(self, base: np.ndarray, position) -> np.ndarray:
        """The ring slot of the token at `position` ([L] or [L, n] bases, positions broadcast against them): the
        oldest recent token's, `first + (position - base) % (capacity - first)`."""
        first, size = (self.first, self.size) if base.ndim == 1 else (self.first[:, None], self.size[:, None])
        return first + (position - base) % size

    @classmethod
    def of(cls, rings: list[tuple[int, int] | None]) -> RingRules | None:
        return None if all(r is None for r in rings) else cls(rings)

    def enter(self, kv_lens: list[int], position: int, ring: RingState | None) -> RingState:
        """The ring state of a decoding sequence after a step left `kv_lens` stored and `position` the
        next token's: layers that reached their capacity (in time order) ring from that position on (a
        state with none on yet where none has: the next step's leaving slots need the rules)."""
        kv = np.asarray(kv_lens, dtype=np.int64)
        waiting = self.capacity >= 0 if ring is None else (self.capacity >= 0) & (ring.base < 0)
        if (waiting & (kv > self.capacity)).any():  # the prefill keeps at most a + b (`decode_ring`)
            raise RuntimeError(f"a layer outgrew its decode ring's capacity: {kv.tolist()} stored, "
                               f"capacity {self.capacity.tolist()}")
        full = waiting & (kv == self.capacity)
        if not full.any():
            return RingState(self, np.full(len(kv), NONE, dtype=np.int64)) if ring is None else ring
        base = np.full(len(kv), NONE, dtype=np.int64) if ring is None else ring.base.copy()
        base[full] = position
        return RingState(self, base)


class RingState:
    """A sequence's rings: `base[layer]`, the position its ring started at (-1: appending)."""

    def __init__(self, rules: RingRules, base: np.ndarray) -> None:
        self.rules, self.base = rules, base
        self.on = base >= 0
        self.full = bool(self.on[rules.capacity >= 0].all())  # every layer that may ring does: none enters
        self.steady = bool(self.on.all())  # every layer rings: kv_lens stay

    def slots(self, position: int) -> np.ndarray:
        """Each layer's write offset for the token at `position`: its ring's slot, -1 where it appends."""
        return np.where(self.on, self.rules.slot(self.base, position), NONE)

    def copy(self) -> RingState:
        return RingState(self.rules, self.base.copy())


def decode_offsets(kv: np.ndarray, rings: list[RingState | None], positions: list[int]) -> tuple[np.ndarray,
                                                                                              np.ndarray]:
    """[L, n] physical write offsets and context lengths of n decoding rows (one token each, at `positions`)
    whose layers store `kv [L, n]`: a ring's slot and its whole capacity where a layer rings, else the append
    slot and kv + 1. Vectorised over the rows of each lane's rules (a step's rows mostly share one)."""
    return ring_offsets(kv, rings, positions, leave=False)[:2]


def ring_offsets(kv: np.ndarray, rings: list[RingState | None], positions: list[int], leave: bool = True
                 ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """`decode_offsets`, and, `leave`, what ranked rings hand to the ranking after the step (`promote`): ([L, n]
    leave, [L, n] first), the slot the next token will overwrite (its oldest recent token's) where the layer
    holds its capacity after the step (-1 elsewhere) and the ranked slots it competes with, [0, first); None
    when no row has a ranked ring."""
    phys, ctx = kv.copy(), kv + 1
    out = None
    groups: dict[int, list[int]] = {}
    for i, ring in enumerate(rings):
        if ring is not None:
            groups.setdefault(id(ring.rules), []).append(i)
    for rows in groups.values():
        rules, cols = rings[rows[0]].rules, np.asarray(rows)
        base = np.stack([rings[i].base for i in rows], axis=1)  # [L, g]
        on = base >= 0
        at = np.asarray([positions[i] for i in rows], dtype=np.int64)[None, :]
        phys[:, cols] = np.where(on, rules.slot(base, at), kv[:, cols])
        ctx[:, cols] = np.where(on, kv[:, cols], kv[:, cols] + 1)
        if leave and rules.ranked.any():
            if out is None:
                out = (np.full(kv.shape, NONE, dtype=np.int64), np.zeros(kv.shape, dtype=np.int64))
            first, size, cap = rules.first[:, None], rules.size[:, None], rules.capacity[:, None]
            nxt = first + (phys[:, cols] - first + 1) % size  # the slot after this step's in the ring's cycle
            handed = rules.ranked[:, None] & (ctx[:, cols] == cap)
            out[0][:, cols] = np.where(handed, nxt, NONE)
            out[1][:, cols] = np.where(handed, first, 0)
    return phys, ctx, out


class Rings:
    """A lane's decode rings: the `RingRules` of each prompt length (a keep's counts may read the prompt, H2O's
    fractions of it), memoised; `ranked`, whether a ring may rank (the decode graphs then carry the leaving
    slots); `capacities`, those that are the same for every prompt (the decode graphs' context rungs: a rung
    is only a bucket, a row of another capacity runs in a wider one)."""

    PROBES = (1 << 14, 1 << 15)  # prompts whose rules tell the lane's facts
    MEMO = 4096

    def __init__(self, rules_of: Callable[[int], RingRules | None]) -> None:
        self._rules_of, self._memo = rules_of, {}
        probes = [self.of(p) for p in self.PROBES]
        self.ranked = any(r is not None and bool(r.ranked.any()) for r in probes)
        same = all(r is not None for r in probes) and np.array_equal(probes[0].capacity, probes[1].capacity)
        self.capacities = sorted({int(c) for c in probes[0].capacity if c > 0}) if same else []

    @classmethod
    def of_method(cls, decode_ring: Callable[[int, int], Ring | None], num_layers: int) -> Rings | None:
        """A method's rings (`decode_ring(layer, prompt)`), or None where no probed prompt rings. Prompts whose
        layers ring alike share one `RingRules` (a step's offsets are vectorised over the rows of each)."""
        shared: dict[tuple, RingRules | None] = {}

        def rules_of(prompt: int) -> RingRules | None:
            layers = tuple(decode_ring(layer, prompt) for layer in range(num_layers))
            if layers not in shared:
                shared[layers] = RingRules.of(list(layers))
            return shared[layers]

        rings = cls(rules_of)
        return rings if any(rings.of(p) is not None for p in cls.PROBES) else None

    @classmethod
    def fixed(cls, rules: RingRules) -> Rings:
        """The same rules for every prompt (benches, tests)."""
        return cls(lambda prompt: rules)

    def of(self, prompt: int) -> RingRules | None:
        rules = self._memo.get(prompt, False)
        if rules is False:
            if len(self._memo) >= self.MEMO:
                self._memo.clear()
            rules = self._memo[prompt] = self._rules_of(prompt)
        return rules


def promote(store, block_tables: torch.Tensor, scores: torch.Tensor, leave: torch.Tensor, first: torch.Tensor,
            triton: bool | None = None) -> None:
    """A ranked ring's step (`Ring.ranked`): the token in slot `leave[b]` leaves the recent window, and competes
    with the `first[b]` ranked slots of its KV head for theirs, as the per-step keep `top(score, first) + last b`
    would rank them: where its score beats their lowest, every per-token tensor of the spec (K, V, the method's
    state planes, positions) moves from its slot into that one's; its own slot is the next token's either way.
    Ties go to the older token, as the selection's do: the ranked slot dropped among equal lowest scores is the
    one with the newest position, and the leaving token, newer than every ranked one, must beat the lowest.

    `scores [B, Hkv, W]` the ranking's scores of each decode row's slots, `leave [B]` (-1: no ring at capacity),
    `first [B]` (int64), `block_tables [B, P]` the layer's tables. Static shapes, no host value: CUDA-graph safe.
    `triton`: the Triton kernels (runtime/kv/ring_triton.py), or this torch code, the CPU's and their oracle
    (None: Triton on CUDA)."""
    spec = store.spec
    if spec.positions is None:
        raise RuntimeError("a ranked decode ring needs the KV spec's slot positions (its ties go to the older token)")
    batch, heads, width = scores.shape
    if triton or (triton is None and _triton_runs(scores.device)):  # two launches (runtime/kv/ring_triton.py)
        from kvc.runtime.kv.ring_triton import promote_triton

        tokens = [store[t.name] for t in spec.tensors if t.extent is Extent.TOKEN]
        promote_triton(tokens, store[spec.positions], block_tables, scores, leave, first)
        return
    page = store.page_size
    tables = block_tables.long()
    slots = torch.arange(width, device=scores.device)
    pages = tables[:, (slots // page).clamp(max=tables.shape[1] - 1)]  # [B, W] (past a short row's table: any page)
    pos = store[spec.positions][pages, :, slots % page].permute(0, 2, 1)  # [B, Hkv, W]
    ranked = (slots[None, :] < first[:, None])[:, None, :]  # [B, 1, W]
    low = torch.where(ranked, scores, float("inf")).min(dim=-1, keepdim=True).values
    dropped = torch.where(ranked & (scores == low), pos, -1).argmax(dim=-1)  # [B, Hkv] the newest of the lowest
    gone = leave.clamp(min=0)
    leaving = scores.gather(2, gone[:, None, None].expand(batch, heads, 1))[..., 0]
    wins = ((leave >= 0) & (first > 0))[:, None] & (leaving > low[..., 0])
    src_page = tables.gather(1, (gone // page)[:, None]).expand(batch, heads)
    src_off = (gone % page)[:, None].expand(batch, heads)
    dst_page = torch.where(wins, tables.gather(1, (dropped // page).clamp(max=tables.shape[1] - 1)),
                           store.scratch_page)
    dst_off = dropped % page
    head = torch.arange(heads, device=scores.device)[None, :].expand(batch, heads)
    for t in spec.tensors:
        if t.extent is Extent.TOKEN:
            x = store[t.name]
            x[dst_page, head, dst_off] = x[src_page, head, src_off]


def _triton_runs(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None
