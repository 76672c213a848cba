"""The GPU's read plan (runtime/primitives/triton_plans.py) against the torch primitive it replaces:
the same pages for every (row, KV head) up to order, ties at the cut broken in column order, -1
padding, the newest pages always listed. On the CPU it runs under TRITON_INTERPRET."""

import pytest
import torch

from kvc.runtime.primitives import torch_primitives

triton_plans = pytest.importorskip("kvc.runtime.primitives.triton_plans")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def plans(scores, lengths, page, count, last):
    got = triton_plans.read_pages(scores.to(DEV), lengths.to(DEV), page, count=count, last=last).cpu()
    want = torch_primitives.read_pages(scores, lengths, page, count=count, last=last)
    assert got.shape == want.shape and got.dtype == torch.int32
    return got, want


@pytest.mark.parametrize("rows,kv_heads,width,page,count,last", [
    (3, 2, 37, 16, 16 * 9, 16),   # a cut inside the stored pages
    (2, 4, 200, 16, 16 * 20, 16),
    (2, 1, 10, 16, 16 * 20, 16),  # a budget over the context: every stored page
    (1, 2, 64, 4, 4 * 5, 8),      # two newest pages
    (2, 2, 1500, 16, 16 * 255, 16),  # wider than one warp's share of registers
    (2, 2, 2177, 16, 16 * 255, 16),  # a 32K table + 2K (4,096 lanes for 2,177 pages)
    (1, 2, 3000, 16, 16 * 1100, 32),  # a cut far into a wide row, two newest pages
])
def test_plan_equals_the_torch_plan(rows, kv_heads, width, page, count, last) -> None:
    g = torch.Generator().manual_seed(width)
    scores = torch.randn(rows, kv_heads, width, generator=g)
    scores[0, 0, 3] = float("-inf")  # a page the scores rule out is never ranked
    lengths = torch.tensor([width * page, (width // 2) * page - 3, 7][:rows], dtype=torch.int32)
    got, want = plans(scores, lengths, page, count, last)
    for r in range(rows):
        for h in range(kv_heads):
            assert sorted(got[r, h].tolist()) == sorted(want[r, h].tolist()), (r, h)
    assert 3 not in got[0, 0].tolist()[: got.shape[-1] - (-(-last // page))]


@pytest.mark.parametrize("kind", ["close", "negative", "coarse"])
def test_the_cut_through_every_digit_of_the_keys(kind) -> None:
    """Scores that share their high bits (the cut is decided by the last byte), all negative, or
    few distinct values with many duplicates: the same pages as torch's top-k, up to ties."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(2, 2, 2048, generator=g)
    scores = {"close": 1.0 + base * 1e-6, "negative": -base.abs() - 3.0,
              "coarse": torch.randint(-4, 5, (2, 2, 2048), generator=g).float()}[kind]
    lengths = torch.tensor([2048 * 16, 1000 * 16], dtype=torch.int32)
    got, want = plans(scores, lengths, 16, 16 * 255, 16)
    for r in range(2):
        for h in range(2):
            ranked_got, ranked_want = got[r, h, :255], want[r, h, :255]
            assert sorted(scores[r, h, ranked_got.long()].tolist()) == sorted(scores[r, h, ranked_want.long()].tolist())
            assert len(set(ranked_got.tolist())) == 255


def test_ties_at_the_cut_fill_in_column_order() -> None:
    scores = torch.zeros(1, 1, 50)
    scores[..., ::3] = 1.0  # 17 pages tie for the top, more than the 10 ranked places
    got, want = plans(scores, torch.tensor([800], dtype=torch.int32), 16, 16 * 10, 16)
    assert got[0, 0].tolist() == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 49]
    assert sorted(scores[0, 0, want[0, 0, :10]].tolist()) == [1.0] * 10  # torch chooses other ties


def test_short_rows_pad_with_minus_one() -> None:
    scores = torch.randn(2, 2, 30)
    lengths = torch.tensor([40, 0], dtype=torch.int32)  # 3 pages, then an empty row
    got, want = plans(scores, lengths, 16, 16 * 8, 16)
    assert got[0, 0].tolist() == [0, 1] + [-1] * 6 + [2]
    assert (got[1] == -1).all() and torch.equal(got[1], want[1])
    assert sorted(got[0, 1].tolist()) == sorted(want[0, 1].tolist())


def test_the_plan_kernel_compiles_for_sm90() -> None:
    """The plan kernels compile for an H100/H200 (Triton's compiler and ptxas run here, outside the
    interpreter; tests/kernels/sm90_compile.py)."""
    from tests.kernels.sm90 import code_compiles_for_sm90

    code_compiles_for_sm90("from tests.kernels.sm90_compile import build\n"
            "from kvc.runtime.primitives import triton_plans as tp\n"
            "ptrs = {'scores_ptr': '*fp32', 'lengths_ptr': '*i32', 'out_ptr': '*i32'}\n"
            "build(tp._read_pages_kernel, {'PAGE': 16, 'BLOCK_W': 2048, 'BLOCK_L': 1}, ptrs)\n"
            "build(tp._slice_candidates_kernel, {'PAGE': 16, 'SLICE': 1024},\n"
            "      {**ptrs, 'key_ptr': '*i32', 'col_ptr': '*i32'}, num_warps=4)\n"
            "build(tp._cut_candidates_kernel, {'PAGE': 16, 'BLOCK_C': 4096, 'BLOCK_L': 1},\n"
            "      {'key_ptr': '*i32', 'col_ptr': '*i32', 'lengths_ptr': '*i32', 'out_ptr': '*i32'}, num_warps=8)\n")


@pytest.mark.parametrize("rows,kv_heads,width,page,count,last,slice_pages", [
    (2, 2, 200, 16, 16 * 9, 16, 16),    # 13 slices of 16 pages, 9 candidates each
    (3, 2, 300, 16, 16 * 20, 16, 64),   # a short row and an empty one
    (1, 2, 130, 4, 4 * 10, 8, 32),      # pages of 4, two newest pages, 5 slices of 32
])
def test_two_passes_equal_one(rows, kv_heads, width, page, count, last, slice_pages) -> None:
    """The wide rows' two passes (slices' candidates, then their cut) give the one pass's plan exactly, ties in
    column order included; scores with many equal values put ties at the cut across slices."""
    g = torch.Generator().manual_seed(width)
    scores = torch.randint(-3, 4, (rows, kv_heads, width), generator=g).float()
    scores[0, 0, 5] = float("-inf")
    lengths = torch.tensor([width * page, (width // 3) * page - 1, 0][:rows], dtype=torch.int32)
    one = triton_plans.read_pages(scores.to(DEV), lengths.to(DEV), page, count=count, last=last, slice_pages=0)
    two = triton_plans.read_pages(scores.to(DEV), lengths.to(DEV), page, count=count, last=last,
                                  slice_pages=slice_pages)
    assert torch.equal(one, two)
    want = torch_primitives.read_pages(scores, lengths, page, count=count, last=last)
    for r in range(rows):
        for h in range(kv_heads):
            got_scores = sorted(scores[r, h, [c for c in two[r, h].tolist() if c >= 0]].tolist())
            want_scores = sorted(scores[r, h, [c for c in want[r, h].tolist() if c >= 0]].tolist())
            assert got_scores == want_scores, (r, h)


def test_a_wide_row_takes_two_passes() -> None:
    """A 128K table (8,321 pages) goes through the slices: the same plan as one pass, on random scores."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(1, 1, 8321, generator=g)
    lengths = torch.tensor([131072 + 5], dtype=torch.int32)
    one = triton_plans.read_pages(scores.to(DEV), lengths.to(DEV), 16, count=4080, last=16, slice_pages=0)
    two = triton_plans.read_pages(scores.to(DEV), lengths.to(DEV), 16, count=4080, last=16)
    assert torch.equal(one, two)
    assert triton_plans.SLICE_FROM <= 16384
