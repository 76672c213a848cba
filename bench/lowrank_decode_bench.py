"""Decode attention over low-rank K/V: the generated `lowrank` kernel reading a method's latents
(`palu` by default: half rank, four KV heads a group, keys before RoPE) against the `plain` kernel
over K/V in the model dtype, one layer at the Qwen3-30B-A3B shape (32 query heads, 4 KV heads, head
dim 128, bf16, pages of 16), with a device-to-device copy of the same run as the bandwidth baseline.
Bandwidth counts the bytes the cache holds for the context (the latents: what a decode must read);
the kernel reads each group's latent once per KV head of the group, so `reads` is that many times
more, served mostly from L2. Each timed as a CUDA graph of 20 calls (bench/quantized_decode_bench.py).

    python bench/lowrank_decode_bench.py --shapes 32x32768,8x131072 --sweep --out palu_decode.json
    TRITON_INTERPRET=1 python bench/lowrank_decode_bench.py --smoke     # CPU, tiny: proves it runs
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from quantized_decode_bench import DIM, HEADS, KV_HEADS, PAGE, copy_baseline, time_ms  # bench/ is on the path

SWEEP = [dict(block_n=n, num_warps=w, num_stages=st) for n in (32, 64) for w in (4, 8) for st in (1, 2)]


def attention(method: str | None, params: dict | None, batch: int, context: int, dtype: torch.dtype,
              device: torch.device):
    """(PagedAttention over `batch` rows of `context` random tokens in `method`'s spec (None: dense),
    its K and V sources, tables, lengths, bytes the cache holds for them)."""
    from kvc.compiler.attention import variant_for_spec
    from kvc.runtime.attention.backend import PagedAttention
    from kvc.runtime.methods import resolve_method
    from kvc.runtime.models.rope import RopeSettings, inverse_frequencies

    resolved = None if method is None else resolve_method(method, params)
    pages_per_row = -(-context // PAGE)
    spec = None if resolved is None else resolved.kv_spec(KV_HEADS, DIM, dtype, PAGE)
    att = PagedAttention.allocate(1, batch * pages_per_row, KV_HEADS, PAGE, DIM, dtype, device, "triton", spec)
    att.use_variant(variant_for_spec(att.store.spec.dense, False, False, att.store.spec.low_rank))
    if att.store.spec.prerope:
        att.use_rope(inverse_frequencies(RopeSettings(theta=1e6), DIM))
    gen = torch.Generator(device=device).manual_seed(0)
    for t in att.store.tensors.values():
        t.copy_((torch.randn(t.shape, generator=gen, device=device) * 0.1).to(t.dtype))
    tables = torch.randperm(batch * pages_per_row, generator=gen, device=device).int().view(batch, pages_per_row)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    k_src, v_src = att._layer(0)
    held = att.store.spec.bytes_per_page(KV_HEADS, PAGE) * batch * pages_per_row
    return att, k_src, v_src, tables, lens, held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="palu")
    p.add_argument("--method-param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--shapes", default="32x32768,8x131072", help="BATCHxCONTEXT,...")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU under TRITON_INTERPRET=1")
    p.add_argument("--sweep", action="store_true", help="also time launch knobs (block_n, num_warps, num_stages)")
    p.add_argument("--out")
    a = p.parse_args()
    from kvc.runtime.server.launch import parse_method_params

    params = parse_method_params(a.method_param) or None
    device = torch.device("cpu" if a.smoke else "cuda")
    shapes = [(2, 64)] if a.smoke else [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    dtype = torch.bfloat16
    copy_bw, rows = copy_baseline(device)
    print(f"copy {copy_bw:.0f} GB/s", flush=True)
    scale = 1 / math.sqrt(DIM)

    def show(row: dict) -> None:
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    for batch, context in shapes:
        q = torch.randn(batch, HEADS, DIM, device=device, dtype=dtype)
        times = {}
        for name in (None, a.method):
            att, k_src, v_src, tables, lens, held = attention(name, params, batch, context, dtype, device)
            out = torch.empty_like(q)
            ms = time_ms(lambda: att.ops.paged_decode(q, k_src, v_src, tables, lens, scale, max_context_len=context,
                                                      out=out), device)
            times[name] = ms
            reads = held * (1 if name is None else k_src.enc.group)
            show({"piece": "decode", "method": name or "dense", "batch": batch, "context": context, "ms": ms,
                  "bytes": held, "GBps": held / ms / 1e6, "of_copy": held / ms / 1e6 / copy_bw,
                  "reads_GBps": reads / ms / 1e6, "vs_dense": times[None] / ms})
            if a.sweep and name is not None and not a.smoke:
                for knobs in SWEEP:
                    try:
                        ms = time_ms(lambda: att.ops.paged_decode(q, k_src, v_src, tables, lens, scale,
                                                                  max_context_len=context, out=out, **knobs), device)
                    except Exception as e:  # a launch that does not fit (shared memory): say so, go on
                        print(f"sweep {knobs}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    show({"piece": "sweep", "method": name, "batch": batch, "context": context, **knobs, "ms": ms,
                          "of_copy": held / ms / 1e6 / copy_bw, "vs_dense": times[None] / ms})
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
