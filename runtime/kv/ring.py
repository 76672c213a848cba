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

Who rings (the compiled method's `decode_ring`, the scheduler's `LaneRules.rings`): the step-end keep
reads no scores, no `where`, constant counts (or a role's, on a cache layer of one KV head of the role:
DuoAttention's streaming heads, beside retrieval heads that append); the prefill keeps at most a + b;
interval 1; the method has no decode hooks; the sequence is not chained (a chain's turn end reads its
layers in time order, through the step-end path). docs/design.md, "Decode rings".
"""

from __future__ import annotations

import numpy as np

NONE = -1  # a layer without a ring (or not yet full)


class RingRules:
    """A lane's rings, per layer: the sinks `first` and the `capacity` (a + b + 1); -1 where a layer has
    none."""

    def __init__(self, rings: list[tuple[int, int] | None]) -> None:
        self.first = np.array([NONE if r is None else r[0] for r in rings], dtype=np.int64)
        self.capacity = np.array([NONE if r is None else r[1] for r in rings], dtype=np.int64)
        self.size = np.where(self.capacity >= 0, self.capacity - self.first, 1)  # the recent slots a ring cycles

    def slot(self, base: np.ndarray, position) -> np.ndarray:
        """The ring slot of the token at `position` ([L] or [L, n] bases, positions broadcast against them): the
        oldest recent token's, `first + (position - base) % (capacity - first)`."""
        first, size = (self.first, self.size) if base.ndim == 1 else (self.first[:, None], self.size[:, None])
        return first + (position - base) % size

    @classmethod
    def of(cls, rings: list[tuple[int, int] | None]) -> RingRules | None:
        return None if all(r is None for r in rings) else cls(rings)

    def enter(self, kv_lens: list[int], position: int, ring: RingState | None) -> RingState | None:
        """The ring state of a decoding sequence after a step left `kv_lens` stored and `position` the
        next token's: layers that reached their capacity (in time order) ring from that position on."""
        kv = np.asarray(kv_lens, dtype=np.int64)
        waiting = self.capacity >= 0 if ring is None else (self.capacity >= 0) & (ring.base < 0)
        if (waiting & (kv > self.capacity)).any():  # the prefill keeps at most a + b (`decode_ring`)
            raise RuntimeError(f"a layer outgrew its decode ring's capacity: {kv.tolist()} stored, "
                               f"capacity {self.capacity.tolist()}")
        full = waiting & (kv == self.capacity)
        if not full.any():
            return ring
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
    phys, ctx = kv.copy(), kv + 1
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
    return phys, ctx
