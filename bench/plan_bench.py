"""The read plan's top-k (runtime/primitives/triton_plans.py): in one pass, in two (slices of 512-2,048 pages, then
their candidates' cut; `num_warps` is the second pass's), and as it was before its cut searched the keys' range in
quarters (one pass, a bisection: one count a pass; a same-run baseline kept here), per launch width (warps), at
Quest's shapes in the model: 4 KV heads, budget 4096 in pages of 16, page tables as wide as `max_model_len` gives
(128K + 2K output: 8,321 pages, a block of 16,384 lanes; 32K + 2K: 2,177 pages), scores as random normals and as a
model's (many pages near the cut). Each timed as a CUDA graph of 20 calls; the plans are checked equal first.

    python bench/plan_bench.py --out plan.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from kvc.runtime.bench.bandwidth import graph_ms
from kvc.runtime.primitives import triton_plans
from kvc.runtime.primitives.clusters_triton import _step
from kvc.runtime.primitives.triton_plans import _block_keys, _first_newest, _store_plan, _taken

KV_HEADS, PAGE, BUDGET = 4, 16, 4096


@triton.jit
def _bisect(key, valid, N_TOP):
    # the cut before 2026-12-06's quarter search: a bisection, one count (one cross-warp reduction) a pass
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    lo = tl.min(tl.where(valid, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(key, axis=0).to(tl.int64) + 1
    if n_valid > N_TOP:
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            lo, hi = _step(lo, hi, mid, tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0), N_TOP)
    return lo.to(tl.int32)


@triton.jit
def _before_kernel(scores_ptr, lengths_ptr, out_ptr, stride_sr, stride_sh, stride_or, stride_oh,
                   W, N_TOP, N_LAST, PAGE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr):
    # the one-pass plan kernel with the bisection cut
    r, h, cols = tl.program_id(0), tl.program_id(1), tl.arange(0, BLOCK_W)
    first_newest = _first_newest(lengths_ptr, r, N_LAST, PAGE)
    valid, key = _block_keys(scores_ptr + r * stride_sr + h * stride_sh, cols, W, first_newest)
    _store_plan(out_ptr + r * stride_or + h * stride_oh, cols, _taken(key, valid, _bisect(key, valid, N_TOP), N_TOP),
                first_newest, N_TOP, N_LAST, BLOCK_W, BLOCK_L)


def before(scores: torch.Tensor, lengths: torch.Tensor, num_warps: int) -> torch.Tensor:
    rows, kv_heads, width = scores.shape
    n_last, n_top = 1, BUDGET // PAGE - 1
    out = torch.empty(rows, kv_heads, n_top + n_last, dtype=torch.int32, device=scores.device)
    _before_kernel[(rows, kv_heads)](scores, lengths, out, scores.stride(0), scores.stride(1), out.stride(0),
                                     out.stride(1), width, n_top, n_last, PAGE=PAGE,
                                     BLOCK_W=triton.next_power_of_2(width), BLOCK_L=1, num_warps=num_warps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for batch, context, width in ((4, 131072, 8321), (4, 131072, 8192), (17, 32768, 2177)):
        lengths = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        normal = torch.randn(batch, KV_HEADS, width, device="cuda")
        for kind, scores in (("normal", normal), ("model", normal.abs().sqrt())):
            now = triton_plans.read_pages(scores, lengths, PAGE, count=BUDGET - PAGE, last=PAGE)
            was = before(scores, lengths, 16)
            assert torch.equal(now.sort(dim=-1).values, was.sort(dim=-1).values), "the plans differ"
            one = triton_plans.read_pages(scores, lengths, PAGE, count=BUDGET - PAGE, last=PAGE, slice_pages=0)
            assert torch.equal(now, one), "two passes and one differ"
            for warps in (8, 16, 32):
                row = {"batch": batch, "context": context, "width": width, "scores": kind, "num_warps": warps,
                       "before_us": 1e3 * graph_ms(lambda w=warps: before(scores, lengths, w)),
                       "one_pass_us": 1e3 * graph_ms(lambda w=warps: triton_plans.read_pages(
                           scores, lengths, PAGE, count=BUDGET - PAGE, last=PAGE, num_warps=w, slice_pages=0))}
                for slice_pages in (512, 1024, 2048):
                    row[f"slices{slice_pages}_us"] = 1e3 * graph_ms(lambda w=warps, sp=slice_pages: (
                        triton_plans.read_pages(scores, lengths, PAGE, count=BUDGET - PAGE, last=PAGE, num_warps=w,
                                                slice_pages=sp)))
                rows.append(row)
                print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
