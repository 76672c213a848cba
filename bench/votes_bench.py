"""A decode budget's window score (`triton_primitives.column_votes`) at a stacked evicting step's shape: SnapKV
every N tokens on Qwen3-30B-A3B (window 32, 8 query heads a KV head, head dim 128, bf16), G (row, layer, KV head)
groups of 2,176 stored keys each, read through page tables of 16-slot pages in random order and a slot order (a
layer evicted in place), as the engine's `PagedKeys`. Both passes (the softmax statistics, then the columns)
recompute QK^T, so a call is 2 x G x 256 x 2,176 x 128 x 2 FLOPs; the keys are read once a pass. Prints ms a call
(CUDA graph replays), TFLOP/s and the keys' bytes over the time, for the heuristic's launch and the knobs swept.

    python bench/votes_bench.py --groups 4096 --out votes.json
    git show REV:runtime/primitives/triton_primitives.py > /tmp/old.py
    python bench/votes_bench.py --primitives /tmp/old.py   # an earlier version of the kernels, same shapes
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvc.compiler.cache import import_file
from kvc.runtime.bench.bandwidth import copy_gbps, graph_ms
from kvc.runtime.primitives import triton_primitives
from kvc.runtime.primitives.paged_keys import PagedKeys

WINDOW, GROUP, KV_HEADS, DIM, PAGE = 32, 8, 4, 128, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4096, help="(row, layer, KV head) groups; rows = groups / 4")
    ap.add_argument("--keys", type=int, default=2176)
    ap.add_argument("--knobs", default="64:64:8,64:128:4,64:128:8,64:32:4",
                    help="block_q:block_k:num_warps settings to time beside the heuristic")
    ap.add_argument("--primitives", default=None, help="time this file's `column_votes` instead (another version "
                    "of runtime/primitives/triton_primitives.py)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    prims = import_file("votes_primitives", Path(a.primitives)) if a.primitives else triton_primitives
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows, keys = a.groups // KV_HEADS, a.keys
    width = -(-keys // PAGE)
    gen = torch.Generator(device=dev).manual_seed(0)
    pages = rows * width
    plane = torch.randn(pages + 1, KV_HEADS, PAGE, DIM, device=dev, dtype=dt, generator=gen)
    tables = torch.randperm(pages, device=dev, generator=gen).view(rows, width)
    order = torch.argsort(torch.rand(rows, KV_HEADS, keys, device=dev, generator=gen), dim=-1)
    paged = PagedKeys(plane, tables, order, keys, DIM)
    q = torch.randn(rows * KV_HEADS * GROUP, WINDOW, DIM, device=dev, dtype=dt, generator=gen)
    n_keys = keys - WINDOW
    flops = 2 * 2 * rows * KV_HEADS * GROUP * WINDOW * keys * DIM
    key_bytes = 2 * rows * KV_HEADS * keys * DIM * plane.element_size()  # read once by each pass
    copy = copy_gbps()["best"]
    want = prims.column_votes(q, paged, n_keys)
    results = {"groups": rows * KV_HEADS, "keys": keys, "copy_gbps": copy, "primitives": a.primitives or "this tree",
               "launches": []}
    settings = [None] + [tuple(int(x) for x in s.split(":")) for s in a.knobs.split(",") if s]
    for knobs in settings:
        kw = {} if knobs is None else dict(zip(("block_q", "block_k", "num_warps"), knobs))
        got = prims.column_votes(q, paged, n_keys, **kw)
        err = ((got - want).abs().max() / want.abs().max()).item()
        ms = graph_ms(lambda: prims.column_votes(q, paged, n_keys, **kw), 5)
        row = {"knobs": kw or "heuristic", "ms": ms, "tflops": flops / ms / 1e9,
               "keys_gbps": key_bytes / ms / 1e6, "of_copy": key_bytes / ms / 1e6 / copy, "max_rel_err": err}
        results["launches"].append(row)
        print(f"{str(row['knobs']):48s} {ms:8.3f} ms  {row['tflops']:6.1f} TFLOP/s  keys {row['keys_gbps']:7.0f} GB/s "
              f"({row['of_copy']:.2f} of copy)  rel err {err:.1e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
