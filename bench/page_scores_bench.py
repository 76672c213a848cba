"""The fused page-score kernel (compiler/templates/page_scores.py.jinja, Quest's bound) on a GPU:
time and bandwidth over the summary bytes it reads, per block size and warp count, at the
Qwen3-30B-A3B shape (32 query heads, 4 KV heads, head dim 128, bf16 summaries, pages of 16).
Usage: python bench/page_scores_bench.py [--out FILE.json]"""

from __future__ import annotations

import argparse
import json

import torch

from kvc.compiler.cache import locate
from kvc.runtime.compiled import folder
from kvc.runtime.compiled.folder import GeneratedCode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    compiled = locate("quest", generated=folder.GENERATED)
    kernel = GeneratedCode("quest", compiled.folder, compiled.manifest).fused("decode_before_attention")
    rows = []
    for batch, context in ((17, 32768), (4, 131072), (64, 32768)):
        heads, kv_heads, dim, page = 32, 4, 128, 16
        width = context // page
        pool = batch * width
        kmax = torch.randn(pool + 1, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        kmin = kmax - 1
        tables = torch.randperm(pool, device="cuda")[:batch * width].view(batch, width).to(torch.int32)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        nbytes = 2 * batch * kv_heads * width * dim * 2
        for block_p in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                fn = lambda: kernel(q, {"kmax": kmax, "kmin": kmin}, tables, lens, page, block_p=block_p,  # noqa: E731
                                    num_warps=warps)
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    fn()
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end) / 20
                rows.append({"batch": batch, "context": context, "block_p": block_p, "num_warps": warps, "ms": ms,
                             "GBps": nbytes / ms / 1e6})
                print(f"B={batch} ctx={context} block_p={block_p} warps={warps}: {ms:.3f} ms "
                      f"{nbytes / ms / 1e6:.0f} GB/s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
