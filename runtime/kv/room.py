"""Free token slots per layer of one sequence's pages: the scheduler's page-boundary bookkeeping.

Every step the scheduler asks of each running sequence "do all its layers have a free slot for the
next token, and if not, which layers need how many pages?" (`Scheduler._growth` / `_take`). A
`Room` answers without walking the layers: it keeps the layers sorted by their free slots at the
time it was built, and a step's tokens (`use`) lower every layer's free slots alike, so they stay
in order and the layers short of slots are a prefix of that order (a bisection). When layers
store different lengths (PyramidKV, Ada-KV) some layer of nearly every row crosses a page
boundary at every step; this keeps that cost at the few layers that cross.

The scheduler caches one on the sequence (`Sequence.room`), valid at one `tables_version`: its own
appends (`grew`) move it along, any other change of the tables makes the scheduler build a new
one from the tables. Layers that store no more tokens (`fixed`: decode rings, runtime/kv/ring.py, write
over slots they hold) are left out: they never need a page and never give one back.
"""

from __future__ import annotations

import bisect

UNBOUNDED = 1 << 62  # `least` of a sequence whose every layer is fixed


class Room:
    """Free slots per layer (len(page_tables[l]) * page_size - kv_lens[l]) of one sequence, valid
    at `version` of its tables."""

    __slots__ = ("version", "page_size", "_base", "_order", "_used", "_short", "_fixed")

    def __init__(self, version: int, free: list[int], page_size: int, fixed: frozenset[int] = frozenset()) -> None:
        self.version = version
        self.page_size = page_size
        self._fixed = fixed  # layers whose tokens go into slots they hold
        self._base = list(free)  # per layer, its free slots when _used was 0
        self._order = sorted((slots, layer) for layer, slots in enumerate(free) if layer not in fixed)
        self._used = 0  # tokens stored in every layer since
        self._short: tuple[int, list[tuple[int, int]]] | None = None  # the last `short`, by _used + n

    @property
    def least(self) -> int:
        """Tokens every layer can still store (0 without layers; unbounded when every layer is fixed)."""
        if self._order:
            return self._order[0][0] - self._used
        return UNBOUNDED if self._fixed else 0

    def free(self) -> list[int]:
        """Free slots per layer, in layer order."""
        return [slots - self._used for slots in self._base]

    def use(self, n: int) -> None:
        """Every layer stored n more tokens."""
        self._used += n

    def short(self, n: int) -> list[tuple[int, int]]:
        """(layer, pages) for each layer that needs pages to store n more tokens, in layer order."""
        need = self._used + n
        if self._short is not None and self._short[0] == need:  # asked by _need, then by _take
            return self._short[1]
        cut = bisect.bisect_left(self._order, (need, -1))
        short = sorted((layer, (need - slots + self.page_size - 1) // self.page_size)
                       for slots, layer in self._order[:cut])
        self._short = (need, short)
        return short

    def growth(self, n: int) -> int:
        """Fresh pages every layer needs to store n more tokens: the sum over layers of
        pages_for(kv + n) - len(table), where a layer holding whole pages past kv + n counts
        negative (as the scheduler always counted it)."""
        need, size = self._used + n, self.page_size
        if self._order and self._order[-1][0] - need >= size:  # rare: some layer holds a spare page
            return sum(-((slots - need) // size) for slots, _ in self._order)
        return sum(pages for _, pages in self.short(n))

    def growth_by(self, n: int, layer_class: tuple[int, ...], num_classes: int) -> list[int]:
        """`growth(n)` summed per storage class (`layer_class[l]`: layer l's)."""
        need, size = self._used + n, self.page_size
        out = [0] * num_classes
        for layer, slots in enumerate(self._base):
            if layer not in self._fixed:
                out[layer_class[layer]] -= (slots - need) // size
        return out

    def grew(self, short: list[tuple[int, int]], version: int) -> None:
        """The layers of `short(n)` appended their pages; the tables are now at `version`."""
        order, base, size = self._order, self._base, self.page_size
        del order[: len(short)]  # `short` is the prefix of the order, in another order
        grown = []
        for layer, pages in short:
            base[layer] += pages * size
            grown.append((base[layer], layer))
        if len(grown) <= 4:  # a few layers at a page boundary (per-layer lengths)
            for item in grown:
                bisect.insort(order, item)
        else:  # many or all layers at once (equal lengths): one merge of two sorted runs
            grown.sort()
            order[:0] = grown
            order.sort()
        self._short = None
        self.version = version
