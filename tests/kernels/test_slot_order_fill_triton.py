"""The in-place eviction kernel (`runtime/kv/slot_order_triton.py`) against the torch `fill`
(runtime/kv/slot_order.py), bit for bit on every tensor of the pool: moved slots, untouched slots,
other jobs' pages, free pages and the scratch page.

Random jobs sit on shuffled disjoint pages of one pool; lengths divide by no page size; keeps are
random subsets in random order with counts from length - 1 down to a quarter. The tensors are a
spec's kinds: K/V rows of 8 (bf16, float32), an int32 positions plane (no trailing dim), a float32
state plane, and an FP8 one where torch has the dtype (copied as bytes). Under TRITON_INTERPRET=1
without a GPU (tests/conftest.py sets it); on a GPU the compiled kernel runs.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvc.runtime.kv import slot_order

triton = pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from kvc.runtime.kv.slot_order_triton import MAX_TENSORS, fill_triton  # noqa: E402

DIM = 8


def _pool(num_pages: int, heads: int, page: int, seed: int, extra: bool = False) -> list[torch.Tensor]:
    """TOKEN tensors [num_pages + 1, Hkv, page, ...] of random content (the last page: scratch)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages + 1, heads, page)
    tensors = [torch.randn(*shape, DIM, generator=g).to(torch.bfloat16),
               torch.randn(*shape, DIM, generator=g),
               torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int32),
               torch.randn(*shape, generator=g)]
    if extra:  # more than one launch's tensors; a row of 2 x 3; FP8 codes
        tensors.append(torch.randn(*shape, 2, 3, generator=g).to(torch.bfloat16))
        if hasattr(torch, "float8_e4m3fn"):
            tensors.append(torch.randn(*shape, DIM, generator=g).to(torch.float8_e4m3fn))
    return [t.to(DEVICE) for t in tensors]


def _jobs(lengths: list[int], counts: list[int], heads: int, page: int, seed: int, spare: int = 3):
    """Shuffled disjoint tables (padded with garbage page ids) and random keeps in random order
    (garbage past each count), and the pool's page count."""
    rng = np.random.default_rng(seed)
    need = [-(-n // page) for n in lengths]
    num_pages = sum(need) + spare
    pages = rng.permutation(num_pages)
    width = max(need, default=0) + 1
    tables = rng.integers(0, num_pages, size=(len(lengths), width))
    at = 0
    for n, k in enumerate(need):
        tables[n, :k] = pages[at : at + k]
        at += k
    keep = np.zeros((len(lengths), heads, max(counts, default=0) + 2), dtype=np.int64)
    for n, (length, count) in enumerate(zip(lengths, counts)):
        for h in range(heads):
            keep[n, h] = rng.integers(-1, max(length, 1), size=keep.shape[2])  # past the count: ignored
            keep[n, h, :count] = rng.permutation(length)[:count]
    return tables, torch.as_tensor(keep, device=DEVICE), num_pages


def _check(lengths, counts, heads: int, page: int, seed: int, extra: bool = False) -> bool:
    """The kernel's pool equals the torch fill's, every byte; whether anything moved."""
    tables, keep, num_pages = _jobs(lengths, counts, heads, page, seed)
    want = _pool(num_pages, heads, page, seed, extra)
    got = [t.clone() for t in want]
    before = [t.clone() for t in want]
    lengths, counts = np.asarray(lengths, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    slot_order.fill(want, keep, counts, lengths, tables, backend="torch")
    fill_triton(got, keep, counts, lengths, tables)
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w.view(torch.uint8), g.view(torch.uint8)), (i, w.dtype, tuple(w.shape))
    moved = (lengths - counts).max(initial=0) > 0 and any(
        not torch.equal(w.view(torch.uint8), b.view(torch.uint8)) for w, b in zip(want, before))
    return moved


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("heads", [1, 3])
def test_the_kernel_equals_the_torch_fill(page, heads):
    rng = np.random.default_rng(page * 10 + heads)
    for num in (1, 2, 5):
        lengths = rng.integers(page + 1, 5 * page, size=num)
        lengths += (lengths % page == 0)  # never a whole number of pages
        counts = [int(rng.integers(max(n // 4, 1), n)) for n in lengths]  # from a quarter up to length - 1
        counts[0] = int(lengths[0]) - 1
        assert _check(lengths.tolist(), counts, heads, page, seed=num)


def test_the_kernel_equals_the_torch_fill_at_the_extremes():
    """Four KV heads; a keep of a quarter (more movers than a copy block); one slot kept; jobs that
    drop nothing beside jobs that do; more tensors than one launch takes (FP8 as bytes)."""
    assert _check([70, 41, 9, 33], [17, 41, 1, 32], 4, 4, seed=1, extra=True)
    assert len(_pool(1, 1, 4, 0, extra=True)) > MAX_TENSORS
    assert _check([1030, 12], [300, 12], 2, 16, seed=2)  # blocks of slots past the first


def test_nothing_moves_when_nothing_is_dropped():
    for lengths, counts in (([9, 16, 5], [9, 16, 5]), ([0, 4], [0, 4])):
        tables, keep, num_pages = _jobs(lengths, counts, 2, 4, seed=3)
        pool = _pool(num_pages, 2, 4, seed=3)
        before = [t.clone() for t in pool]
        fill_triton(pool, keep, np.asarray(counts), np.asarray(lengths), tables)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(pool, before))


def test_no_jobs():
    pool = _pool(2, 2, 4, seed=4)
    before = [t.clone() for t in pool]
    keep = torch.zeros(0, 2, 3, dtype=torch.long, device=DEVICE)
    empty = np.zeros(0, dtype=np.int64)
    fill_triton(pool, keep, empty, empty, np.zeros((0, 2), dtype=np.int64))
    slot_order.fill(pool, keep, empty, empty, np.zeros((0, 2), dtype=np.int64), backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(pool, before))


def test_fill_dispatches_to_the_kernel(monkeypatch):
    """`backend="triton"` (and "auto" on CUDA) runs the kernel; "torch" and "auto" off CUDA do not."""
    from kvc.runtime.kv import slot_order_triton

    calls = []
    monkeypatch.setattr(slot_order_triton, "fill_triton", lambda *a: calls.append(1))
    tables, keep, num_pages = _jobs([9], [5], 1, 4, seed=5)
    pool = _pool(num_pages, 1, 4, seed=5)
    args = (pool, keep, np.asarray([5]), np.asarray([9]), tables)
    slot_order.fill(*args, backend="triton")
    assert calls == [1]
    slot_order.fill(*args, backend="torch")
    slot_order.fill(*args)
    assert calls == ([1, 1] if DEVICE.type == "cuda" else [1])
    with pytest.raises(ValueError, match="backend must be one of"):
        slot_order.fill(*args, backend="cuda")


def test_small_blocks_carry_ranks_across_blocks(monkeypatch):
    """Blocks of 8 slots and 2 moves: every job's holes and movers span several blocks."""
    from kvc.runtime.kv import slot_order_triton

    monkeypatch.setattr(slot_order_triton, "BLOCK_S", 8)
    monkeypatch.setattr(slot_order_triton, "BLOCK_E", 2)
    monkeypatch.setattr(slot_order_triton, "MAX_BLOCK_R", 4)
    assert _check([45, 30, 19], [12, 29, 10], 2, 4, seed=6)
