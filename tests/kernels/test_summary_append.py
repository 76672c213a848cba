"""A decode step's summary update on the GPU (`KVStore.append_summaries`, runtime/kv/summary_kernels.py)
equals recomputing the pages from their slots (`refresh_summaries`), step after step, for every
reducer, including a page started over by its first slot; padding slots (-1) touch nothing. On the
CPU the kernel runs under TRITON_INTERPRET."""

import pytest
import torch

from kvc.runtime.attention.backend import last_in_page
from kvc.runtime.kv.spec import Extent, Summary, TensorSpec, dense_spec
from kvc.runtime.kv.store import KVStore

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, HKV, D = 4, 2, 8


def store(dtype: torch.dtype) -> KVStore:
    fns = (("kmax", "k", "max", dtype), ("kmin", "k", "min", dtype), ("vsum", "v", "sum", torch.float32),
           ("vmean", "v", "mean", torch.float32))
    spec = dense_spec(D, dtype, extra=tuple(TensorSpec(n, Extent.PAGE, dt, (D,)) for n, _, _, dt in fns),
                      summaries=tuple(Summary(n, src, fn) for n, src, fn, _ in fns))
    return KVStore(spec, 6, HKV, PAGE, 1, DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_equals_refresh(dtype) -> None:
    appended, refreshed = store(dtype), store(dtype)
    assert appended.appends_summaries
    g = torch.Generator().manual_seed(1)
    pages = [[0, 3], [5, 1]]  # two sequences' page tables
    for step in range(2 * PAGE):  # both sequences decode one token a step, filling two pages each
        slots = torch.tensor([pages[0][step // PAGE] * PAGE + step % PAGE,
                              pages[1][step // PAGE] * PAGE + step % PAGE, -1], dtype=torch.long, device=DEV)
        k = torch.randn(3, HKV, D, generator=g).to(dtype).to(DEV)
        v = torch.randn(3, HKV, D, generator=g).to(dtype).to(DEV)
        for s in (appended, refreshed):
            ok = slots >= 0
            s["k"][slots[ok] // PAGE, :, slots[ok] % PAGE] = k[ok]
            s["v"][slots[ok] // PAGE, :, slots[ok] % PAGE] = v[ok]
        appended.append_summaries(slots)
        refreshed.refresh_summaries(*last_in_page(slots, PAGE, refreshed.scratch_page))
        for name in ("kmax", "kmin", "vsum", "vmean"):
            torch.testing.assert_close(appended[name].cpu(), refreshed[name].cpu(), rtol=1e-6, atol=1e-6,
                                       msg=f"{name} after step {step}")
    assert appended["kmax"][appended.scratch_page].abs().sum() == 0  # padding wrote nothing


def test_quantized_sources_are_refreshed_instead() -> None:
    from kvc.runtime.kv.spec import KVSpec, Quantized

    f32 = torch.float32
    spec = KVSpec((TensorSpec("kc", Extent.TOKEN, torch.uint8, (D,)), TensorSpec("ks", Extent.PAGE, f32, (1, D)),
                   TensorSpec("kr", Extent.SEQ, f32, (PAGE + 1, D)), TensorSpec("v", Extent.TOKEN, f32, (D,)),
                   TensorSpec("kmax", Extent.PAGE, f32, (D,))),
                  keys=Quantized("kc", "ks", 8, PAGE, axis="token", residual="kr", flush_block=PAGE),
                  summaries=(Summary("kmax", "k", "max"),))
    assert not KVStore(spec, 2, HKV, PAGE, 1, "cpu").appends_summaries
