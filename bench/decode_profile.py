"""One decode attention launch of a method's spec kernel (or the dense one), for a profiler:
the same inputs as bench/quantized_decode_bench.py (Qwen3-30B-A3B's attention shape, bf16, pages in
random order), run `--calls` times after a warm-up.

    ncu --clock-control none --kernel-name regex:split_kernel --launch-skip 3 --launch-count 1 \
        --set full -o kivi python bench/decode_profile.py --method kivi --shape 32x32768
"""

from __future__ import annotations

import argparse
import math

import torch
from quantized_decode_bench import DIM, HEADS, attention  # bench/ is on the path of a script run from it


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="kivi", help="a method name, or 'dense'")
    p.add_argument("--shape", default="32x32768", help="BATCHxCONTEXT")
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--knobs", default="", help="launch knobs, e.g. block_n=128,num_warps=4,num_splits=32")
    a = p.parse_args()
    batch, context = (int(x) for x in a.shape.split("x"))
    knobs = {k: int(v) for k, v in (kv.split("=") for kv in a.knobs.split(",") if kv)}
    device = torch.device("cuda")
    q = torch.randn(batch, HEADS, DIM, device=device, dtype=torch.bfloat16)
    att, k_src, v_src, tables, lens, read = attention(None if a.method == "dense" else a.method, batch, context,
                                                      torch.bfloat16, device)
    out = torch.empty_like(q)
    for _ in range(a.calls):
        att.ops.paged_decode(q, k_src, v_src, tables, lens, 1 / math.sqrt(DIM), max_context_len=context, out=out,
                             **knobs)
    torch.cuda.synchronize()
    print(f"{a.method} {a.shape}: {read / 1e6:.1f} MB read a call")


if __name__ == "__main__":
    main()
