"""Rows: the per-sequence slots of a KV spec's SEQ tensors (runtime/kv/spec.py, `Extent.SEQ`).

A sequence whose method stores per-sequence tensors (a quantization method's full-precision
residual window) holds one row of every SEQ tensor, every layer, while it runs; a chain record
holds one between turns. Rows are never shared: a continued or forked chain copies its record's
row into a row of its own (`KVStore.copy_rows`), so no write ever needs a copy first. A spec
without SEQ tensors uses no rows at all. docs/design.md, "KV spec".
"""

from __future__ import annotations

from collections import deque


class RowsExhausted(RuntimeError):
    """`allocate` found no free row (an engine bug: check `num_free` first)."""


class RowPool:
    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free: deque[int] = deque(range(num_rows))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RowsExhausted(f"all {self.num_rows} rows are in use")
        row = self._free.popleft()
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._used:
            raise ValueError(f"row {row} freed but not in use")
        self._used.remove(row)
        self._free.append(row)
