"""Oracle 4: the Triton paged-attention kernels against the torch ops.

On a machine without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set
before the kernels are decorated), so the sizes stay small. Every output is poisoned with NaN
before the call, and unowned cache slots hold NaN, so an unwritten output or a stray read fails.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvc.runtime.attention import torch_ops
from tests.kernels.paged_cases import make_case, triton_device_and_ops

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
pytest.importorskip("triton")
DEVICE, triton_ops = triton_device_and_ops()

HEAD_DIM = 32
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
DTYPES = list(TOLERANCES)


def fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def torch_oracle(case):
    """The case's caches for the torch ops: same values, unowned (NaN) slots zeroed, float32."""
    return case.k_cache.nan_to_num(0.0).float(), case.v_cache.nan_to_num(0.0).float()


def randn(gen, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_torch(dtype):
    gen = fresh(1)
    num_pages, num_kv_heads, page_size = 6, 3, 4  # 3 heads: a non-power-of-two head block
    k_cache = randn(gen, num_pages, num_kv_heads, page_size, HEAD_DIM, dtype=dtype)
    v_cache = randn(gen, num_pages, num_kv_heads, page_size, HEAD_DIM, dtype=dtype)
    # k, v as strided views of a fused qkv-like buffer, as the model hands them over
    kv = randn(gen, 5, 2, num_kv_heads, HEAD_DIM, dtype=dtype)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([9, -1, 0, 23, 13], device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    torch_ops.store_kv(k, v, want_k, want_v, slots)
    triton_ops.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


DECODE_CASES = [
    # group, page_size, num_splits, use_dot
    (1, 16, 1, False),
    (1, 5, 3, True),
    (2, 4, 2, False),
    (4, 16, 4, True),
    (4, 3, 7, True),
    (8, 8, 1, True),
    (6, 5, 2, True),  # a group that is not a power of two
]


@pytest.mark.parametrize("group,page_size,num_splits,use_dot", DECODE_CASES)
def test_decode_matches_torch(group, page_size, num_splits, use_dot):
    gen = fresh(10 * group + page_size + num_splits)
    num_kv_heads = 2
    lengths = [1, 0, 53, 16, 130]  # 0 = padding row; 53 spans a partial last tile and page
    case = make_case(lengths, num_kv_heads, HEAD_DIM, page_size, gen=gen, device=DEVICE, stale=float("nan"))
    q = randn(gen, len(lengths), num_kv_heads * group, HEAD_DIM)
    out = poisoned(q.shape, q.dtype)
    triton_ops.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.3,
                            max_context_len=max(lengths), out=out,
                            num_splits=num_splits, block_n=16, use_dot=use_dot)
    want = torch_ops.paged_decode(q, *torch_oracle(case), case.block_tables, case.context_lens, 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_dtypes_and_default_config(dtype):
    gen = fresh(99)
    group, num_kv_heads = 4, 2
    lengths = [70, 3, 0]
    case = make_case(lengths, num_kv_heads, HEAD_DIM, 16, gen=gen, dtype=dtype, device=DEVICE, stale=float("nan"))
    q = randn(gen, len(lengths), num_kv_heads * group, HEAD_DIM, dtype=dtype)
    out = poisoned(q.shape, dtype)
    # A loose bound, as under CUDA graphs: the heuristic's split layout must still be exact.
    triton_ops.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25,
                            max_context_len=4096, out=out)
    want = torch_ops.paged_decode(q.float(), *torch_oracle(case), case.block_tables, case.context_lens, 0.25)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), want, **TOLERANCES[dtype])


def test_decode_split_heuristic_fills_the_gpu():
    h200 = 132
    many = triton_ops.decode_num_splits(1, 8, 131072, h200)
    few = triton_ops.decode_num_splits(64, 8, 8192, h200)
    assert many >= 32 and few == 1
    assert triton_ops.decode_num_splits(32, 8, 32768, h200) > 1
    assert triton_ops.decode_num_splits(1, 8, 300, h200) <= 2  # short contexts: few splits
    assert 1 <= triton_ops.decode_num_splits(0, 8, 0, h200) <= triton_ops.MAX_SPLITS


PREFILL_CASES = [
    # group, page_size, block_m, block_n
    (1, 16, 16, 16),
    (2, 5, 32, 16),
    (4, 3, 16, 32),
    (8, 16, 64, 16),
    (3, 7, 16, 16),  # a group that is not a power of two
]


def prefill_batch(gen, group, page_size, dtype=torch.float32):
    num_kv_heads = 2
    # (context after the step, new tokens): a fresh prompt, chunks over cached prefixes (one
    # mid-page), a single new token, a sequence idle this step.
    shapes = [(21, 21), (50, 17), (35, 1), (12, 0), (40, 34)]
    lengths = [n for n, _ in shapes]
    cu = [0]
    for _, q_len in shapes:
        cu.append(cu[-1] + q_len)
    case = make_case(lengths, num_kv_heads, HEAD_DIM, page_size, gen=gen, dtype=dtype, device=DEVICE,
                     stale=float("nan"))
    q = randn(gen, cu[-1], num_kv_heads * group, HEAD_DIM, dtype=dtype)
    return case, q, torch.tensor(cu, dtype=torch.int32, device=DEVICE), max(q_len for _, q_len in shapes)


@pytest.mark.parametrize("group,page_size,block_m,block_n", PREFILL_CASES)
def test_prefill_matches_torch(group, page_size, block_m, block_n):
    gen = fresh(1000 + 10 * group + page_size)
    case, q, cu, max_q = prefill_batch(gen, group, page_size)
    out = poisoned(q.shape, q.dtype)
    triton_ops.paged_prefill(q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.2,
                             max_q, out=out, block_m=block_m, block_n=block_n)
    want = torch_ops.paged_prefill(q, *torch_oracle(case), case.block_tables, cu, case.context_lens, 0.2, max_q)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_dtypes_and_default_config(dtype):
    gen = fresh(5)
    case, q, cu, max_q = prefill_batch(gen, 4, 16, dtype)
    out = poisoned(q.shape, dtype)
    triton_ops.paged_prefill(q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.2,
                             max_q, out=out)
    want = torch_ops.paged_prefill(q.float(), *torch_oracle(case), case.block_tables, cu,
                                   case.context_lens, 0.2, max_q)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), want, **TOLERANCES[dtype])
