"""The MoE expert alignment (runtime/models/moe_align.py) on its own: old vs new, per pair count.

    python bench/moe_align_bench.py                       # pairs 144, 512, 1280, 2048, 8192, 16384
    python bench/moe_align_bench.py --pairs 144,1280 --out align.json
    python bench/moe_bench.py --align ...                 # the same table inside the MoE bench
    python bench/moe_align_bench.py --device cpu          # tiny dry run, TRITON_INTERPRET=1

Qwen3-30B-A3B's routing shape (128 experts, top-8; tokens = pairs / 8, block_m from
`moe_triton.default_config`). For each pair count: microseconds per alignment of the parallel
kernel ("triton"), the previous single-program kernel ("single") and the torch sort ("torch");
"old auto" is what `align_by_expert("auto")` ran before the parallel kernel (single up to 1024
pairs, torch above), "new auto" what it runs now. On the GPU each time is one replay of a CUDA
graph holding CALLS alignments (rotating over routing sets) divided by CALLS: the per-layer cost
inside a captured decode step, launch gaps included, replay overhead amortised. "exact" says
whether the parallel kernel's tensors equal the torch path's on this GPU (the CPU tests check the
interpreter; this checks the compiled kernel).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

from kvc.runtime.tuning.timing import time_ms

PAIRS = [144, 512, 1280, 2048, 8192, 16384]  # decode at 18, 64, 160, 256, 1024 and 2048 tokens
CALLS = 16  # alignments per captured graph (a decode step runs one per MoE layer)
OLD_SINGLE_MAX_PAIRS = 1024  # the previous auto rule: the single-program kernel up to here
IMPLS = ("triton", "split", "single", "torch")


def routing_ids(tokens: int, num_experts: int, top_k: int, device: torch.device, count: int) -> list[torch.Tensor]:
    """Top-k of random logits, several sets (what the router produces; the kernels read ids only)."""
    return [torch.randn(tokens, num_experts, device=device).topk(top_k, dim=-1).indices for _ in range(count)]


def per_call_us(fn, id_sets: list[torch.Tensor], device: torch.device, rep_ms: int) -> tuple[float, bool]:
    """(microseconds per fn call, whether it was timed as a CUDA graph replay)."""
    if device.type == "cuda":
        try:
            for ids in id_sets:
                fn(ids)  # compile and settle allocations outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for ids in itertools.islice(itertools.cycle(id_sets), CALLS):
                    fn(ids)
            return 1e3 * time_ms(graph.replay, device, rep_ms) / CALLS, True
        except Exception:  # noqa: BLE001 - not capturable: time it eagerly instead
            torch.cuda.synchronize()
    rotate = itertools.cycle(id_sets)
    return 1e3 * time_ms(lambda: fn(next(rotate)), device, rep_ms), False


def bench_align(pair_counts: list[int], num_experts: int, top_k: int, device: torch.device,
                rep_ms: int = 100) -> list[dict]:
    from kvc.runtime.models import moe_align, moe_triton

    rows = []
    for pairs in pair_counts:
        tokens = max(1, pairs // top_k)
        block_m = moe_triton.default_config(tokens, top_k, num_experts, torch.bfloat16).block_m
        id_sets = routing_ids(tokens, num_experts, top_k, device, count=4)
        want = moe_align.align_by_expert(id_sets[0], num_experts, block_m, "torch")
        got = moe_align.align_by_expert(id_sets[0], num_experts, block_m, "triton")
        exact = all(torch.equal(getattr(got, f), getattr(want, f))
                    for f in ("sorted_pairs", "block_experts", "num_padded"))
        row = {"pairs": tokens * top_k, "tokens": tokens, "block_m": block_m, "exact": exact}
        for impl in IMPLS:
            us, graphed = per_call_us(
                lambda ids, impl=impl: moe_align.align_by_expert(ids, num_experts, block_m, impl),
                id_sets, device, rep_ms)
            row[f"{impl}_us"], row[f"{impl}_graph"] = us, graphed
        row["old_auto_us"] = row["single_us" if row["pairs"] <= OLD_SINGLE_MAX_PAIRS else "torch_us"]
        row["new_auto_us"] = row["triton_us" if row["pairs"] <= moe_align.ALIGN_ONE_LAUNCH_MAX_PAIRS else "split_us"]
        rows.append(row)
    return rows


def print_align(rows: list[dict]) -> None:
    print("expert alignment, us per call (g: inside a CUDA graph):")
    print(f"{'pairs':>6} {'tokens':>6} {'bm':>3} {'triton':>9} {'single':>9} {'torch':>9} "
          f"{'old auto':>9} {'new auto':>9} {'speedup':>7} exact")
    for r in rows:
        cells = " ".join(f"{r[f'{i}_us']:>8.1f}{'g' if r[f'{i}_graph'] else ' '}" for i in IMPLS)
        print(f"{r['pairs']:>6} {r['tokens']:>6} {r['block_m']:>3} {cells} {r['old_auto_us']:>9.1f} "
              f"{r['new_auto_us']:>9.1f} {r['old_auto_us'] / r['new_auto_us']:>7.2f} {r['exact']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--pairs", help="pair counts, comma separated (default 144,512,1280,2048,8192,16384)")
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu for a dry run of the script")
    cpu = device.type == "cpu"
    pairs = [int(v) for v in args.pairs.split(",")] if args.pairs else ([4, 16, 66] if cpu else PAIRS)
    experts, top_k = (8, 2) if cpu else (128, 8)
    rows = bench_align(pairs, experts, top_k, device, 5 if cpu else args.rep_ms)
    print_align(rows)
    if args.out:
        args.out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(device) if not cpu else "cpu (interpreter)",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
            "experts": experts, "top_k": top_k, "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
