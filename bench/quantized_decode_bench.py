"""Decode attention over a quantized KV cache: the generated `spec` kernel reading a method's stored
codes (FP8 by default: the `fp8` method's spec) against the `plain` kernel over K/V in the model
dtype, one layer at the Qwen3-30B-A3B shape (32 query heads, 4 KV heads, head dim 128, bf16, pages
of 16), with a device-to-device copy of the same run as the bandwidth baseline. Bandwidth counts
the bytes each kernel must read (codes and their per-token and per-page scales, or K and V;
per-layer scales are negligible; KIVI's pages are its key groups of 32 tokens), so
`of_copy` compares the kernels and `vs_dense` is what the smaller cache buys a decode step.
Each timed as a CUDA graph of 20 calls.

    python bench/quantized_decode_bench.py --method fp8 --shapes 32x32768,8x131072 --out fp8_decode.json
    python bench/quantized_decode_bench.py --method kivi --out kivi_decode.json
    TRITON_INTERPRET=1 python bench/quantized_decode_bench.py --smoke     # CPU, tiny: proves it runs
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import time

import torch
from kvc.runtime.bench.bandwidth import copy_gbps, graph_ms

HEADS, KV_HEADS, DIM, PAGE = 32, 4, 128, 16
SWEEP = [dict(block_n=n, num_warps=w, num_stages=2, **({"num_splits": sp} if sp else {}))
         for n, w, sp in ((32, 2, 0), (64, 8, 0), (128, 4, 0), (128, 8, 0), (32, 2, 16), (128, 4, 16), (128, 8, 16),
                          (128, 4, 32), (128, 8, 32))]


def time_ms(fn, device: torch.device, reps: int = 20) -> float:
    """A CUDA graph of `reps` calls, replayed (GPU: sparse_decode_bench's `graph_ms`), or a plain
    loop (CPU, for --smoke)."""
    if device.type == "cuda":
        return graph_ms(fn, reps)
    fn()
    start = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - start) * 1e3 / 2


def copy_baseline(device: torch.device) -> tuple[float, list[dict]]:
    """(copy bandwidth in GB/s, read + write; its result row): on a GPU the fastest of a graph memcpy, an
    eager one and a kernel copy (`copy_gbps`), on the CPU (--smoke) a plain copy."""
    if device.type == "cuda":
        copies = copy_gbps()
    else:
        src = torch.empty(2**20, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copies = {"best": 2 * src.numel() / time_ms(lambda: dst.copy_(src), device) / 1e6}
    return copies["best"], [{"piece": "copy", "GBps": copies["best"]}
                            | {f"{k}_GBps": v for k, v in copies.items() if k != "best"}]


def attention(method: str | None, batch: int, context: int, dtype: torch.dtype, device: torch.device):
    """(PagedAttention over `batch` rows of `context` random tokens in `method`'s spec (None: dense),
    its K and V sources, tables, lengths, bytes a decode reads)."""
    from kvc.compiler.attention import variant_for_spec
    from kvc.runtime.attention.backend import PagedAttention
    from kvc.runtime.methods import resolve_method

    resolved = None if method is None else resolve_method(method, None)
    page = (resolved.page_tokens() if resolved is not None else None) or PAGE  # the method's page (KIVI: a group)
    pages_per_row = -(-context // page)
    spec = None if resolved is None else resolved.kv_spec(KV_HEADS, DIM, dtype, page)
    att = PagedAttention.allocate(1, batch * pages_per_row, KV_HEADS, page, DIM, dtype, device, "triton", spec)
    att.use_variant(variant_for_spec(att.store.spec.dense, False, False))
    gen = torch.Generator(device=device).manual_seed(0)
    for name, t in att.store.tensors.items():  # random content; scales of 1 (fp8: codes in range)
        if t.dtype.is_floating_point and t.element_size() >= 2:
            t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32).to(t.dtype)
                    if "scale" not in name else torch.ones_like(t))
        else:
            t.copy_(torch.randn(t.shape, generator=gen, device=device).to(t.dtype))
    tables = torch.randperm(batch * pages_per_row, generator=gen, device=device).int().view(batch, pages_per_row)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    k_src, v_src = att._sources[0]
    read = att.store.spec.bytes_per_page(KV_HEADS, page) * batch * pages_per_row  # codes, scales and page scales
    return att, k_src, v_src, tables, lens, read


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="fp8")
    p.add_argument("--shapes", default="32x32768,8x131072", help="BATCHxCONTEXT,...")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU under TRITON_INTERPRET=1")
    p.add_argument("--sweep", action="store_true",
                   help="also time the method's kernel over launch knobs (block_n, num_warps, num_stages, num_splits; "
                        "num_splits 0: the heuristic's)")
    p.add_argument("--mma-splits", default="",
                   help="also time the register-mma decode (mma=True) at these splits, e.g. 2,3,4 (KIVI-2 only)")
    p.add_argument("--mma-maxnreg", type=int, default=0, help="the register-mma decode's register cap (ptxas)")
    p.add_argument("--out")
    a = p.parse_args()
    device = torch.device("cpu" if a.smoke else "cuda")
    shapes = [(2, 64)] if a.smoke else [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    dtype = torch.bfloat16
    copy_bw, rows = copy_baseline(device)
    print(f"copy {copy_bw:.0f} GB/s", flush=True)
    scale = 1 / math.sqrt(DIM)
    for batch, context in shapes:
        q = torch.randn(batch, HEADS, DIM, device=device, dtype=dtype)
        times = {}
        for name in (None, a.method):
            att, k_src, v_src, tables, lens, read = attention(name, batch, context, dtype, device)
            if a.mma_maxnreg and name is not None:  # the spec module's launch, capped (once: the module is shared)
                mod = inspect.getmodule(att.ops.paged_decode)
                if not isinstance(mod.mma_decode_launch, functools.partial):
                    mod.mma_decode_launch = functools.partial(mod.mma_decode_launch, maxnreg=a.mma_maxnreg)
            out = torch.empty_like(q)
            ms = time_ms(lambda: att.ops.paged_decode(q, k_src, v_src, tables, lens, scale, max_context_len=context,
                                                      out=out), device)
            times[name] = ms
            row = {"piece": "decode", "method": name or "dense", "batch": batch, "context": context, "ms": ms,
                   "bytes": read, "GBps": read / ms / 1e6, "of_copy": read / ms / 1e6 / copy_bw,
                   "vs_dense": times[None] / ms}
            rows.append(row)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            mma = [dict(mma=True, num_splits=int(x)) for x in a.mma_splits.split(",") if x]
            if name is not None and (a.sweep or mma):
                for knobs in (SWEEP if a.sweep else []) + mma:
                    ms = time_ms(lambda: att.ops.paged_decode(q, k_src, v_src, tables, lens, scale,
                                                              max_context_len=context, out=out, **knobs), device)
                    row = {"piece": "sweep", "method": name, "batch": batch, "context": context,
                           **{"num_splits": 0} | knobs, "ms": ms,
                           "of_copy": read / ms / 1e6 / copy_bw, "vs_dense": times[None] / ms}
                    rows.append(row)
                    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                          flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
