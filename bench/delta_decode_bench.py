"""Decode attention over one DeltaKV-coded layer: the `delta` variant's kernel (compiler/templates/
paged_delta.py.jinja) reading a token plan of `selected` tokens plus the raw tail, or every stored token,
against the `plain` kernel over as many dense bf16 tokens, one layer at the Qwen3-30B-A3B shape (32 query
heads, 4 KV heads, head dim 128, bf16, pages of 16) with methods/deltakv.kvm's defaults (codes of 4 x 64
channels, 4 neighbours, a center every 8 tokens, 8 sinks, a ring of 256). The store's content is random
(codes, centers, rows; every neighbour a real center before its token): the kernel's time does not depend
on the values. Each timed as a CUDA graph of 20 calls (sparse_decode_bench's `graph_ms`).

    python bench/delta_decode_bench.py --shapes 32x32768,8x131072 --out delta_decode.json
    TRITON_INTERPRET=1 python bench/delta_decode_bench.py --smoke     # CPU, tiny: proves it runs
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from kvc.runtime.bench.bandwidth import graph_ms

HEADS, KV_HEADS, DIM, PAGE = 32, 4, 128, 16
SINK, RECENT, EVERY, COUNT, SHARE = 8, 128, 8, 4, 64


def time_ms(fn, device: torch.device, reps: int = 20) -> float:
    if device.type == "cuda":
        return graph_ms(fn, reps)
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def delta_store(batch: int, context: int, dtype: torch.dtype, device: torch.device):
    """(DeltaPages of `batch` rows of `context` stored tokens, page tables [B, pages], rows [B])."""
    from kvc.runtime.kv.delta_pages import DeltaPages
    from kvc.runtime.kv.spec import Delta

    gen = torch.Generator(device=device).manual_seed(0)
    pages_per_row = -(-(context + 1) // PAGE)
    pages, width, code = batch * pages_per_row, 2 * DIM, KV_HEADS * SHARE
    enc = Delta("latent", "near", "centers", "sinks", "window", "down", "up", "bias", every=EVERY, count=COUNT,
                sink=SINK, recent=RECENT)

    def rand(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    positions = torch.arange(PAGE, device=device)
    # every neighbour a center (a multiple of EVERY past the sinks) at least one center before its token
    back = torch.randint(1, 64, (pages, PAGE, COUNT), generator=gen, device=device) * EVERY
    base = (torch.arange(pages, device=device) % pages_per_row)[:, None] * PAGE + positions[None, :]
    near = ((base[..., None] - SINK) // EVERY * EVERY + SINK - back).clamp(min=SINK).to(torch.int32)
    share = -(-COUNT // KV_HEADS)
    near = near.view(pages, PAGE, KV_HEADS, share).transpose(1, 2).contiguous()
    source = DeltaPages(enc, rand(pages, KV_HEADS, PAGE, SHARE), near, rand(pages, KV_HEADS, PAGE // EVERY, width),
                        rand(batch + 1, KV_HEADS, SINK, width), rand(batch + 1, KV_HEADS, 2 * RECENT, width),
                        rand(KV_HEADS, width, code) * 0.05, rand(KV_HEADS, width, code) * 0.05, rand(KV_HEADS, width),
                        1.0 / (10000 ** (torch.arange(0, DIM, 2, device=device).float() / DIM)))
    tables = torch.arange(pages, device=device, dtype=torch.int32).view(batch, pages_per_row)
    rows = torch.arange(batch, device=device, dtype=torch.int32)
    return source, tables, rows


SWEEP = [dict(block_n=n, num_warps=w, num_stages=st, num_splits=sp) for n, w, st, sp in
         ((32, 4, 1, None), (32, 8, 1, None), (64, 8, 1, None), (16, 4, 1, None), (16, 8, 1, None), (32, 4, 2, None),
          (32, 4, 1, 8), (32, 8, 1, 8), (32, 8, 1, 16))]


def run_shape(batch: int, context: int, selected: int, dtype: torch.dtype, device: torch.device, kernels, plain,
              reads: str = "both", sweep: bool = False):
    from kvc.runtime.kv.plans import ReadPlan

    source, tables, rows = delta_store(batch, context, dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(batch, HEADS, DIM, generator=gen, device=device).to(dtype)
    k_new, v_new = (torch.randn(batch, KV_HEADS, DIM, generator=gen, device=device).to(dtype) for _ in range(2))
    lens = torch.full((batch,), context + 1, device=device, dtype=torch.int32)
    results = []
    plans = {} if reads == "plan" else {"all": None}
    if selected < context and reads != "all":
        tokens = torch.stack([torch.randperm(context - 2 * RECENT, generator=gen, device=device)[:selected]
                              for _ in range(batch * KV_HEADS)]).view(batch, KV_HEADS, selected).to(torch.int32)
        plans[f"plan{selected}"] = ReadPlan(tokens=tokens, last=torch.full((batch,), RECENT, device=device,
                                                                           dtype=torch.int32))
    out = torch.empty_like(q)
    for name, read in plans.items():
        ms = time_ms(lambda read=read: kernels.delta_decode(source, q, k_new, v_new, tables, lens, rows, 0.088, read,
                                                            out=out), device)
        read_tokens = context if read is None else selected + 2 * RECENT
        # plain over as many dense tokens, the same batch and heads
        dense_pages = -(-read_tokens // PAGE)
        k = torch.randn(batch * dense_pages + 1, KV_HEADS, PAGE, DIM, generator=gen, device=device).to(dtype)
        dense_tables = torch.arange(batch * dense_pages, device=device, dtype=torch.int32).view(batch, dense_pages)
        dense_lens = torch.full((batch,), read_tokens, device=device, dtype=torch.int32)
        base = time_ms(lambda: plain.paged_decode(q, k, k, dense_tables, dense_lens, 0.088, out=out), device)
        results.append(dict(batch=batch, context=context, reads=name, tokens=read_tokens, ms=round(ms, 4),
                            dense_ms=round(base, 4), vs_dense=round(base / ms, 4),
                            tokens_per_s=round(batch * KV_HEADS * read_tokens / (ms * 1e-3))))
        print(" ".join(f"{k}={v}" for k, v in results[-1].items()), flush=True)
        for knobs in SWEEP if sweep else ():
            ms = time_ms(lambda read=read: kernels.delta_decode(source, q, k_new, v_new, tables, lens, rows, 0.088,
                                                                read, out=out, **knobs), device)
            results.append(dict(batch=batch, context=context, reads=name, **knobs, ms=round(ms, 4),
                                vs_dense=round(base / ms, 4)))
            print(" ".join(f"{k}={v}" for k, v in results[-1].items()), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="32x32768,8x131072", help="BATCHxCONTEXT, comma-separated")
    p.add_argument("--selected", type=int, default=2048, help="the plan's tokens a KV head (DeltaKV's `selected`)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU under TRITON_INTERPRET=1)")
    p.add_argument("--reads", choices=("all", "plan", "both"), default="both", help="every token, the plan, or both")
    p.add_argument("--sweep", action="store_true", help="also time the kernel over launch knobs (SWEEP)")
    a = p.parse_args()
    from kvc.runtime.attention import triton_ops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels, plain = triton_ops.load("delta"), triton_ops.load("plain")
    shapes = ["2x300"] if a.smoke else a.shapes.split(",")
    selected = 16 if a.smoke else a.selected
    results = []
    for shape in shapes:
        batch, context = (int(x) for x in shape.split("x"))
        results += run_shape(batch, context, selected, dtype, device, kernels, plain, a.reads, a.sweep)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
