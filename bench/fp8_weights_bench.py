"""FP8 weights against bf16 weights, one layer's GEMMs at a time, on the GPU: the dense linear
(runtime/models/fp8_triton.py `linear` against cuBLAS's `F.linear`) and the routed experts
(runtime/models/moe_triton.py `fused_experts` with and without block scales), at Qwen3-30B-A3B's shapes
(qkv 2048 -> 5120, o 4096 -> 2048; 128 experts, top-8, 2048 x 768) and the published block format
(e4m3 codes, one float32 scale a row per 128 columns).

    python bench/fp8_weights_bench.py --out fp8.json                 # tokens 1, 18, 160, 8192
    python bench/fp8_weights_bench.py --sweep --out fp8.json         # + the dense kernel's launch grid
    python bench/fp8_weights_bench.py --device cpu                   # tiny dry run, TRITON_INTERPRET=1

Per shape and token count: median ms of each path (up to 256 tokens as CUDA graph replays, as decode runs
them), the weight bytes each path must read over its time (FP8: one byte a weight plus its scales) and
that as a fraction of the same run's copy bandwidth (`runtime/bench/bandwidth.copy_gbps`, its best way),
TFLOP/s, and the FP8 path's error against a float32 product with the dequantized weights (the bf16 path's
in the same units beside it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kvc.runtime.bench.bandwidth import copy_gbps
from kvc.runtime.tuning.timing import time_ms as _time_ms

DENSE = {"qkv": (5120, 2048), "o": (2048, 4096)}  # (out, in) of Qwen3-30B-A3B's attention projections
EXPERTS = dict(num_experts=128, top_k=8, hidden=2048, inter=768)
TINY_DENSE = {"qkv": (96, 64), "o": (64, 128)}
TINY_EXPERTS = dict(num_experts=8, top_k=2, hidden=256, inter=128)
BLOCK = 128  # the published format's scale block (rows x columns)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tokens", help="token counts, comma separated (default 1,18,160,8192; cpu 1,5)")
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--sweep", action="store_true", help="also time the dense kernel's launch grid")
    p.add_argument("--out", type=Path)
    return p.parse_args()


def quantized(out_rows: int, columns: int, lead: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes [*lead, out, in] and row scales [*lead, out, ceil(in / BLOCK)] (each BLOCK rows share
    one, as the published format's 128 x 128 blocks do once expanded), sized like a trained layer's."""
    codes = (torch.randn(*lead, out_rows, columns, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = torch.rand(*lead, -(-out_rows // BLOCK), -(-columns // BLOCK), device=device) * 2e-4 + 1e-4
    return codes, blocks.repeat_interleave(BLOCK, dim=-2)[..., :out_rows, :].contiguous()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def timed(fn, device, rep_ms: int, graph: bool) -> float:
    """Median ms of fn: plain launches, or one CUDA graph of it replayed (decode's way)."""
    if graph and device.type == "cuda":
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return _time_ms(g.replay, device, rep_ms, min_warmup=10)
    return _time_ms(fn, device, rep_ms, min_warmup=10)


def figures(ms: float, weight_bytes: float, flops: float, copy: float | None) -> dict:
    row = {"ms": ms, "weight_gbps": weight_bytes / (ms * 1e-3) / 1e9, "tflops": flops / (ms * 1e-3) / 1e12}
    if copy:
        row["of_copy"] = row["weight_gbps"] / copy
    return row


def dense(name: str, n: int, k: int, tokens: int, args, device, copy) -> dict:
    from kvc.runtime.models import fp8_triton
    from kvc.runtime.models.fp8_weights import dequantize

    codes, scales = quantized(n, k, (), device)
    weight = dequantize(codes, scales, BLOCK, torch.bfloat16)
    sets = [torch.randn(tokens, k, device=device, dtype=torch.bfloat16) for _ in range(4 if tokens <= 256 else 1)]
    xs = itertools.cycle(sets)
    x = sets[0]
    exact = x.float() @ dequantize(codes, scales, BLOCK).T
    graph = tokens <= 256
    flops = 2 * tokens * n * k
    row = {"layer": name, "n": n, "k": k, "tokens": tokens,
           "fp8_rel_err": rel_err(fp8_triton.linear(x, codes, scales, BLOCK), exact),
           "bf16_rel_err": rel_err(F.linear(x, weight), exact)}
    row["bf16"] = figures(timed(lambda: F.linear(next(xs), weight), device, args.rep_ms, graph), n * k * 2, flops, copy)
    fp8_bytes = n * k + scales.numel() * 4
    row["fp8"] = figures(timed(lambda: fp8_triton.linear(next(xs), codes, scales, BLOCK), device, args.rep_ms, graph),
                         fp8_bytes, flops, copy)
    row["fp8_over_bf16"] = row["bf16"]["ms"] / row["fp8"]["ms"]
    if args.sweep and device.type == "cuda":
        grid = []
        for bn, bk, warps, stages in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4, 5)):
            def launch(bn=bn, bk=bk, warps=warps, stages=stages):
                return fp8_triton.linear(next(xs), codes, scales, BLOCK, block_n=bn, block_k=bk, num_warps=warps,
                                         num_stages=stages)
            try:
                grid.append({"block_n": bn, "block_k": bk, "warps": warps, "stages": stages,
                             **figures(timed(launch, device, args.rep_ms // 4, graph), fp8_bytes, flops, copy)})
            except Exception as err:  # noqa: BLE001 - a launch the GPU refuses is a result
                torch.cuda.synchronize()
                grid.append({"block_n": bn, "block_k": bk, "warps": warps, "stages": stages,
                             "error": f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"})
        row["sweep"] = sorted(grid, key=lambda r: r.get("ms") or float("inf"))[:8]
    return row


def experts(tokens: int, shape: dict, args, device, copy) -> dict:
    from kvc.runtime.models import moe_triton
    from kvc.runtime.models.fp8_weights import dequantize

    e, top_k, h, i = shape["num_experts"], shape["top_k"], shape["hidden"], shape["inter"]
    gu_codes, gu_scales = quantized(2 * i, h, (e,), device)
    dn_codes, dn_scales = quantized(h, i, (e,), device)
    gate_up = dequantize(gu_codes, gu_scales, BLOCK, torch.bfloat16)
    down = dequantize(dn_codes, dn_scales, BLOCK, torch.bfloat16)
    sets = []
    for _ in range(8 if tokens <= 256 else 1):
        weights, ids = torch.softmax(torch.randn(tokens, e, device=device), -1).topk(top_k, dim=-1)
        sets.append((torch.randn(tokens, h, device=device, dtype=torch.bfloat16), ids,
                     (weights / weights.sum(-1, keepdim=True)).contiguous()))
    touched = sum(int(torch.unique(s[1]).numel()) for s in sets) / len(sets)
    rotate = itertools.cycle(sets)
    graph = tokens <= 256
    flops = 6 * tokens * top_k * h * i

    def bf16(s):
        return moe_triton.fused_experts(s[0], gate_up, down, s[1], s[2])

    def fp8(s):
        return moe_triton.fused_experts(s[0], gu_codes, dn_codes, s[1], s[2], scales=(gu_scales, dn_scales),
                                        scale_columns=BLOCK)

    per_expert = 3 * h * i
    row = {"tokens": tokens, "experts_touched": touched, "fp8_rel_err_vs_bf16_weights": rel_err(fp8(sets[0]),
                                                                                                bf16(sets[0]))}
    row["bf16"] = figures(timed(lambda: bf16(next(rotate)), device, args.rep_ms, graph), touched * per_expert * 2,
                          flops, copy)
    scale_bytes = (gu_scales[0].numel() + dn_scales[0].numel()) * 4
    row["fp8"] = figures(timed(lambda: fp8(next(rotate)), device, args.rep_ms, graph),
                         touched * (per_expert + scale_bytes), flops, copy)
    row["fp8_over_bf16"] = row["bf16"]["ms"] / row["fp8"]["ms"]
    return row


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device(args.device)
    tokens = [int(t) for t in (args.tokens or ("1,5" if args.device == "cpu" else "1,18,160,8192")).split(",")]
    shapes, expert_shape = (TINY_DENSE, TINY_EXPERTS) if args.device == "cpu" else (DENSE, EXPERTS)
    if args.device == "cpu":
        args.rep_ms = min(args.rep_ms, 5)
    copy = copy_gbps()["best"] if device.type == "cuda" else None  # the decode benches' baseline
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "copy_gbps": copy, "dense": [], "experts": []}
    for t in tokens:
        for name, (n, k) in shapes.items():
            result["dense"].append(dense(name, n, k, t, args, device, copy))
        result["experts"].append(experts(t, expert_shape, args, device, copy))
    print(f"{result['device']}, copy {copy or 0:.0f} GB/s")
    print("| layer | tokens | bf16 ms (of copy) | FP8 ms (of copy) | FP8 speed-up | FP8 rel err (bf16's) |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = [(r["layer"], r) for r in result["dense"]] + [("experts", r) for r in result["experts"]]
    for name, r in sorted(rows, key=lambda nr: nr[1]["tokens"]):
        err = (f"{r['fp8_rel_err']:.1e} ({r['bf16_rel_err']:.1e})" if "fp8_rel_err" in r
               else f"{r['fp8_rel_err_vs_bf16_weights']:.1e} vs bf16 weights")
        print(f"| {name} | {r['tokens']} | {r['bf16']['ms']:.4f} ({r['bf16'].get('of_copy', 0):.2f}) | "
              f"{r['fp8']['ms']:.4f} ({r['fp8'].get('of_copy', 0):.2f}) | {r['fp8_over_bf16']:.2f}x | {err} |")
        for s in r.get("sweep", [])[:3]:
            print(f"|   sweep bn {s['block_n']} bk {s['block_k']} w{s['warps']} s{s['stages']} | | | "
                  f"{s.get('ms', float('nan')):.4f} ({s.get('of_copy', 0):.2f}) | | |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
