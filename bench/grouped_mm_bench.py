"""torch._grouped_mm (CUTLASS) on expert-sorted contiguous rows, the MoE GEMMs alone, against the fused Triton
experts (runtime/models/moe_triton.py, gather, both GEMMs and the weighted sum) at prefill token counts;
Qwen3-30B-A3B's MoE shape, bf16, random top-8 routing. What a grouped-GEMM prefill path could gain
(docs/benchmarks.md, issue 23's MoE prefill). Needs a Hopper GPU.

    python bench/grouped_mm_bench.py --tokens 8192,32768
"""

from __future__ import annotations

import argparse

import torch

from kvc.runtime.models import moe_triton
from kvc.runtime.tuning.timing import time_ms

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8192,32768")
    a = p.parse_args()
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    for tokens in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device=cuda, dtype=bf16)
        gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=cuda, dtype=bf16) * 0.02
        down = torch.randn(EXPERTS, HIDDEN, INTER, device=cuda, dtype=bf16) * 0.02
        weights, ids = torch.rand(tokens, EXPERTS, device=cuda).topk(TOP_K, dim=1)
        ids, weights = ids.int().contiguous(), (weights / weights.sum(1, keepdim=True)).contiguous()
        offsets = torch.bincount(ids.flatten().long(), minlength=EXPERTS).cumsum(0).int()
        rows = torch.randn(tokens * TOP_K, HIDDEN, device=cuda, dtype=bf16)  # x's rows, sorted by expert
        inner = torch.randn(tokens * TOP_K, INTER, device=cuda, dtype=bf16)

        def gate_up_mm():
            return torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets)

        def down_mm():
            return torch._grouped_mm(inner, down.transpose(1, 2), offs=offsets)

        def fused():
            return moe_triton.fused_experts(x, gate_up, down, ids, weights)

        ms = {f.__name__: time_ms(f, cuda, 200) for f in (gate_up_mm, down_mm, fused)}
        flops = {"gate_up_mm": 4 * tokens * TOP_K * HIDDEN * INTER, "down_mm": 2 * tokens * TOP_K * INTER * HIDDEN}
        flops["fused"] = flops["gate_up_mm"] + flops["down_mm"]
        print(f"tokens {tokens}: " + ", ".join(f"{name} {t:.3f} ms {flops[name] / t / 1e9:.0f} TFLOP/s"
                                                for name, t in ms.items()))


if __name__ == "__main__":
    main()
