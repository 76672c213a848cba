"""Quest's decode pieces on a GPU, one layer at the Qwen3-30B-A3B shape (32 query heads, 4 KV heads,
head dim 128, bf16, pages of 16, budget 4096): the page scores, the plan (Triton top-k against
torch's), the sparse paged decode over the plan (per split count, tile and warps) and the summary
update of a decode step. Each timed as a CUDA graph of 20 calls; bandwidth counts the bytes a piece
must read (scores: the summaries; decode: the planned pages' K and V). Copy bandwidth of the same
GPU is measured in the same run as the baseline.
Usage: python bench/sparse_decode_bench.py [--out FILE.json] [--sweep]"""

from __future__ import annotations

import argparse
import json
import math

import torch

from kvc.compiler.cache import locate
from kvc.runtime.attention import triton_ops
from kvc.runtime.bench.bandwidth import copy_gbps, graph_ms
from kvc.runtime.compiled import folder
from kvc.runtime.compiled.folder import GeneratedCode
from kvc.runtime.kv import summary_kernels
from kvc.runtime.kv.plans import ReadPlan
from kvc.runtime.primitives import torch_primitives, triton_plans

HEADS, KV_HEADS, DIM, PAGE, BUDGET = 32, 4, 128, 16, 4096


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    compiled = locate("quest", generated=folder.GENERATED)
    scores_kernel = GeneratedCode("quest", compiled.folder, compiled.manifest).fused("decode_before_attention")
    spec = triton_ops.load("spec")
    rows = []

    def report(**row):
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    copies = copy_gbps()
    copy_bw = copies["best"]  # read + write, GB/s
    report(piece="copy", GBps=copy_bw, **{f"{k}_GBps": v for k, v in copies.items() if k != "best"})
    for batch, context in ((4, 131072), (17, 32768)):
        width = context // PAGE
        pool = batch * width
        k_cache = torch.randn(pool + 1, KV_HEADS, PAGE, DIM, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        kmax, kmin = k_cache.amax(dim=2), k_cache.amin(dim=2)
        tables = torch.randperm(pool, device="cuda")[:batch * width].view(batch, width).to(torch.int32)
        q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        summary_bytes = 2 * batch * KV_HEADS * width * DIM * 2
        scores = scores_kernel(q, {"kmax": kmax, "kmin": kmin}, tables, lens, PAGE)
        ms = graph_ms(lambda: scores_kernel(q, {"kmax": kmax, "kmin": kmin}, tables, lens, PAGE, out=scores))
        report(piece="page_scores", batch=batch, context=context, ms=ms, GBps=summary_bytes / ms / 1e6,
               of_copy=summary_bytes / ms / 1e6 / copy_bw)
        if a.sweep:
            for block_p in (16, 32, 64, 128):
                for warps in (2, 4, 8):
                    ms = graph_ms(lambda bp=block_p, w=warps: scores_kernel(
                        q, {"kmax": kmax, "kmin": kmin}, tables, lens, PAGE, out=scores, block_p=bp, num_warps=w))
                    report(piece="page_scores_sweep", batch=batch, context=context, block_p=block_p, num_warps=warps,
                           ms=ms, GBps=summary_bytes / ms / 1e6)
        for name, fn in (("plan_triton", triton_plans.read_pages), ("plan_torch", torch_primitives.read_pages)):
            ms = graph_ms(lambda fn=fn: fn(scores, lens, PAGE, count=BUDGET - PAGE, last=PAGE))
            report(piece=name, batch=batch, context=context, ms=ms)
        if a.sweep:
            for warps in (2, 4, 8, 16, 32):
                ms = graph_ms(lambda w=warps: triton_plans.read_pages(scores, lens, PAGE, count=BUDGET - PAGE,
                                                                      last=PAGE, num_warps=w))
                report(piece="plan_triton_sweep", batch=batch, context=context, num_warps=warps, ms=ms)
            # scores as a model gives them: many pages near the cut, no early stop of the bisection
            ranked = torch.randn_like(scores).abs().sqrt()
            ms = graph_ms(lambda: triton_plans.read_pages(ranked, lens, PAGE, count=BUDGET - PAGE, last=PAGE))
            report(piece="plan_triton_dense_scores", batch=batch, context=context, ms=ms)
        plan = triton_plans.read_pages(scores, lens, PAGE, count=BUDGET - PAGE, last=PAGE)
        read = ReadPlan(pages=plan)
        read_bytes = 2 * batch * KV_HEADS * plan.shape[-1] * PAGE * DIM * 2
        out = torch.empty_like(q)
        scale = 1 / math.sqrt(DIM)
        default = graph_ms(lambda: spec.paged_decode(q, k_cache, v_cache, tables, lens, scale, read=read, out=out))
        report(piece="sparse_decode", batch=batch, context=context, config="default", ms=default,
               GBps=read_bytes / default / 1e6, of_copy=read_bytes / default / 1e6 / copy_bw)
        both = (summary_bytes + read_bytes) / copy_bw / 1e6  # ms at copy bandwidth
        if a.sweep:
            best = (default, "default")
            for splits in (8, 16, 32, 64):
                for block_n in (16, 32, 64):
                    for warps in (4, 8):
                        for stages in (1, 2):
                            kw = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
                            try:
                                ms = graph_ms(lambda kw=kw: spec.paged_decode(q, k_cache, v_cache, tables, lens, scale,
                                                                              read=read, out=out, **kw))
                            except Exception as e:  # a config the GPU cannot run (shared memory)
                                print("skip", kw, type(e).__name__, flush=True)
                                continue
                            if ms < best[0]:
                                best = (ms, kw)
            report(piece="sparse_decode_best", batch=batch, context=context, config=str(best[1]), ms=best[0],
                   GBps=read_bytes / best[0] / 1e6, of_copy=read_bytes / best[0] / 1e6 / copy_bw)
        report(piece="scores_plus_decode_at_copy_bw", batch=batch, context=context, ms=both)
        new_slots = (tables[:, -1].long() * PAGE + 5)
        for fn_name, summ in (("max", kmax), ("min", kmin)):
            ms = graph_ms(lambda summ=summ, fn_name=fn_name: summary_kernels.append(summ, fn_name, k_cache, new_slots))
            report(piece=f"summary_append_{fn_name}", batch=batch, context=context, ms=ms)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
