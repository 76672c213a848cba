"""Prefill attention over a quantized KV cache: one sequence's last chunk (`--chunk` new tokens: 8192, `kvc bench
throughput`'s per-step token budget) attending to the earlier context as stored (codes, scales, a
residual window) and to itself as computed, through the generated `spec` kernel, against the `plain`
kernel over K/V in the model dtype at the same shape, one layer at the Qwen3-30B-A3B shape (the
stores of bench/quantized_decode_bench.py). A whole prompt's prefill attention is about the sum of
such chunks, so `vs_dense` is what quantized storage costs a prefill. Each timed as a CUDA graph of
20 calls; `--sweep` also times the kernel over launch knobs.

    python bench/quantized_prefill_bench.py --method kivi --contexts 32768,131072 --sweep --out kivi_prefill.json
    TRITON_INTERPRET=1 python bench/quantized_prefill_bench.py --method kivi --smoke     # CPU, tiny: proves it runs
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from quantized_decode_bench import DIM, HEADS, KV_HEADS, attention, time_ms  # bench/ is on the path

SWEEP = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
         for m, n, w, s in ((128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                            (128, 32, 4, 3), (128, 32, 8, 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="kivi")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU under TRITON_INTERPRET=1")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    device = torch.device("cpu" if a.smoke else "cuda")
    contexts = [96] if a.smoke else [int(c) for c in a.contexts.split(",")]
    chunk = 32 if a.smoke else a.chunk
    dtype = torch.bfloat16
    scale = 1 / math.sqrt(DIM)
    gen = torch.Generator(device=device).manual_seed(1)
    rows_out = []
    for context in contexts:
        q = torch.randn(chunk, HEADS, DIM, device=device, dtype=dtype, generator=gen)
        k_new, v_new = (torch.randn(chunk, KV_HEADS, DIM, device=device, dtype=dtype, generator=gen) for _ in range(2))
        cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
        times = {}
        for name in (None, a.method):
            att, k_src, v_src, tables, lens, _ = attention(name, 1, context, dtype, device)
            extra = {}
            if name is not None:
                windows = [s.residual.shape[-2] for s in (k_src, v_src) if not isinstance(s, torch.Tensor)
                           and s.residual is not None]
                extra = dict(k_new=k_new, v_new=v_new)
                if windows:
                    extra |= dict(rows=torch.zeros(1, dtype=torch.int32, device=device),
                                  resid_lens=torch.full((1,), windows[0] - 1, dtype=torch.int32, device=device))
            out = torch.empty_like(q)

            def run(**knobs):
                return att.ops.paged_prefill(q, k_src, v_src, tables, cu, lens, scale, chunk, out=out, **extra,
                                             **knobs)

            ms = time_ms(run, device)
            times[name] = ms
            flops = 4 * chunk * HEADS * DIM * (context - chunk / 2)
            row = {"piece": "prefill", "method": name or "dense", "context": context, "chunk": chunk, "ms": ms,
                   "TFLOPs": flops / ms / 1e9, "vs_dense": times[None] / ms}
            rows_out.append(row)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            if a.sweep and name is not None:
                for knobs in SWEEP:
                    try:
                        ms = time_ms(lambda: run(**knobs), device)
                    except Exception as e:  # a config that does not fit (shared memory): recorded, not fatal
                        row = {"piece": "sweep", "method": name, "context": context, **knobs,
                               "error": str(e).splitlines()[0][:160]}
                    else:
                        row = {"piece": "sweep", "method": name, "context": context, **knobs, "ms": ms,
                               "TFLOPs": flops / ms / 1e9, "vs_dense": times[None] / ms}
                    rows_out.append(row)
                    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                          flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
