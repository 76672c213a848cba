"""The torch paged-attention ops (the CPU backend) against a dense float64 reference."""

from __future__ import annotations

import pytest
import torch

from kvc.runtime.attention import torch_ops
from tests.kernels.paged_cases import make_case, reference_decode, reference_prefill

HEAD_DIM = 16
NUM_KV_HEADS = 2
TOL = dict(atol=2e-5, rtol=1e-4)


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
