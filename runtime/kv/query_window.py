"""Decode query windows: the newest queries of every sequence and layer, for a step_end that reads `q[last n]`.

A method whose step_end reads the newest queries (R-KV's importance: the last `window` queries' attention,
`rkv.kvm`) gets two SEQ tensors in its KV spec (runtime/kv/spec.py): `QUERIES` [group, n, D] per KV head (its
query heads' post-RoPE queries, the model dtype) and `COUNT` [1] int32, the queries written into the row since
it was allocated. Query m of a row goes to slot m % n, so the ring's oldest is at `COUNT % n` whatever the row
held before (a reused row's leftovers are overwritten before they are read: a step_end reads a ring that its
sequence filled, its prompt's newest queries first). Every step writes its decode rows' queries on the device
(no host value: the same code runs inside the decode graphs) and, in eager steps, each prefill chunk's newest
n; forks and chains copy rows with every other SEQ tensor. docs/design.md, "Decode query windows".
"""

from __future__ import annotations

import torch

from kvc.runtime.kv.spec import Extent, TensorSpec

QUERIES = "step_end.queries"
COUNT = "step_end.query_count"


def tensors(window: int, group: int, head_dim: int, dtype: torch.dtype) -> tuple[TensorSpec, ...]:
    """The SEQ tensors of a query window of `window` queries (`group` query heads a KV head)."""
    return (TensorSpec(QUERIES, Extent.SEQ, dtype, (group, window, head_dim)),
            TensorSpec(COUNT, Extent.SEQ, torch.int32, (1,)))


def record(store_tensors: dict[str, torch.Tensor], layer: int, q: torch.Tensor, rows: torch.Tensor,
           num_decodes: int, host_cu_seqlens: list[int] | None, host_rows: list[int] | None,
           backend: str = "torch") -> None:
    """A step's queries q [T, Hq, D] into their rows' windows in `layer`: the first `num_decodes` sequences'
    one query each (device indices only), then each prefill chunk's newest (host offsets: eager steps).
    `backend` "triton": the decode rows' in one launch (runtime/kv/records_triton.py), else in torch."""
    queries, counts = store_tensors[QUERIES], store_tensors[COUNT]
    kv_heads, group, window = queries.shape[2], queries.shape[3], queries.shape[4]
    ring = queries[:, layer].permute(0, 3, 1, 2, 4)  # [rows, n, Hkv, group, D], a view
    count = counts[:, layer, 0, 0]  # [rows]
    if num_decodes and backend == "triton":
        from kvc.runtime.kv.records_triton import record_queries

        record_queries(queries, counts, layer, q[:num_decodes], rows[:num_decodes])
    elif num_decodes:
        r = rows[:num_decodes].long()
        written = count[r]
        ring[r, (written % window).long()] = q[:num_decodes].reshape(num_decodes, kv_heads, group, -1).to(ring.dtype)
        count[r] = written + 1
    if host_cu_seqlens is None or len(host_cu_seqlens) - 1 <= num_decodes:
        return
    if host_rows is None:
        raise RuntimeError("a prefill chunk's queries need the step's host rows (an eager step)")
    for b in range(num_decodes, len(host_cu_seqlens) - 1):
        start, end, row = host_cu_seqlens[b], host_cu_seqlens[b + 1], host_rows[b]
        m = min(window, end - start)
        if m <= 0:
            continue
        slots = ((count[row] + (end - m - start) + torch.arange(m, device=count.device)) % window).long()
        ring[row, slots] = q[end - m:end].reshape(m, kv_heads, group, -1).to(ring.dtype)
        count[row] += end - start


def read(store_tensors: dict[str, torch.Tensor], layer: int, row: int) -> torch.Tensor:
    """A row's window in `layer`, oldest first: [Hq, n, D] (query head h = KV head h // group)."""
    queries, counts = store_tensors[QUERIES], store_tensors[COUNT]
    window = queries.shape[4]
    order = ((counts[row, layer, 0].long() + torch.arange(window, device=queries.device)) % window)
    ring = queries[row, layer]  # [Hkv, group, n, D]
    return ring[:, :, order].reshape(-1, window, ring.shape[-1])


def read_rows(store_tensors: dict[str, torch.Tensor], layer: int | torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Several rows' windows in `layer` (or row g's in `layer[g]`), oldest first, as the heads of one:
    [len(rows) * Hq, n, D] (row g's query head h at g * Hq + h), each row's equal to `read`'s."""
    queries, counts = store_tensors[QUERIES], store_tensors[COUNT]
    window = queries.shape[4]
    ring = queries[rows, layer]  # [G, Hkv, group, n, D]
    order = (counts[rows, layer, 0, 0].long()[:, None] + torch.arange(window, device=queries.device)) % window
    index = order[:, None, None, :, None].expand(*ring.shape[:3], window, ring.shape[-1])
    return ring.gather(3, index).reshape(-1, window, ring.shape[-1])
