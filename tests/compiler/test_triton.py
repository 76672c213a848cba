"""Generated Triton kernels against the generated torch lowering, under TRITON_INTERPRET=1."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton")

HEADS, KV_HEADS, DIM = 4, 2, 16


def _qk(length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(HEADS, length, DIM, generator=g), torch.randn(KV_HEADS, length, DIM, generator=g)


def _mods(name):
    base = f"kvc.kernels_generated.{name}"
    return importlib.import_module(f"{base}.torch_lowering"), importlib.import_module(f"{base}.triton_kernels")


@pytest.mark.parametrize("name,kernel,params", [
    ("snapkv", "window_score", {"window": 8, "kernel": 5, "pooling": "avg"}),
    ("snapkv", "window_score", {"window": 8, "kernel": 3, "pooling": "max"}),
    ("adakv", "window_score", {"window": 4, "kernel": 5}),
    ("tova", "last_query_score", {}),
])
@pytest.mark.parametrize("length", [21, 40])
def test_scores(name, kernel, params, length):
    lowering, kernels = _mods(name)
    q, k = _qk(length, length)
    expected = lowering.score(q, k, params=params)
    got = getattr(kernels, kernel)(q, k, params)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_h2o_column_sums():
    lowering, kernels = _mods("h2o")
    q, k = _qk(29, 3)
    expected = lowering.score(q, k)  # one chunk: the whole prompt
    state = kernels.column_sum(q, k, None, {"seen": torch.zeros(KV_HEADS, 0)})
    torch.testing.assert_close(state["seen"], expected, rtol=1e-4, atol=1e-6)
    # two chunks accumulate into the same state
    first = kernels.column_sum(q[:, :17], k[:, :17], None, {"seen": torch.zeros(KV_HEADS, 0)})
    both = kernels.column_sum(q[:, 17:], k, None, first)
    torch.testing.assert_close(both["seen"], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("queries,block_q", [(6, 16), (3, 16), (20, 16), (8, 32), (4, 16), (16, 16)])
def test_column_votes_against_the_attention_it_sums(queries, block_q):
    """`column_votes` equals causal softmax attention of the last `queries` positions summed over them, per query
    head, for the first n_keys keys; a KV head's query rows (group x queries) go `block_q` at a time, so a
    head's rows may straddle two blocks (20 queries in blocks of 16) or share one with other heads (3, 6, 8); a
    block of whole heads (4, 8 or 16 queries, a power of two dividing the block) sums them in one reduction."""
    from kvc.runtime.primitives.triton_primitives import column_votes

    g = torch.Generator().manual_seed(queries)
    length, group = 37, HEADS // KV_HEADS
    q = torch.randn(HEADS, queries, DIM, generator=g)
    k = torch.randn(KV_HEADS, length, DIM, generator=g)
    keys = k.repeat_interleave(group, dim=0)  # [HEADS, length, D]
    s = q @ keys.transpose(1, 2) / DIM ** 0.5
    causal = torch.arange(length)[None, :] <= (length - queries + torch.arange(queries))[:, None]
    want = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1).sum(dim=1)[:, : length - queries]
    got = column_votes(q, k, length - queries, block_q=block_q, block_k=16, num_warps=4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("channels", [DIM, DIM - 4])
def test_column_votes_over_paged_keys(ordered, channels):
    """The window score reading a decode batch's keys where the store keeps them (`PagedKeys`: shuffled pages,
    a partial last page, a slot order for a layer evicted in place, channels below the stored width) equals it
    over the same keys gathered into a dense tensor, as the stacked step end read them before."""
    from kvc.runtime.primitives.paged_keys import PagedKeys
    from kvc.runtime.primitives.triton_primitives import column_votes

    g = torch.Generator().manual_seed(3 + channels + ordered)
    rows, page, length, queries = 3, 4, 21, 6
    pages = -(-length // page)
    plane = torch.randn(rows * pages + 2, KV_HEADS, page, DIM, generator=g)
    tables = torch.randperm(rows * pages + 1, generator=g)[: rows * pages].view(rows, pages)
    order = torch.stack([torch.stack([torch.randperm(length, generator=g) for _ in range(KV_HEADS)])
                         for _ in range(rows)]) if ordered else None
    slots = order if ordered else torch.arange(length).expand(rows, KV_HEADS, length)
    heads = torch.arange(KV_HEADS)[None, :, None]
    dense = plane[tables.gather(1, (slots // page).flatten(1)).view_as(slots), heads, slots % page][..., :channels]
    q = torch.randn(rows * HEADS, queries, channels, generator=g)
    want = column_votes(q, dense.reshape(rows * KV_HEADS, length, channels), length - queries)
    got = column_votes(q, PagedKeys(plane, tables, order, length, channels), length - queries)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
