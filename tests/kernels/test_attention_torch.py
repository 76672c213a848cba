"""The torch paged-attention ops (the CPU backend) against a dense float64 reference."""

from __future__ import annotations

import pytest
import torch

from kvc.runtime.attention import torch_ops
from tests.kernels.paged_cases import make_case, reference_decode, reference_prefill

HEAD_DIM = 16
NUM_KV_HEADS = 2
TOL = {"atol": 2e-5, "rtol": 1e-4}


def fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_store_kv_writes_only_valid_slots():
    gen = fresh(0)
    num_pages, page_size = 5, 3
    k_cache = torch.randn(num_pages, NUM_KV_HEADS, page_size, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_pages, NUM_KV_HEADS, page_size, HEAD_DIM, generator=gen)
    k = torch.randn(4, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(4, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    slots = torch.tensor([7, -1, 0, 14])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // page_size, :, slot % page_size] = k[t]
            want_v[slot // page_size, :, slot % page_size] = v[t]
    torch_ops.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_decode_matches_reference(group, page_size):
    gen = fresh(100 * group + page_size)
    lengths = [1, 37, 0, 16, 9]  # 0 = a CUDA-graph padding row
    case = make_case(lengths, NUM_KV_HEADS, HEAD_DIM, page_size, gen=gen)
    q = torch.randn(len(lengths), NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
    out = torch_ops.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.3,
                                 max_context_len=max(lengths))
    torch.testing.assert_close(out.double(), reference_decode(case, q, 0.3), **TOL)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_decode_with_a_loose_context_bound():
    # CUDA graphs pass an upper bound (or nothing) instead of the batch's longest context.
    gen = fresh(7)
    case = make_case([5, 21], NUM_KV_HEADS, HEAD_DIM, 4, gen=gen)
    q = torch.randn(2, 4, HEAD_DIM, generator=gen)
    want = reference_decode(case, q, 0.25)
    for bound in (None, 21, 1000):
        out = torch_ops.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25,
                                     max_context_len=bound)
        torch.testing.assert_close(out.double(), want, **TOL)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page_size", [3, 16])
def test_prefill_matches_reference(group, page_size):
    gen = fresh(1000 + 10 * group + page_size)
    # (context after the step, new tokens): fresh prompts, chunks on top of cached prefixes,
    # a single-token chunk and a sequence with no new tokens this step.
    shapes = [(7, 7), (40, 13), (18, 1), (9, 0), (33, 32)]
    lengths = [n for n, _ in shapes]
    cu = [0]
    for _, q_len in shapes:
        cu.append(cu[-1] + q_len)
    case = make_case(lengths, NUM_KV_HEADS, HEAD_DIM, page_size, gen=gen)
    q = torch.randn(cu[-1], NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
    out = torch_ops.paged_prefill(q, case.k_cache, case.v_cache, case.block_tables,
                                  torch.tensor(cu, dtype=torch.int32), case.context_lens, 0.2,
                                  max_query_len=32)
    torch.testing.assert_close(out.double(), reference_prefill(case, q, cu, 0.2), **TOL)


def test_prefill_without_prefix_equals_plain_causal_sdpa():
    # One prompt from position 0: the same numbers as a dense causal SDPA, the HF parity path.
    gen = fresh(3)
    case = make_case([29], 2, HEAD_DIM, 8, gen=gen)
    q = torch.randn(29, 4, HEAD_DIM, generator=gen)
    out = torch_ops.paged_prefill(q, case.k_cache, case.v_cache, case.block_tables,
                                  torch.tensor([0, 29], dtype=torch.int32), case.context_lens, 0.25, 29)
    k = case.keys[0].transpose(0, 1).repeat_interleave(2, dim=0)
    v = case.values[0].transpose(0, 1).repeat_interleave(2, dim=0)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=0.25)
    torch.testing.assert_close(out, dense.transpose(0, 1), atol=1e-6, rtol=1e-5)


# ---- the CPU fast paths of paged_prefill (4-D SDPA, is_causal, the split over a cached prefix) ----


def varlen_case(shapes, group, page_size, seed):
    """(case, q, cu) for chunks `shapes` = [(context after the step, new tokens)]."""
    gen = fresh(seed)
    cu = [0]
    for _, q_len in shapes:
        cu.append(cu[-1] + q_len)
    case = make_case([n for n, _ in shapes], NUM_KV_HEADS, HEAD_DIM, page_size, gen=gen)
    q = torch.randn(cu[-1], NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
    return case, q, torch.tensor(cu, dtype=torch.int32)


def masked_only(monkeypatch):
    """paged_prefill's general path: one SDPA with the causal mask per chunk (no flash split)."""
    monkeypatch.setattr(torch_ops, "_CPU_FLASH", None)


@pytest.mark.parametrize("group", [1, 3])
def test_prefill_split_over_prefix_equals_the_masked_path(group, monkeypatch):
    # Fresh chunks, chunks over cached prefixes (long and 1-token ones), an empty chunk: the fast
    # paths against the general masked path and the float64 reference.
    shapes = [(29, 29), (300, 117), (65, 1), (12, 0), (130, 64), (5, 5)]
    case, q, cu = varlen_case(shapes, group, 16, 50 + group)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.2, 117)
    fast = torch_ops.paged_prefill(*args)
    masked_only(monkeypatch)
    general = torch_ops.paged_prefill(*args)
    torch.testing.assert_close(fast, general, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fast.double(), reference_prefill(case, q, cu.tolist(), 0.2), **TOL)


def test_prefill_split_in_bfloat16(monkeypatch):
    shapes = [(200, 70), (40, 40)]
    case, q, cu = varlen_case(shapes, 2, 8, 9)
    k_cache, v_cache, q = case.k_cache.bfloat16(), case.v_cache.bfloat16(), q.bfloat16()
    args = (q, k_cache, v_cache, case.block_tables, cu, case.context_lens, 0.2, 70)
    fast = torch_ops.paged_prefill(*args)
    masked_only(monkeypatch)
    torch.testing.assert_close(fast.float(), torch_ops.paged_prefill(*args).float(), atol=2e-2, rtol=2e-2)


def test_prefill_with_starts_on_some_rows(monkeypatch):
    # kv_starts given for the batch, all 0 on some rows: those take the fast paths (bit-identical to
    # no starts at all), the others the masked path from their starts.
    from tests.kernels.paged_cases import reference_with_starts

    shapes = [(90, 90), (120, 40), (70, 30), (50, 20)]  # a start lies in the cached prefix
    case, q, cu = varlen_case(shapes, 2, 16, 11)
    starts = torch.tensor([[0, 0], [30, 0], [0, 12], [0, 0]], dtype=torch.int32)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.2, 90)
    out = torch_ops.paged_prefill(*args, kv_starts=starts)
    bounds = cu.tolist()
    want = torch.cat([
        reference_with_starts(q[bounds[b]:bounds[b + 1]], case.keys[b], case.values[b], 0.2,
                              list(range(n - q_len, n)), starts[b].tolist())
        for b, (n, q_len) in enumerate(shapes)
    ])
    torch.testing.assert_close(out.double(), want, **TOL)
    plain = torch_ops.paged_prefill(*args)
    for b in (0, 3):  # rows whose starts are all 0
        rows = slice(bounds[b], bounds[b + 1])
        assert torch.equal(out[rows], plain[rows])
    masked_only(monkeypatch)
    torch.testing.assert_close(out, torch_ops.paged_prefill(*args, kv_starts=starts), atol=1e-6, rtol=1e-5)


def test_prefill_runs_the_cpu_flash_kernel():
    # 3-D inputs send SDPA to its math path (every score materialised, 2-3x slower on a 2K prompt);
    # the prefill must reach the flash kernel for fresh chunks and chunks over a prefix alike.
    from torch.profiler import profile

    case, q, cu = varlen_case([(256, 256), (512, 256)], 3, 16, 4)
    with profile() as prof:
        torch_ops.paged_prefill(q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.2, 256)
    names = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_rows_match_page_offsets(cache_dtype, padded):
    # Every (slot, head) lands at [page, head, offset] of a cache with more heads and longer pages,
    # with and without a padding slot (-1: the masked path; none: k and v are stored as they are).
    gen = fresh(12)
    num_pages, heads, page_size = 6, 3, 8
    k_cache = torch.zeros(num_pages, heads, page_size, HEAD_DIM, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:20]
    if padded:
        slots[3] = -1
    k = torch.randn(20, heads, HEAD_DIM, generator=gen)
    v = torch.randn(20, heads, HEAD_DIM, generator=gen)
    torch_ops.store_kv(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // page_size, :, slot % page_size], k[t].to(cache_dtype))
            assert torch.equal(v_cache[slot // page_size, :, slot % page_size], v[t].to(cache_dtype))
    assert int((k_cache.abs().sum(-1) > 0).sum()) == (19 if padded else 20) * heads


@pytest.mark.parametrize("with_starts", [False, True])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_by_row_equals_the_padded_batch(group, with_starts):
    # The CPU decode (each row over its own keys) against the batched, masked form the GPU runs,
    # over rows of very different lengths, an empty (padding) row, and per-head starts on some rows.
    gen = fresh(60 + group)
    lengths = [1, 97, 0, 16, 250]
    case = make_case(lengths, NUM_KV_HEADS, HEAD_DIM, 16, gen=gen)
    q = torch.randn(len(lengths), NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
    starts = torch.tensor([[0, 0], [40, 0], [0, 0], [0, 15], [0, 0]], dtype=torch.int32) if with_starts else None
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.3)
    padded = torch_ops._decode_padded(*args, 400, starts)
    out = torch.full_like(q, float("nan"))  # every row is written, the empty one with zeros
    by_row = torch_ops.paged_decode(*args, max_context_len=250, out=out, kv_starts=starts)
    assert by_row is out
    torch.testing.assert_close(by_row, padded, atol=1e-6, rtol=1e-5)
    assert torch.equal(by_row[2], torch.zeros_like(by_row[2]))
    if with_starts:
        assert not torch.allclose(by_row, torch_ops.paged_decode(*args), atol=1e-4)
