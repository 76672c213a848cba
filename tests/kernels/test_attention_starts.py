"""Per-KV-head start slots (`kv_starts`, per-head variable counts stored right-aligned):
the torch ops against a dense float64 reference, all-zero starts bit-for-bit equal to no starts,
and the Triton kernels against the torch ops (TRITON_INTERPRET=1 without a GPU).

The slots a head does not use (before its start) hold NaN, so a kernel that reads one fails.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvc.runtime.attention import torch_ops
from tests.kernels.paged_cases import (
    make_case,
    poison_before_starts,
    random_starts,
    reference_with_starts,
)

HEAD_DIM = 16
NUM_KV_HEADS = 3  # odd: a non-power-of-two head count
TOL = dict(atol=2e-5, rtol=1e-4)


def fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def decode_case(group: int, page_size: int, seed: int, device="cpu"):
    gen = fresh(seed)
    lengths = [1, 0, 53, 16, 130]  # 0 = padding row
    case = make_case(lengths, NUM_KV_HEADS, HEAD_DIM, page_size, gen=gen, device=device)
    starts = random_starts(case, NUM_KV_HEADS, gen)
    q = torch.randn(len(lengths), NUM_KV_HEADS * group, HEAD_DIM, generator=gen).to(device)
    want = torch.cat([
        reference_with_starts(q[b : b + 1], case.keys[b], case.values[b], 0.3, [n - 1], starts[b].tolist())
        for b, n in enumerate(lengths)
    ])
    return case, starts, q, want


def prefill_case(group: int, page_size: int, seed: int, device="cpu"):
    gen = fresh(seed)
    # (context after the step, new tokens): over a compacted prefix (starts > 0), a fresh chunk,
    # a single token, an idle sequence
    shapes = [(50, 17), (21, 21), (35, 1), (12, 0), (40, 34)]
    lengths = [n for n, _ in shapes]
    cu = [0]
    for _, q_len in shapes:
        cu.append(cu[-1] + q_len)
    case = make_case(lengths, NUM_KV_HEADS, HEAD_DIM, page_size, gen=gen, device=device)
    # every new token sits past its head's start (they are appended at the common slots)
    starts = random_starts(case, NUM_KV_HEADS, gen, keep_last=[max(q_len, 1) for _, q_len in shapes])
    q = torch.randn(cu[-1], NUM_KV_HEADS * group, HEAD_DIM, generator=gen).to(device)
    want = torch.cat([
        reference_with_starts(q[cu[b] : cu[b + 1]], case.keys[b], case.values[b], 0.2,
                              list(range(n - q_len, n)), starts[b].tolist())
        for b, (n, q_len) in enumerate(shapes)
    ])
    return case, starts, q, torch.tensor(cu, dtype=torch.int32, device=device), max(s for _, s in shapes), want


# ---- torch ----------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_torch_decode_with_starts(group, page_size):
    case, starts, q, want = decode_case(group, page_size, 10 * group + page_size)
    out = torch_ops.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.3,
                                 max_context_len=130, kv_starts=starts)
    torch.testing.assert_close(out.double(), want, **TOL)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_torch_prefill_with_starts(group, page_size):
    case, starts, q, cu, max_q, want = prefill_case(group, page_size, 100 + 10 * group + page_size)
    out = torch_ops.paged_prefill(q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.2,
                                  max_q, kv_starts=starts)
    torch.testing.assert_close(out.double(), want, **TOL)


def test_torch_starts_change_the_answer():
    """Not a no-op: the same case without its starts attends over the unused slots too."""
    case, starts, q, want = decode_case(2, 5, 3)
    out = torch_ops.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.3)
    assert (starts > 0).any() and not torch.allclose(out.double(), want, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_zero_starts_are_bit_identical(dtype):
    case, _, q, _ = decode_case(4, 5, 7)
    k_cache, v_cache, q = case.k_cache.to(dtype), case.v_cache.to(dtype), q.to(dtype)
    zeros = torch.zeros((q.shape[0], NUM_KV_HEADS), dtype=torch.int32)
    args = (q, k_cache, v_cache, case.block_tables, case.context_lens, 0.3)
    assert torch.equal(torch_ops.paged_decode(*args, max_context_len=130),
                       torch_ops.paged_decode(*args, max_context_len=130, kv_starts=zeros))
    case, _, q, cu, max_q, _ = prefill_case(4, 5, 8)
    k_cache, v_cache, q = case.k_cache.to(dtype), case.v_cache.to(dtype), q.to(dtype)
    zeros = torch.zeros((len(case.keys), NUM_KV_HEADS), dtype=torch.int32)
    args = (q, k_cache, v_cache, case.block_tables, cu, case.context_lens, 0.2, max_q)
    assert torch.equal(torch_ops.paged_prefill(*args), torch_ops.paged_prefill(*args, kv_starts=zeros))


# ---- Triton vs torch ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton_env():
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    return triton_device_and_ops()


def _on(device, case, *tensors):
    moved = [t.to(device) for t in (case.k_cache, case.v_cache, case.block_tables, case.context_lens)]
    return moved + [t.to(device) for t in tensors]


@pytest.mark.parametrize("group,page_size,num_splits,use_dot", [
    (1, 16, 1, False),
    (2, 5, 3, True),
    (4, 3, 7, True),
    (3, 7, 2, True),  # a group that is not a power of two
])
def test_triton_decode_with_starts(triton_env, group, page_size, num_splits, use_dot):
    device, triton_ops = triton_env
    case, starts, q, _ = decode_case(group, page_size, 20 * group + num_splits)
    want = torch_ops.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.3,
                                  kv_starts=starts)
    poison_before_starts(case, starts)
    k_cache, v_cache, tables, lens, q_dev, starts_dev = _on(device, case, q, starts)
    out = torch.full_like(q_dev, float("nan"))
    triton_ops.paged_decode(q_dev, k_cache, v_cache, tables, lens, 0.3, max_context_len=130, out=out,
                            kv_starts=starts_dev, num_splits=num_splits, block_n=16, use_dot=use_dot)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("group,page_size,block_m,block_n", [
    (1, 16, 16, 16),
    (2, 5, 32, 16),
    (4, 3, 16, 32),
    (3, 7, 16, 16),
])
def test_triton_prefill_with_starts(triton_env, group, page_size, block_m, block_n):
    device, triton_ops = triton_env
    case, starts, q, cu, max_q, _ = prefill_case(group, page_size, 200 + 10 * group + page_size)
    want = torch_ops.paged_prefill(q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.2,
                                   max_q, kv_starts=starts)
    poison_before_starts(case, starts)
    k_cache, v_cache, tables, lens, q_dev, cu_dev, starts_dev = _on(device, case, q, cu, starts)
    out = torch.full_like(q_dev, float("nan"))
    triton_ops.paged_prefill(q_dev, k_cache, v_cache, tables, cu_dev, lens, 0.2, max_q, out=out,
                             kv_starts=starts_dev, block_m=block_m, block_n=block_n)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-4)


def test_triton_rejects_misshapen_starts(triton_env):
    device, triton_ops = triton_env
    case, starts, q, _ = decode_case(2, 5, 1)
    k_cache, v_cache, tables, lens, q_dev, starts_dev = _on(device, case, q, starts)
    with pytest.raises(ValueError, match="kv_starts"):
        triton_ops.paged_decode(q_dev, k_cache, v_cache, tables, lens, 0.3, kv_starts=starts_dev[:, :1])
