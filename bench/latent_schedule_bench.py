"""MLA latent decode under two schedules, GLM-4.7-Flash's shape (20 heads over one latent head of 512 + 64 RoPE
channels, bf16, pages of 16), uniform and ragged batches, against a device-to-device copy in the same run:
- `split` (the default): every sequence's context in the same number of splits (a program each), so a ragged
  batch's short rows leave SMs idle;
- `balanced`: P programs (one an SM) share the batch's tiles evenly, each range cut at sequence boundaries into
  segments; segment (program p, sequence b) writes partial p + b (at most P + B partials, whatever the lengths),
  and the reduce merges each sequence's segments. Lengths stay on the device (CUDA-graph safe).
Both are the generated `latent` module's `paged_decode(schedule=...)` (compiler/templates/paged_latent.py.jinja).
docs/benchmarks.md, "Issue 22: the latent decode kernel rewritten".

    python bench/latent_schedule_bench.py --out schedules.json
    TRITON_INTERPRET=1 python bench/latent_schedule_bench.py --smoke     # CPU, tiny: proves it runs
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
from latent_decode_bench import HEADS, RANK, ROPE, SCALE, latent_cache  # bench/ is on the path
from quantized_decode_bench import copy_baseline, time_ms

SHAPES = [(32, 32768, False), (8, 131072, False), (64, 8192, False), (32, 32768, True), (64, 16384, True)]
KNOBS = [(1, 64, 4, 3), (1, 64, 8, 2), (2, 32, 8, 3)]  # (programs per SM, block_n, num_warps, num_stages)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU under TRITON_INTERPRET=1")
    p.add_argument("--out")
    a = p.parse_args()
    from kvc.runtime.attention import torch_ops, triton_ops

    ops = triton_ops.load("latent")
    device = torch.device("cpu" if a.smoke else "cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    copy_bw, rows = copy_baseline(device)
    print(f"copy {copy_bw:.0f} GB/s", flush=True)

    def show(row: dict) -> None:
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    for batch, context, ragged in ([(3, 96, True)] if a.smoke else SHAPES):
        k, v, tables, lens, held = latent_cache(batch, context, device, torch.float32 if a.smoke else torch.bfloat16)
        if ragged:  # lengths from context / 32 up to context, shuffled
            gen = torch.Generator(device=device).manual_seed(1)
            lens = torch.linspace(context // 32, context, batch, device=device).int()[
                torch.randperm(batch, generator=gen, device=device)]
            held = int(lens.sum()) * (RANK + ROPE) * k.element_size()
        q = torch.randn(batch, HEADS, RANK + ROPE, device=device, dtype=k.dtype)
        ref = q.new_empty(batch, HEADS, RANK)
        ms = time_ms(lambda: ops.paged_decode(q, k, v, tables, lens, SCALE, max_context_len=context, out=ref), device)
        base = dict(batch=batch, context=context, ragged=ragged)
        show({"schedule": "split", **base, "ms": ms, "of_copy": held / ms / 1e6 / copy_bw})
        out = q.new_empty(batch, HEADS, RANK)
        for per_sm, block_n, warps, stages in ([(1, 16, 4, 1)] if a.smoke else KNOBS):
            knobs = dict(num_programs=per_sm * sms, block_n=block_n, num_warps=warps, num_stages=stages)

            def balanced() -> torch.Tensor:
                return ops.paged_decode(q, k, v, tables, lens, SCALE, out=out, schedule="balanced", **knobs)

            balanced()
            want = ref if not a.smoke else torch_ops.paged_decode(q, k, v, tables, lens, SCALE)
            err = (out.float() - want.float()).abs().max().item()
            ms = time_ms(balanced, device)
            show({"schedule": "balanced", **base, **knobs, "max_err_vs_split": err, "ms": ms,
                  "of_copy": held / ms / 1e6 / copy_bw})
            if err > 0.05:
                raise SystemExit(f"the balanced schedule departs from the split one by {err}")
    if a.out:
        meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "triton": triton.__version__,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
