"""The compaction kernel (`runtime/kv/compaction_triton.py`) against the torch path and a
per-token Python reference written here from the contract (runtime/kv/compaction.py): token i of
head h's plan goes from slot keep[h, i] to slot i (equal counts) or M - count_h + i (per-head
counts, right-aligned), read from the cache as it was before; nothing else in the pool changes.

Under TRITON_INTERPRET=1 without a GPU (on a GPU the same tests run the compiled kernel, where
the CTA barrier matters). Small chunks (`block_t` 2 and 4) make the order of a head's walk
visible to the interpreter; the adversarial plans move tokens up and down across the same slots,
and a naive in-place walk is shown to corrupt them (the case bites). Page sizes divide no
length; sequences of one batch sit on shuffled pages of one pool and are compacted in one launch.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvc.runtime.kv.compaction import CompactionJob, compact_layer, compact_many

triton = pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

HEADS = 3


def pool(num_pages: int, page_size: int, head_dim: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, HEADS, page_size, head_dim)
    return (torch.randn(shape, generator=g).to(dtype).to(DEVICE), torch.randn(shape, generator=g).to(dtype).to(DEVICE))


def pages_for(lengths: list[int], page_size: int, spare: int, seed: int) -> tuple[list[list[int]], int]:
    """Disjoint shuffled page tables for sequences of `lengths` tokens, and the pool size."""
    need = [-(-n // page_size) for n in lengths]
    total = sum(need) + spare
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    return tables, total


def reference(k0, v0, jobs: list[CompactionJob]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Per token, from the untouched copies k0/v0: the pool after compaction, and each M."""
    k, v = k0.clone(), v0.clone()
    page_size = k0.shape[2]
    physical = []
    for job in jobs:
        width = job.keep.shape[1]
        counts = [width] * HEADS if job.counts is None else job.counts.tolist()
        m = max(counts)
        physical.append(m)
        for h in range(HEADS):
            for i in range(counts[h]):
                src, dst = int(job.keep[h, i]), m - counts[h] + i
                sp, ss = job.page_ids[src // page_size], src % page_size
                dp, ds = job.page_ids[dst // page_size], dst % page_size
                k[dp, h, ds] = k0[sp, h, ss]
                v[dp, h, ds] = v0[sp, h, ss]
    return k, v, physical


def random_plan(length: int, counts: list[int], starts: list[int], g: torch.Generator) -> torch.Tensor:
    """[HEADS, max count] ascending random slots of [starts[h], length), padded with -1."""
    width = max(counts)
    keep = torch.full((HEADS, width), -1, dtype=torch.long)
    for h, c in enumerate(counts):
        pick = torch.randperm(length - starts[h], generator=g)[:c].sort().values + starts[h]
        keep[h, :c] = pick
    return keep


def run_both(k0, v0, jobs, **triton_options):
    """(torch result, triton result), each on its own copy of the pool, and the reference."""
    want_k, want_v, want_m = reference(k0, v0, jobs)
    kt, vt = k0.clone(), v0.clone()
    got_torch = compact_many(kt, vt, jobs, backend="torch", checked=True)
    kg, vg = k0.clone(), v0.clone()
    if triton_options:
        from kvc.runtime.kv import compaction, compaction_triton

        plans = [compaction._resolve(kg, job, True) for job in jobs]
        compaction_triton.compact_triton(kg, vg, [p for p in plans if p.physical], **triton_options)
        got_triton = [compaction.Compacted(p.physical, p.offsets if any(p.offsets) else None) for p in plans]
    else:
        got_triton = compact_many(kg, vg, jobs, backend="triton", checked=True)
    for name, (k, v, res) in {"torch": (kt, vt, got_torch), "triton": (kg, vg, got_triton)}.items():
        assert [r.length for r in res] == want_m, name
        assert torch.equal(k, want_k), f"{name}: keys differ from the per-token reference"
        assert torch.equal(v, want_v), f"{name}: values differ from the per-token reference"
    return got_torch, got_triton


@pytest.mark.parametrize("block_t", [2, 4, None])
@pytest.mark.parametrize("page_size", [5, 8])
def test_equal_counts_batch(block_t, page_size):
    lengths, kept = [23, 40, 9], [7, 19, 9]
    tables, total = pages_for(lengths, page_size, spare=2, seed=page_size)
    k0, v0 = pool(total, page_size, 16, seed=1)
    g = torch.Generator().manual_seed(2)
    jobs = []
    for table, n, c in zip(tables, lengths, kept):
        keep = random_plan(n, [c] * HEADS, [0] * HEADS, g)
        lead = min(3, c)  # head 0's leading tokens are already in place (sinks): skipped
        rest = torch.randperm(n - lead, generator=g)[: c - lead].sort().values + lead
        keep[0] = torch.cat([torch.arange(lead), rest])
        jobs.append(CompactionJob(table, n, keep.to(DEVICE)))
    options = {} if block_t is None else {"block_t": block_t}
    got_torch, got_triton = run_both(k0, v0, jobs, **options)
    assert got_torch == got_triton
    assert all(r.starts is None for r in got_triton)


@pytest.mark.parametrize("block_t", [2, 4, None])
def test_variable_counts_right_aligned(block_t):
    page_size = 6
    lengths = [31, 17]
    tables, total = pages_for(lengths, page_size, spare=1, seed=3)
    k0, v0 = pool(total, page_size, 8, seed=4)
    g = torch.Generator().manual_seed(5)
    jobs = [
        CompactionJob(tables[0], 31, random_plan(31, [20, 0, 7], [0] * HEADS, g).to(DEVICE), torch.tensor([20, 0, 7])),
        CompactionJob(tables[1], 17, random_plan(17, [1, 17, 4], [0] * HEADS, g).to(DEVICE), torch.tensor([1, 17, 4])),
    ]
    options = {} if block_t is None else {"block_t": block_t}
    got_torch, got_triton = run_both(k0, v0, jobs, **options)
    assert got_torch == got_triton
    assert got_triton[0].starts == [0, 20, 13] and got_triton[1].starts == [16, 0, 13]


def adversarial_jobs(tables):
    """Right-aligned plans whose tokens move up over slots other tokens of the head still read:
    head 0 keeps the first tokens (every one moves up, onto later sources), head 1 mixes up- and
    down-movers across the same slots, head 2 keeps everything (in place)."""
    keep = torch.tensor([
        [0, 1, 2, 3, 4, 5, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1],
        [0, 1, 2, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, -1, -1],
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    ])
    return [CompactionJob(tables[0], 16 + 4, keep.to(DEVICE), torch.tensor([6, 14, 16]))]


def naive_walk(k0, job) -> torch.Tensor:
    """An in-place ascending walk token by token: what a kernel without the direction split does."""
    k = k0.clone()
    page_size = k.shape[2]
    counts = job.counts.tolist()
    m = max(counts)
    for h in range(HEADS):
        for i in range(counts[h]):
            src, dst = int(job.keep[h, i]), m - counts[h] + i
            row = k[job.page_ids[src // page_size], h, src % page_size].clone()
            k[job.page_ids[dst // page_size], h, dst % page_size] = row
    return k


@pytest.mark.parametrize("block_t", [2, 4, None])
def test_adversarial_moves_up_and_down(block_t):
    tables, total = pages_for([20], 7, spare=1, seed=6)
    k0, v0 = pool(total, 7, 8, seed=7)
    jobs = adversarial_jobs(tables)
    want_k, _, _ = reference(k0, v0, jobs)
    assert not torch.equal(naive_walk(k0, jobs[0]), want_k), "the plan does not exercise the in-place hazard"
    options = {} if block_t is None else {"block_t": block_t}
    got_torch, got_triton = run_both(k0, v0, jobs, **options)
    assert got_triton[0].length == 16 and got_triton[0].starts == [10, 2, 0]


@pytest.mark.parametrize("block_t", [2, None])
def test_recompaction_over_existing_starts(block_t):
    """A layer stored right-aligned (starts per head) is compacted again: each head's kept slots
    lie in [start_h, length); the result is laid out afresh (variable or equal counts)."""
    page_size = 5
    tables, total = pages_for([26, 26], page_size, spare=2, seed=8)
    k0, v0 = pool(total, page_size, 12, seed=9)
    g = torch.Generator().manual_seed(10)
    starts = [[4, 0, 19], [10, 13, 0]]
    variable = [5, 12, 7]
    jobs = [
        CompactionJob(tables[0], 26, random_plan(26, variable, starts[0], g).to(DEVICE), torch.tensor(variable),
                      starts[0]),
        CompactionJob(tables[1], 26, random_plan(26, [9] * HEADS, starts[1], g).to(DEVICE), None, starts[1]),
    ]
    options = {} if block_t is None else {"block_t": block_t}
    got_torch, got_triton = run_both(k0, v0, jobs, **options)
    assert got_triton[0].starts == [7, 0, 5] and got_triton[1].starts is None
    assert [r.length for r in got_triton] == [12, 9]


def test_head_dim_split_and_half_precision():
    """D = 80 in slices of 32 (a masked last slice), float16: still bit-exact copies."""
    tables, total = pages_for([37], 9, spare=1, seed=11)
    k0, v0 = pool(total, 9, 80, dtype=torch.float16, seed=12)
    g = torch.Generator().manual_seed(13)
    counts = [30, 11, 22]
    jobs = [CompactionJob(tables[0], 37, random_plan(37, counts, [0] * HEADS, g).to(DEVICE), torch.tensor(counts))]
    run_both(k0, v0, jobs, block_d=32, block_t=8)
    run_both(k0, v0, jobs)


def test_random_plans_property():
    """Many random batches (lengths, page sizes, counts, starts, chunk sizes) against the reference."""
    g = torch.Generator().manual_seed(14)
    for trial in range(12):
        page_size = int(torch.randint(2, 9, (1,), generator=g))
        lengths = torch.randint(1, 40, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
        tables, total = pages_for(lengths, page_size, spare=1, seed=100 + trial)
        k0, v0 = pool(total, page_size, 4, seed=200 + trial)
        jobs = []
        for table, n in zip(tables, lengths):
            starts = [int(torch.randint(0, n, (1,), generator=g)) if trial % 2 else 0 for _ in range(HEADS)]
            counts = [int(torch.randint(0, n - s + 1, (1,), generator=g)) for s in starts]
            if max(counts) == 0:
                counts[0] = n - starts[0]
            equal = trial % 3 == 0 and min(n - s for s in starts) > 0
            if equal:
                counts = [min(n - s for s in starts)] * HEADS
            keep = random_plan(n, counts, starts, g).to(DEVICE)
            jobs.append(CompactionJob(table, n, keep, None if equal else torch.tensor(counts), starts))
        block_t = [2, 4, 16][trial % 3]
        run_both(k0, v0, jobs, block_t=block_t)


def test_plans_outside_the_stored_tokens_are_rejected():
    tables, total = pages_for([12], 4, spare=0, seed=15)
    k, v = pool(total, 4, 4)
    keep = torch.tensor([[1, 5], [2, 3], [6, 11]], device=DEVICE)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="outside the stored tokens of KV head 0"):
            compact_layer(k, v, tables[0], 12, keep, starts=[3, 0, 0], checked=True, backend=backend)
        with pytest.raises(ValueError, match="stores only"):
            compact_layer(k, v, tables[0], 12, keep, starts=[0, 11, 0], checked=True, backend=backend)
        with pytest.raises(ValueError, match="ascend"):
            compact_layer(k, v, tables[0], 12, keep.flip(1), checked=True, backend=backend)
        with pytest.raises(ValueError, match="cannot hold"):
            compact_layer(k, v, tables[0][:2], 12, keep, checked=True, backend=backend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist on CUDA only")
def test_no_host_sync_on_cuda():
    """The whole batched call, per-head counts on the host, runs without a device sync."""
    tables, total = pages_for([300, 200], 16, spare=1, seed=16)
    k, v = pool(total, 16, 128, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(17)
    jobs = [CompactionJob(tables[0], 300, random_plan(300, [100, 40, 70], [0] * HEADS, g).to(DEVICE),
                          torch.tensor([100, 40, 70]), [0, 0, 0]),
            CompactionJob(tables[1], 200, random_plan(200, [64] * HEADS, [0] * HEADS, g).to(DEVICE))]
    compact_many(k, v, jobs)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        compact_many(k, v, jobs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
