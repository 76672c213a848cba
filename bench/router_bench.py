"""A decode step's router (Qwen3-30B-A3B: 128 experts, top 8, hidden 2048, bf16): the gate's GEMM (torch's linear)
then `router_triton.softmax_topk`, two launches, against `gate_softmax_topk`, one, at the decode batches of the
throughput tables. µs a call inside a CUDA graph of 48 calls (a step's layers, each its own gate), launch gaps
included; the routes are checked equal first (ids exactly; the fused sum's order may move a bf16 logit by one
unit, which the check reports).

    python bench/router_bench.py --out router.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kvc.runtime.bench.bandwidth import graph_ms
from kvc.runtime.models import router_triton

EXPERTS, TOP_K, HIDDEN, LAYERS = 128, 8, 2048, 48


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,18,160,276")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    gates = [torch.randn(EXPERTS, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    rows = []
    for t in [int(x) for x in a.tokens.split(",")]:
        x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16)
        two = [router_triton.softmax_topk(F.linear(x, w), TOP_K, True) for w in gates]
        one = [router_triton.gate_softmax_topk(x, w, TOP_K, True) for w in gates]
        same_ids = sum(torch.equal(a[0], b[0]) for a, b in zip(two, one))
        before = graph_ms(lambda: [router_triton.softmax_topk(F.linear(x, w), TOP_K, True) for w in gates], 1)
        after = graph_ms(lambda: [router_triton.gate_softmax_topk(x, w, TOP_K, True) for w in gates], 1)
        row = {"tokens": t, "gemm_then_route_us": before * 1e3 / LAYERS, "fused_us": after * 1e3 / LAYERS,
               "speedup": before / after, "layers_with_equal_ids": same_ids}
        rows.append(row)
        print(f"tokens={t}: GEMM + route {row['gemm_then_route_us']:.2f} us, fused {row['fused_us']:.2f} us "
              f"({row['speedup']:.2f}x); ids equal in {same_ids}/{LAYERS} layers")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
