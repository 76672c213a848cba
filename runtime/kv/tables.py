"""Page-table arrays per sequence, kept in step with its tables (the model runner's step inputs,
the decode graphs' mirror, the step-end compaction batches read them). The arrays hold each layer's
store indices: pool ids less the first page id of the layer's storage class (`offsets`,
runtime/kv/page_pool.py; 0 with one class).

Each sequence's [L, W] int32 copy of its per-layer page tables and its [L, Hkv] KV-head start
slots are cached by `Sequence.tables_version`; a change at the tables' ends (`Sequence.resized_since`:
pages appended, or the last ones dropped by a keep) writes just those layers (an append just its
pages), any other change rebuilds the arrays.
"""

from __future__ import annotations

import numpy as np
import torch


def split_resized(log: list) -> dict[int, int | None]:
    """The layers of a `resized_since` log (`Sequence.resized_layers`: an append of layer l is logged as
    l, a truncation to p pages as (l, p)), each with the fewest pages a truncation left it since (None:
    it only grew): a reader rewrites a layer's entries from there (or from its copy's end) to the
    table's end, which covers a truncation followed by appends."""
    out: dict[int, int | None] = {}
    for e in log:
        if isinstance(e, tuple):
            layer, pages = e
            low = out.get(layer)
            out[layer] = pages if low is None else min(low, pages)
        else:
            out.setdefault(e, None)
    return out


class _Tables:
    """One sequence's cached arrays (`TableCache`) and the tables snapshot they hold."""

    __slots__ = ("version", "mark", "array", "lens", "longest", "starts")

    def __init__(self, version: int, mark: int, array: np.ndarray, lens: list[int]) -> None:
        self.version, self.mark = version, mark  # (tables_version, len(resized_layers)) when last synced
        self.array = array  # [L, W] int32, W >= the longest table; zeros past each table
        self.lens = lens  # pages of each layer's table
        self.longest = max(1, max(lens, default=0))
        self.starts: np.ndarray | None = None  # [L, Hkv] int32, built on first use


class TableCache:
    """Per-sequence [L, W] int32 copies of the page tables (W >= its longest table) and [L, Hkv]
    KV-head start slots, kept in step with the sequence's `tables_version`: most decode steps reuse
    them, and a step that only appended pages (`Sequence.resized_since`, the scheduler's page-boundary
    growth) writes just those pages, one that dropped a layer's last pages (a keep) that layer; any
    other change rebuilds them (L list-to-array conversions).
    So with per-layer lengths (PyramidKV, Ada-KV), where some layer of nearly every row crosses a
    page boundary at every step, a step costs a few entries per row, not L x B conversions."""

    def __init__(self, num_layers: int, num_kv_heads: int = 1, offsets: list[int] | None = None) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        # per layer, what its pool ids lose in the arrays: its storage class's first page id (its
        # store's page 0; runtime/kv/page_pool.py); None: every layer's are 0
        self.offsets = None if offsets is None or not any(offsets) else list(offsets)
        self._entries: dict[int, _Tables] = {}

    def _sync(self, seq) -> _Tables:
        entry = self._entries.get(seq.seq_id)
        if entry is not None and entry.version == seq.tables_version:
            return entry
        log = None if entry is None else seq.resized_since(entry.version, entry.mark)
        if log is None:
            entry = self._rebuild(seq)
        else:
            for layer, low in split_resized(log).items():
                self._resize(entry, layer, seq.page_tables[layer], low)
            entry.version, entry.mark = seq.tables_version, len(seq.resized_layers)
        return entry

    def _rebuild(self, seq) -> _Tables:
        tables = seq.page_tables
        lens = [len(t) for t in tables]
        arr = np.zeros((self.num_layers, max(1, max(lens, default=0))), dtype=np.int32)
        for layer, table in enumerate(tables):
            arr[layer, : len(table)] = table
            if self.offsets is not None and table:
                arr[layer, : len(table)] -= self.offsets[layer]
        entry = _Tables(seq.tables_version, len(seq.resized_layers), arr, lens)
        self._entries[seq.seq_id] = entry
        return entry

    def _resize(self, entry: _Tables, layer: int, table: list[int], low: int | None = None) -> None:
        """Brings the entry's copy of `layer`'s table to `table`: its pages from the copy's end, or from
        `low` (the fewest pages a truncation left since the copy), zeros past the table's end."""
        shrank = low is not None
        old, new = (min(entry.lens[layer], low) if shrank else entry.lens[layer]), len(table)
        width = entry.array.shape[1]
        if new > width:  # widen with slack: the longest layer grows a page at a time
            wider = np.zeros((entry.array.shape[0], max(new, width + max(8, width // 8))), dtype=np.int32)
            wider[:, :width] = entry.array
            entry.array = wider
        entry.array[layer, old:new] = table[old:new]
        if self.offsets is not None:
            entry.array[layer, old:new] -= self.offsets[layer]
        entry.array[layer, new:] = 0
        entry.lens[layer] = new
        entry.longest = max(entry.longest, new) if not shrank else max(1, max(entry.lens))

    def local(self, layer: int, pages: list[int]) -> list[int]:
        """Pool ids of layer `layer` as its store's indices (what the arrays hold)."""
        if self.offsets is None:
            return pages
        first = self.offsets[layer]
        return [p - first for p in pages]

    def array(self, seq) -> np.ndarray:
        """seq's [L, W] int32 page tables (W >= its longest table, zeros past each table). The
        array is updated in place by later appends: copy what must stay as it is now."""
        return self._sync(seq).array

    def lengths(self, seq) -> list[int]:
        """Pages of each of seq's layer tables (read-only)."""
        return self._sync(seq).lens

    def longest(self, seq) -> int:
        """Pages of seq's longest layer table (at least 1)."""
        return self._sync(seq).longest

    def starts_array(self, seq) -> np.ndarray:
        """seq's [L, Hkv] int32 KV-head start slots (0 where a layer has none), cached."""
        entry = self._sync(seq)  # appended pages keep the starts; any other change rebuilt the entry
        if entry.starts is None:
            arr = np.zeros((self.num_layers, self.num_kv_heads), dtype=np.int32)
            for layer, starts in enumerate(seq.kv_starts):
                if starts is not None:
                    arr[layer] = starts
            entry.starts = arr
        return entry.starts

    def pack(self, seqs, width: int) -> torch.Tensor:
        """[L, B, width] int32 page tables of `seqs`, zero-padded."""
        return torch.from_numpy(self.pack_numpy(seqs, width))

    def pack_numpy(self, seqs, width: int) -> np.ndarray:
        out = np.zeros((self.num_layers, len(seqs), width), dtype=np.int32)
        for i, seq in enumerate(seqs):
            arr = self.array(seq)
            w = min(width, arr.shape[1])
            out[:, i, :w] = arr[:, :w]
        return out

    def pack_starts(self, seqs) -> np.ndarray | None:
        """[L, B, Hkv] int32 KV-head start slots of `seqs`, or None when every one is 0 (the
        kernels then run without them)."""
        if not any(seq.has_kv_starts for seq in seqs):
            return None
        out = np.zeros((self.num_layers, len(seqs), self.num_kv_heads), dtype=np.int32)
        for i, seq in enumerate(seqs):
            if seq.has_kv_starts:
                out[:, i] = self.starts_array(seq)
        return out

    def drop(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)
