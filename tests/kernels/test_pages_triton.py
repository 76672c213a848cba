"""One row's cache pages gathered head-major in one launch (runtime/primitives/pages_triton.py) against the
torch path of `torch_ops.gather_kv` (select the pages, then lay them out head-major), bit for bit: pages out
of order and repeated, a page block that is not a power of two, a layer cache that is a slice of a larger
pool, FP8 codes. Under TRITON_INTERPRET=1 without a GPU (tests/conftest.py sets it)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from kvc.runtime.attention import torch_ops  # noqa: E402
from kvc.runtime.primitives import pages_triton  # noqa: E402


def torch_gather(cache, ids):
    pages = cache.index_select(0, ids.long())  # [n, Hkv, S, D]
    return pages.transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("page_size,dim", [(16, 8), (4, 12)])
def test_gather_equals_the_torch_path_bit_for_bit(dtype, page_size, dim):
    g = torch.Generator().manual_seed(page_size * dim)
    pool = torch.randn(3, 20, 3, page_size, dim, generator=g).to(dtype).to(DEVICE)
    cache = pool[1]  # one layer of a larger pool: page stride over the layer's own pages
    ids = torch.tensor([7, 2, 19, 2, 0, 11], dtype=torch.int32, device=DEVICE)
    assert pages_triton.fits(cache, ids)
    got = pages_triton.gather(cache, ids)
    want = torch_gather(cache, ids)
    assert got.shape == (3, 6 * page_size, dim)
    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_gather_kv_takes_the_kernel_on_cuda_only_where_it_fits():
    cache = torch.randn(10, 2, 4, 8, device=DEVICE)
    ids = torch.tensor([3, 1, 4], device=DEVICE)
    want = torch_gather(cache, ids)[:, :10]
    torch.testing.assert_close(torch_ops.gather_kv(cache, ids, 10), want, rtol=0, atol=0)
    assert pages_triton.fits(cache, ids)
    assert not pages_triton.fits(cache, ids[None])  # a batch of tables: the torch path
    assert not pages_triton.fits(cache.transpose(2, 3), ids)  # a page block that is not contiguous
    assert pages_triton.gather(cache, ids[:0]).shape == (2, 0, 8)
