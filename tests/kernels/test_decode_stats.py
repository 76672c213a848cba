"""Decode attention statistics (`runtime/attention/decode_stats.py`): the torch backend against a
float64 dense definition, and the Triton kernels against the torch backend (under
TRITON_INTERPRET=1 on a machine without a GPU), for every reduction a method can ask for.

Cases use shuffled pages whose size does not divide the lengths, an empty row, GQA groups of 1,
2 and 4, and unowned cache slots holding NaN (a stray read would poison the output). Outputs
start as NaN so an unwritten entry fails too.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from kvc.runtime.attention.decode_stats import decode_stats_torch
from tests.kernels.paged_cases import make_case, triton_device_and_ops

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
pytest.importorskip("triton")
DEVICE, _ = triton_device_and_ops()
sys.modules.pop("kvc.runtime.attention.decode_stats_triton", None)  # decorated under the interpreter
decode_stats_triton = importlib.import_module("kvc.runtime.attention.decode_stats_triton").decode_stats_triton

LENGTHS = [13, 0, 40, 1, 71]
REDUCTIONS = [("group", "mean"), ("group", "sum"), ("head", "mean"), ("head", "sum"), ("none", None)]


def definition(case, q: torch.Tensor, scale: float, width: int, reduce: str, fn: str | None) -> torch.Tensor:
    """Per sequence, softmax(q k^T * scale) over its dense keys in float64, folded as asked."""
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
        probs = (torch.einsum("hd,nhd->hn", q[b].double().cpu(), k) * scale).softmax(dim=-1)  # [Hq, n]
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


@pytest.mark.parametrize("reduce,fn", REDUCTIONS)
@pytest.mark.parametrize("group,page_size", [(1, 4), (2, 5), (4, 16)])
def test_triton_matches_torch(reduce, fn, group, page_size):
    case = _case(7, 2, page_size)
    q = torch.randn(len(LENGTHS), 2 * group, 16, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    width = max(LENGTHS) + 9  # wider than every row: the tail must be written as zeros
    rows = {"group": 2, "head": 1, "none": 2 * group}[reduce]
    got = torch.full((len(LENGTHS), rows, width), float("nan"), device=DEVICE)
    decode_stats_triton(q, case.k_cache, case.block_tables, case.context_lens, 0.25, got, reduce, fn)
    want = torch.empty_like(got)
    clean = case.k_cache.nan_to_num(0.0)
    decode_stats_torch(q, clean, case.block_tables, case.context_lens, 0.25, want, reduce, fn)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.all(got[1] == 0)  # the empty row


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision_caches(dtype):
    case = _case(9, 2, 5, dtype=dtype)
    q = torch.randn(len(LENGTHS), 4, 16, generator=torch.Generator().manual_seed(10)).to(dtype).to(DEVICE)
    width = max(LENGTHS)
    got = torch.full((len(LENGTHS), 2, width), float("nan"), device=DEVICE)
    decode_stats_triton(q, case.k_cache, case.block_tables, case.context_lens, 0.25, got, "group", "mean")
    want = definition(case, q.float(), 0.25, width, "group", "mean")
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-3, rtol=2e-3)


def test_bad_arguments_are_clear():
    case = _case(1, 2, 4)
    q = torch.randn(len(LENGTHS), 4, 16).to(DEVICE)
    with pytest.raises(ValueError, match="reduce must be"):
        decode_stats_torch(q, case.k_cache, case.block_tables, case.context_lens, 1.0,
                           torch.empty(len(LENGTHS), 2, 8, device=DEVICE), "rows", "mean")
    with pytest.raises(ValueError, match="out must be float32"):
        decode_stats_torch(q, case.k_cache, case.block_tables, case.context_lens, 1.0,
                           torch.empty(len(LENGTHS), 3, 8, device=DEVICE), "group", "mean")
