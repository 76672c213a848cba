"""A ranked ring's step in Triton (`runtime/kv/ring_triton.py`) against the torch `promote` (runtime/kv/ring.py),
bit for bit on every tensor of a store: rows whose leaving token wins, loses, ties the lowest ranked score, and
rows without a leaving slot; ranked slots with tied lowest scores (the newest position goes); the ranked range
longer than a block of the choice, and pages shuffled over the pool (the scratch page aside: torch's no-ops write
there). Five TOKEN tensors (bf16 K and V, two float32
planes, int32 positions): two launches of the move. Under TRITON_INTERPRET=1 without a GPU (tests/conftest.py
sets it); on a GPU the compiled kernels run.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvc.runtime.kv.ring import promote
from kvc.runtime.kv.spec import Extent, KVSpec, TensorSpec, state_plane
from kvc.runtime.kv.store import KVStore

triton = pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

HEADS, PAGE, DIM = 2, 8, 4


def _store(num_pages: int, seed: int) -> KVStore:
    spec = KVSpec((TensorSpec("k", Extent.TOKEN, torch.bfloat16, (DIM,)),
                   TensorSpec("v", Extent.TOKEN, torch.bfloat16, (DIM,)), state_plane("seen"),
                   state_plane("scores"), TensorSpec("slot.position", Extent.TOKEN, torch.int32, ())),
                  positions="slot.position", in_place=True)
    store = KVStore(spec, num_pages=num_pages, num_kv_heads=HEADS, page_size=PAGE, num_layers=1, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    for name, t in store.tensors.items():
        if t.dtype == torch.int32:
            t.copy_(torch.randperm(t.numel(), generator=g).view(t.shape).to(torch.int32))  # distinct positions
        else:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return store


@pytest.mark.parametrize("first", [5, 300])  # within one block of the choice, and over two
def test_triton_promote_equals_torch(first):
    rows, capacity = 6, first + 4  # and a seventh row (below)
    pages_per_row = -(-capacity // PAGE)
    g = torch.Generator().manual_seed(first)
    num_pages = rows * pages_per_row + 3
    tables = torch.randperm(num_pages, generator=g)[: rows * pages_per_row].view(rows, pages_per_row)
    scores = torch.rand(rows, HEADS, capacity + 5, generator=g)  # wider than the capacity, as a graph bucket
    scores[1, :, :first] = 0.25  # every ranked slot tied: the newest position goes
    scores[2, 0, first + 1] = scores[2, 0, :first].min()  # the leaving token ties the lowest: it stays out
    scores[3, :, first + 2] = 2.0  # the leaving token wins in both heads
    scores[4, 1, :first] = 3.0  # it wins in head 1 only
    leave = torch.tensor([first + 3, first, first + 1, first + 2, first, -1, first])
    firsts = torch.tensor([first, first, first, first, first, first, first - 2])  # a row of fewer ranked slots
    tables = torch.cat([tables, tables[:1]])  # row 6 reads row 0's pages (it moves nothing there: see below)
    scores = torch.cat([scores, scores[:1]])
    scores[6, :, first - 2] = -1.0  # past its ranked slots: it must not count as the lowest
    scores[6, :, first] = -0.5  # its leaving token, lower than every ranked one: no move
    want, got = _store(num_pages, first), _store(num_pages, first)
    promote(want, tables, scores, leave, firsts, triton=False)
    promote(got, tables.to(DEVICE).int(), scores.to(DEVICE), leave.to(DEVICE), firsts.to(DEVICE), triton=True)
    before, moved = _store(num_pages, first), 0
    for name in want.tensors:  # the scratch page (the last) is anyone's to write: torch parks its no-ops there
        torch.testing.assert_close(got[name][:num_pages].cpu(), want[name][:num_pages], rtol=0, atol=0)
        moved += int((want[name][:num_pages] != before[name][:num_pages]).any())
    assert moved == len(want.tensors)  # some row's token moved in every tensor
