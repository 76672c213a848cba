"""A decode step's bookkeeping writes in one launch each (runtime/kv/records_triton.py) against their torch
versions (`slot_order.record`, `query_window.record`'s decode rows), bit for bit on the whole tensor: the
positions of a step's tokens (slots on shuffled pages, every KV head; -1 to the scratch page, whose value is
then any of theirs), and decode rows' queries into their windows in one layer (rows in any order, counts past
the window so slots wrap, a query head group of 4, q a strided view as the attention hands it) with their
counts one up; the other layers and rows untouched. Under TRITON_INTERPRET=1 without a GPU (tests/conftest.py
sets it); on a GPU the compiled kernels (passed on an H100, 2026-12-06)."""

from __future__ import annotations

import os

import pytest
import torch

from kvc.runtime.kv import query_window, slot_order

triton = pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)


@pytest.mark.parametrize("heads", [1, 3, 4])
def test_positions_equal_the_torch_record(heads):
    g = torch.Generator().manual_seed(heads)
    pages, page = 9, 5
    plane = torch.randint(0, 1000, (pages + 1, heads, page), generator=g, dtype=torch.int32).to(DEVICE)
    slots = torch.randperm(pages * page, generator=g)[:70 % (pages * page)]
    slots[::7] = -1  # no slot: the scratch page's
    positions = torch.randint(0, 10**6, (len(slots),), generator=g)
    want = plane.clone()
    slot_order.record(want, slots.to(DEVICE), positions.to(DEVICE))
    got = plane.clone()
    slot_order.record(got, slots.to(DEVICE), positions.to(DEVICE), backend="triton")
    assert torch.equal(got[:-1], want[:-1])  # the scratch page takes every slot-less token's, in any order
    assert not torch.equal(got, plane)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_queries_equal_the_torch_record(dtype):
    g = torch.Generator().manual_seed(3)
    rows, layers, kv_heads, group, window, dim, layer = 7, 3, 2, 4, 5, 16, 1
    store = {query_window.QUERIES: torch.randn(rows + 1, layers, kv_heads, group, window, dim, generator=g).to(dtype),
             query_window.COUNT: torch.randint(0, 13, (rows + 1, layers, kv_heads, 1), generator=g, dtype=torch.int32)}
    store = {name: t.to(DEVICE) for name, t in store.items()}
    decodes = 4
    qkv = torch.randn(decodes, kv_heads * group + 2 * kv_heads, dim, generator=g).to(DEVICE, dtype)  # the model dtype
    q = qkv[:, : kv_heads * group]  # a view of a fused projection: rows strided past the query heads
    row_ids = torch.tensor([5, 0, 3, 6], dtype=torch.int32, device=DEVICE)
    want = {name: t.clone() for name, t in store.items()}
    query_window.record(want, layer, q, row_ids, decodes, None, None)
    got = {name: t.clone() for name, t in store.items()}
    query_window.record(got, layer, q, row_ids, decodes, None, None, backend="triton")
    for name in store:
        assert torch.equal(got[name], want[name]), name
    assert not torch.equal(got[query_window.QUERIES], store[query_window.QUERIES])
    assert torch.equal(got[query_window.COUNT][:, layer, 0, 0].cpu()[[5, 0, 3, 6]],
                       store[query_window.COUNT][:, layer, 0, 0].cpu()[[5, 0, 3, 6]] + 1)
