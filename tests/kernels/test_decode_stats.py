"""Decode attention statistics: the torch backend (`runtime/attention/decode_stats.py`) against a
float64 dense definition, and the generated decode kernels that emit them (attention variant
`decode_stats`, kernels_generated/_attention/) against the torch backend (under
TRITON_INTERPRET=1 on a machine without a GPU), for every reduction a method can ask for, one
split (the split kernel writes the log-sum-exp) and several (the reduce kernel does), and
per-head start slots.

Cases use shuffled pages whose size does not divide the lengths, an empty row, GQA groups of 1,
2 and 4, and unowned cache slots holding NaN (a stray read would poison the output). Outputs
start as NaN so an unwritten entry fails too. The attention output of the variant must equal the
plain variant's bit for bit: emitting statistics must not change the attention.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.attention.decode_stats import decode_stats_torch
from kvc.runtime.attention.metadata import DecodeStats
from tests.kernels.paged_cases import make_case, poison_before_starts, random_starts, triton_device_and_ops

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
pytest.importorskip("triton")
DEVICE, plain_ops = triton_device_and_ops("plain")
_, stats_ops = triton_device_and_ops("decode_stats")

LENGTHS = [13, 0, 40, 1, 71]
REDUCTIONS = [("group", "mean"), ("group", "sum"), ("head", "mean"), ("head", "sum"), ("none", None)]


def definition(case, q: torch.Tensor, scale: float, width: int, reduce: str, fn: str | None,
               starts: torch.Tensor | None = None) -> torch.Tensor:
    """Per sequence, softmax(q k^T * scale) over its dense keys in float64 (KV head h's query heads
    over keys starts[b, h].. only), folded as asked."""
    num_heads = q.shape[1]
    num_kv_heads = case.k_cache.shape[1]
    group = num_heads // num_kv_heads
    rows = {"group": num_kv_heads, "head": 1, "none": num_heads}[reduce]
    out = torch.zeros(q.shape[0], rows, width, dtype=torch.float64)
    for b, keys in enumerate(case.keys):
        n = keys.shape[0]
        if n == 0:
            continue
        k = keys.double().cpu().repeat_interleave(group, dim=1)  # [n, Hq, D]
        logits = torch.einsum("hd,nhd->hn", q[b].double().cpu(), k) * scale  # [Hq, n]
        if starts is not None:
            first = starts[b].cpu().long().repeat_interleave(group)  # [Hq]
            logits = logits.masked_fill(torch.arange(n)[None, :] < first[:, None], float("-inf"))
        probs = logits.softmax(dim=-1)
        if reduce == "group":
            folded = probs.reshape(num_kv_heads, group, n)
            out[b, :, :n] = folded.mean(1) if fn == "mean" else folded.sum(1)
        elif reduce == "head":
            out[b, 0, :n] = probs.mean(0) if fn == "mean" else probs.sum(0)
        else:
            out[b, :, :n] = probs
    return out


def _case(seed: int, num_kv_heads: int, page_size: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return make_case(LENGTHS, num_kv_heads, 16, page_size, gen=gen, dtype=dtype, device=DEVICE, stale=float("nan"))


@pytest.mark.parametrize("reduce,fn", REDUCTIONS)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_torch_matches_the_definition(reduce, fn, group):
    case = _case(3, 2, 5)
    case.k_cache = case.k_cache.nan_to_num(0.0)  # the torch backend gathers whole pages
    q = torch.randn(len(LENGTHS), 2 * group, 16, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    width = max(LENGTHS) + 3
    rows = {"group": 2, "head": 1, "none": 2 * group}[reduce]
    out = torch.full((len(LENGTHS), rows, width), float("nan"), device=DEVICE)
    decode_stats_torch(q, case.k_cache, case.block_tables, case.context_lens, 0.25, out, reduce, fn)
    want = definition(case, q, 0.25, width, reduce, fn)
    torch.testing.assert_close(out.double().cpu(), want, atol=1e-6, rtol=1e-5)


def fused(case, q, width, reduce, fn, num_splits, starts=None):
    """(statistics, attention output) of the `decode_stats` variant, both poisoned beforehand."""
    rows = {"group": case.k_cache.shape[1], "head": 1, "none": q.shape[1]}[reduce]
    got = torch.full((q.shape[0], rows, width), float("nan"), device=DEVICE)
    out = torch.full_like(q, float("nan"))
    stats_ops.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25, out=out,
                           kv_starts=starts, stats=DecodeStats(reduce, fn, got), num_splits=num_splits)
    return got, out


def plain(case, q, num_splits, starts=None):
    out = torch.full_like(q, float("nan"))
    plain_ops.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25, out=out,
                           kv_starts=starts, num_splits=num_splits)
    return out


@pytest.mark.parametrize("reduce,fn", REDUCTIONS)
@pytest.mark.parametrize("group,page_size,num_splits", [(1, 4, 1), (2, 5, 3), (4, 16, 2)])
def test_fused_matches_torch(reduce, fn, group, page_size, num_splits):
    case = _case(7, 2, page_size)
    q = torch.randn(len(LENGTHS), 2 * group, 16, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    width = max(LENGTHS) + 9  # wider than every row: the tail must be written as zeros
    got, out = fused(case, q, width, reduce, fn, num_splits)
    want = torch.empty_like(got)
    clean = case.k_cache.nan_to_num(0.0)
    decode_stats_torch(q, clean, case.block_tables, case.context_lens, 0.25, want, reduce, fn)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.all(got[1] == 0)  # the empty row
    assert torch.equal(out, plain(case, q, num_splits))  # the attention itself is untouched


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_half_precision_caches(dtype):
    case = _case(9, 2, 5, dtype=dtype)
    q = torch.randn(len(LENGTHS), 4, 16, generator=torch.Generator().manual_seed(10)).to(dtype).to(DEVICE)
    width = max(LENGTHS)
    got, out = fused(case, q, width, "group", "mean", 2)
    want = definition(case, q.float(), 0.25, width, "group", "mean")
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-3, rtol=2e-3)
    assert torch.equal(out, plain(case, q, 2))


@pytest.mark.parametrize("reduce,fn", [("group", "sum"), ("head", "mean"), ("none", None)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_starts_torch_and_fused_match_the_definition(reduce, fn, num_splits):
    """Per-head start slots: a KV head's query heads attend from its start; the statistics are 0
    before it, and the fused kernels never read the (NaN-poisoned) slots there."""
    case = _case(11, 2, 3)
    starts = random_starts(case, 2, torch.Generator().manual_seed(12))
    q = torch.randn(len(LENGTHS), 4, 16, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    width = max(LENGTHS) + 2
    want = definition(case, q, 0.25, width, reduce, fn, starts)
    clean = case.k_cache.nan_to_num(0.0)
    torch_out = torch.empty(want.shape, dtype=torch.float32, device=DEVICE)
    decode_stats_torch(q, clean, case.block_tables, case.context_lens, 0.25, torch_out, reduce, fn, kv_starts=starts)
    torch.testing.assert_close(torch_out.double().cpu(), want, atol=1e-6, rtol=1e-5)
    poison_before_starts(case, starts)
    got, out = fused(case, q, width, reduce, fn, num_splits, starts)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-6, rtol=1e-5)
    assert torch.equal(out, plain(case, q, num_splits, starts))


def test_torch_backend_decode_fills_the_statistics():
    """torch_ops.paged_decode(..., stats=) (the engine's CPU path): attention as without stats,
    statistics as decode_stats_torch."""
    case = _case(5, 2, 4)
    case.k_cache, case.v_cache = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    q = torch.randn(len(LENGTHS), 4, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25)
    got = torch.full((len(LENGTHS), 1, max(LENGTHS)), float("nan"), device=DEVICE)
    out = torch_ops.paged_decode(*args, stats=DecodeStats("head", "sum", got))
    torch.testing.assert_close(out, torch_ops.paged_decode(*args), atol=0, rtol=0)
    want = definition(case, q, 0.25, max(LENGTHS), "head", "sum")
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-6, rtol=1e-5)


def test_the_plain_variant_refuses_a_statistics_request():
    case = _case(1, 2, 4)
    q = torch.randn(len(LENGTHS), 4, 16).to(DEVICE)
    stats = DecodeStats("group", "mean", torch.empty(len(LENGTHS), 2, 80, device=DEVICE))
    with pytest.raises(ValueError, match="emits no decode statistics"):
        plain_ops.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25,
                               stats=stats)


def test_bad_arguments_are_clear():
    case = _case(1, 2, 4)
    q = torch.randn(len(LENGTHS), 4, 16).to(DEVICE)
    with pytest.raises(ValueError, match="reduce must be"):
        decode_stats_torch(q, case.k_cache, case.block_tables, case.context_lens, 1.0,
                           torch.empty(len(LENGTHS), 2, 8, device=DEVICE), "rows", "mean")
    with pytest.raises(ValueError, match="out must be float32"):
        decode_stats_torch(q, case.k_cache, case.block_tables, case.context_lens, 1.0,
                           torch.empty(len(LENGTHS), 3, 8, device=DEVICE), "group", "mean")
