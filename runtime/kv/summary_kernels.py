"""Page summaries kept current on the GPU as a decode step stores its tokens (docs/design.md, "KV spec").

A decode step writes one token per sequence, into its sequence's newest page: the page's max, min,
sum or mean over its stored slots then follows from the old summary and the new slot alone
(a first slot starts the page over), exactly as `KVStore.refresh_summaries` would recompute it
from every slot. One launch per summary and layer instead of re-reducing the pages in a dozen
torch ops. Reads the slot back from the dense tensor the token was stored in, so the summary sees
the stored value (the cache's dtype). Triton is imported with this module: only the GPU path
loads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvc.runtime.primitives.pdl import gate as pdl_gate
from kvc.runtime.primitives.pdl import options as pdl_options

FNS = {"max": 0, "min": 1, "sum": 2, "mean": 3}


@triton.jit
def _append_kernel(slot_ptr, src_ptr, out_ptr, stride_sp, stride_sh, stride_ss, stride_op, stride_oh,
                   H, D, PAGE: tl.constexpr, FN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   PDL: tl.constexpr = False):
    pdl_gate(PDL)
    slot = tl.load(slot_ptr + tl.program_id(0)).to(tl.int64)
    if slot >= 0:
        page, offset = slot // PAGE, slot % PAGE
        hs, ds = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
        mask = (hs[:, None] < H) & (ds[None, :] < D)
        x = tl.load(src_ptr + page * stride_sp + hs[:, None] * stride_sh + offset * stride_ss + ds[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        at = out_ptr + page * stride_op + hs[:, None] * stride_oh + ds[None, :]
        old = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        if FN == 0:
            new = tl.maximum(old, x)
        elif FN == 1:
            new = tl.minimum(old, x)
        elif FN == 2:
            new = old + x
        else:
            new = (old * offset.to(tl.float32) + x) / (offset + 1).to(tl.float32)
        new = tl.where(offset == 0, x, new)
        tl.store(at, new.to(out_ptr.dtype.element_ty), mask=mask)


def append(summary: torch.Tensor, fn: str, source: torch.Tensor, slots: torch.Tensor) -> None:
    """Folds the slots `slots [T]` (-1: none; at most one per page) of the dense TOKEN tensor
    `source [pages + 1, Hkv, page, D]`, already stored, into the PAGE summary `summary [pages + 1,
    Hkv, D]` by `fn`. Static shapes, no host read: runs inside captured decode graphs."""
    if slots.numel() == 0:
        return
    heads, dim = source.shape[1], source.shape[-1]
    if source.stride(-1) != 1 or summary.stride(-1) != 1:
        raise ValueError("page summaries and their source need a contiguous last axis")
    _append_kernel[(slots.numel(),)](
        slots, source, summary, source.stride(0), source.stride(1), source.stride(2), summary.stride(0),
        summary.stride(1), heads, dim, PAGE=source.shape[2], FN=FNS[fn], BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim), num_warps=4 if heads * dim >= 1024 else 1, **pdl_options(summary.device),
    )
