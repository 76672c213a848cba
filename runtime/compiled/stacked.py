"""A decode batch's step-end rows stacked as the heads of one scoring (docs/design.md, "Decode budgets over a
whole batch"): for a step_end keep whose score is computed KV head by KV head from q/k/v (the compiler's
`head_local`), rows of one layer and length go through the generated scores and selection together, a chunk
of rows at a time (runtime/compiled/step_end.py `_step_end_stacked`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Callable

import numpy as np
import torch

from kvc.runtime.kv import query_window, slot_order
from kvc.runtime.kv.spec import Dense
from kvc.runtime.method_api import StepView, StepViews
from kvc.runtime.primitives.paged_keys import PagedKeys
from kvc.runtime.transfer import to_device


class StackedRows:
    """Rows of one length (of one layer, or of several layers of one store: `layers` [G]), the hook inputs of a
    chunk of them stacked as heads (`inputs`): keys and values [G * Hkv, n, D] (dense stores; in time order),
    query windows [G * Hq, window, D]; float32 on the CPU, as `CacheInputs`. `map` runs a function over chunks of
    rows sized to the free device memory (measured on the first chunk's peak, once per length) and concatenates
    what it returns."""

    FIRST_CHUNK = 16  # rows; then as many as half the free device memory holds (the CPU: 64 at a time)
    CPU_CHUNK = 64

    def __init__(self, store, layers: int | np.ndarray, tables: np.ndarray, rows: np.ndarray, length: int) -> None:
        self.store, self.layers, self.tables, self.rows, self.length = store, layers, tables, rows, length
        self.device = store.device
        self.order = None  # [G, Hkv, n]: slots in time order (a spec with positions)
        if store.spec.in_place:
            lengths = np.full(len(tables), length)
            self.order = slot_order.order(slot_order.read_rows(store[store.spec.positions], tables, lengths))

    @classmethod
    def of(cls, views: Seq[StepView], inputs: list[str]) -> StackedRows | None:
        """The views' rows, or None where they cannot be stacked (not `StepViews`, encoded K/V, no window)."""
        if not isinstance(views, StepViews):
            return None
        spec = views.store.spec
        if any(not isinstance(spec.keys if name == "k" else spec.values, Dense) for name in inputs if name != "q"):
            return None
        if "q" in inputs and (views.rows < 0).any():
            return None
        layers = views.layers if (views.layers != views.layer).any() else views.layer
        return cls(views.store, layers, views.tables, views.rows, int(views.lengths[0]))

    def inputs(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """The hook inputs of rows [lo, hi), each made only when read."""
        return _StackedInputs(self, lo, hi)

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        if name == "q":
            rows = to_device(self.rows[lo:hi], self.device)  # no stream wait: the GPU may still be on the forward
            layers = self.layers if isinstance(self.layers, int) else to_device(self.layers[lo:hi], self.device)
            x = query_window.read_rows(self.store.tensors, layers, rows)
        else:
            enc = self.store.spec.keys if name == "k" else self.store.spec.values
            plane = self.store.tensors[enc.tensor]
            if self.order is not None:  # [G, Hkv, n, D] in time order, one gather
                x = enc.view(slot_order.read_rows_in_order(plane, self.tables[lo:hi], self.order[lo:hi]))
            else:
                x = enc.view(slot_order.read_rows(plane, self.tables[lo:hi], np.full(hi - lo, self.length)))
            x = x.reshape(-1, *x.shape[2:])
        return x.float() if x.device.type == "cpu" else x

    def paged_keys(self, lo: int, hi: int) -> PagedKeys:
        """Rows [lo, hi)'s keys where the store keeps them, for a fused score that reads them in place
        (triton_primitives.column_votes): as `read("k", lo, hi)` gives them, without the gathered copy."""
        enc = self.store.spec.keys
        plane = self.store.tensors[enc.tensor]
        width = -(-self.length // plane.shape[2])
        tables = to_device(np.ascontiguousarray(self.tables[lo:hi, :width], dtype=np.int64), self.device)
        order = None if self.order is None else self.order[lo:hi]
        return PagedKeys(plane, tables, order, self.length, enc.channels or plane.shape[-1])

    def map(self, fn: Callable[[int, int], torch.Tensor], row_bytes: dict | None = None) -> torch.Tensor:
        """`fn(lo, hi)` over chunks of the rows, concatenated. `row_bytes`: the caller's memo of the device
        bytes a row's chunk took at this length (its key), which this fills on the first measured chunk
        and reads after: a later layer's rows then go in one chunk where the free memory holds them,
        not a first chunk of FIRST_CHUNK to measure again (each chunk is the selection's launches again)."""
        total, parts, lo = len(self.rows), [], 0
        cuda = self.device.type == "cuda"
        key = (self.length, self.device)
        per_row = None if row_bytes is None else row_bytes.get(key)
        size = self._fit(per_row) if cuda and per_row else self.FIRST_CHUNK if cuda else self.CPU_CHUNK
        while lo < total:
            hi = min(total, lo + size)
            measure = cuda and per_row is None and not parts
            if measure:
                torch.cuda.reset_peak_memory_stats(self.device)
                base = torch.cuda.memory_allocated(self.device)
            parts.append(fn(lo, hi))
            if measure:
                per_row = max(1, (torch.cuda.max_memory_allocated(self.device) - base) // (hi - lo))
                if row_bytes is not None:
                    if len(row_bytes) >= 64:
                        row_bytes.clear()
                    row_bytes[key] = per_row
                size = self._fit(per_row)
            lo = hi
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _fit(self, per_row: int) -> int:
        """Rows of a chunk: as many as half the free device memory (the allocator's idle blocks included) holds."""
        free, _ = torch.cuda.mem_get_info(self.device)
        idle = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return max(1, (free + idle) // 2 // per_row)


class _StackedInputs(dict):
    def __init__(self, rows: StackedRows, lo: int, hi: int) -> None:
        super().__init__()
        self._rows, self._lo, self._hi = rows, lo, hi
        self.device = rows.device

    def __missing__(self, name: str) -> torch.Tensor:
        if name not in ("k", "v", "q"):
            raise KeyError(name)
        value = self[name] = self._rows.read(name, self._lo, self._hi)
        return value
