"""MLA latent decode under two schedules, GLM-4.7-Flash's shape (20 heads over one latent head of 512 + 64 RoPE
channels, bf16, pages of 16), uniform and ragged batches, against a device-to-device copy in the same run:
- `split`: the generated `latent` kernel (compiler/templates/paged_latent.py.jinja): every sequence's context in
  the same number of splits (a program each), so a ragged batch's short rows leave SMs idle;
- `balanced` (this file; not yet in the compiler): P programs (one an SM) share the batch's tiles evenly, each
  range cut at sequence boundaries into segments; segment (program p, sequence b) writes partial p + b (at most
  P + B partials, whatever the lengths), and a reduce merges each sequence's segments. Lengths stay on the device
  (CUDA-graph safe). docs/benchmarks.md, "Issue 22: the latent decode kernel".

    python bench/latent_schedule_bench.py --out schedules.json
    TRITON_INTERPRET=1 python bench/latent_schedule_bench.py --smoke     # CPU, tiny: proves it runs
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl
from latent_decode_bench import HEADS, RANK, ROPE, SCALE, latent_cache  # bench/ is on the path
from quantized_decode_bench import copy_baseline, time_ms

SHAPES = [(32, 32768, False), (8, 131072, False), (64, 8192, False), (32, 32768, True), (64, 16384, True)]
KNOBS = [(1, 64, 4, 3), (1, 64, 8, 2), (2, 32, 8, 3)]  # (programs per SM, block_n, num_warps, num_stages)


@triton.jit
def _tiles(lens_ptr, starts_ptr, stride_sb, batch, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
           HAS_STARTS: tl.constexpr):
    seqs = tl.arange(0, BLOCK_B)
    mask = seqs < batch
    lens = tl.load(lens_ptr + seqs, mask=mask, other=0)
    begins = tl.zeros([BLOCK_B], tl.int32)
    if HAS_STARTS:
        begins = tl.load(starts_ptr + seqs * stride_sb, mask=mask, other=0)
    tiles = tl.cdiv(tl.maximum(lens - begins, 0), BLOCK_N)
    ends = tl.cumsum(tiles, 0)  # inclusive
    return seqs, ends, tiles, begins, lens


@triton.jit
def balanced_kernel(
    q_ptr, kv_ptr, tables_ptr, lens_ptr, starts_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_tb, stride_sb, scale_log2, batch,
    HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr,
    HAS_STARTS: tl.constexpr,
):
    prog, programs = tl.program_id(0), tl.num_programs(0)
    seqs, ends, tiles, begins, lens = _tiles(lens_ptr, starts_ptr, stride_sb, batch, BLOCK_B, BLOCK_N, HAS_STARTS)
    total = tl.max(ends, 0)
    lo = (prog * total) // programs
    hi = ((prog + 1) * total) // programs
    heads = tl.arange(0, BLOCK_H)
    head_mask = heads < HEADS
    ranks = tl.arange(0, RANK)
    rope_dims = tl.arange(0, BLOCK_P)
    t = lo
    while t < hi:
        b = tl.sum((ends <= t).to(tl.int32), 0)  # the sequence holding tile t
        seg_end = tl.minimum(hi, tl.sum(tl.where(seqs == b, ends, 0), 0))
        first_tile = tl.sum(tl.where(seqs == b, ends - tiles, 0), 0)
        begin = tl.sum(tl.where(seqs == b, begins, 0), 0)
        length = tl.sum(tl.where(seqs == b, lens, 0), 0)
        q_cols = q_ptr + b.to(tl.int64) * stride_qb + heads[None, :] * stride_qh
        q_lat = tl.load(q_cols + ranks[:, None], mask=head_mask[None, :], other=0.0)
        q_rope = tl.load(q_cols + RANK + rope_dims[:, None], mask=head_mask[None, :] & (rope_dims < ROPE)[:, None],
                         other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([RANK, BLOCK_H], tl.float32)
        table = tables_ptr + b * stride_tb
        first = begin + (t - first_tile) * BLOCK_N
        last = tl.minimum(length, begin + (seg_end - first_tile) * BLOCK_N)
        for start in range(first, last, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            token_mask = tokens < last
            pages = tl.load(table + tokens // PAGE_SIZE, mask=token_mask, other=0)
            rows = pages.to(tl.int64) * stride_kp + (tokens % PAGE_SIZE) * stride_ks
            latent = tl.load(kv_ptr + rows[:, None] + ranks[None, :], mask=token_mask[:, None], other=0.0)
            rope = tl.load(kv_ptr + rows[:, None] + RANK + rope_dims[None, :],
                           mask=token_mask[:, None] & (rope_dims < ROPE)[None, :], other=0.0)
            s = tl.dot(latent, q_lat) + tl.dot(rope, q_rope)
            s = tl.where(token_mask[:, None], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            acc = acc * alpha[None, :] + tl.dot(tl.trans(latent), p.to(latent.dtype))
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        row = ((prog + b).to(tl.int64) * HEADS + heads)
        tl.store(part_out_ptr + row[None, :] * RANK + ranks[:, None], acc / l_i[None, :], mask=head_mask[None, :])
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=head_mask)
        t = seg_end


@triton.jit
def balanced_reduce(part_out_ptr, part_lse_ptr, lens_ptr, starts_ptr, out_ptr, stride_sb, stride_ob, stride_oh,
                    batch, programs, HEADS: tl.constexpr, RANK: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_B: tl.constexpr, HAS_STARTS: tl.constexpr):
    b, head = tl.program_id(0), tl.program_id(1)
    seqs, ends, tiles, begins, lens = _tiles(lens_ptr, starts_ptr, stride_sb, batch, BLOCK_B, BLOCK_N, HAS_STARTS)
    total = tl.max(ends, 0)
    c1 = tl.sum(tl.where(seqs == b, ends, 0), 0)
    c0 = c1 - tl.sum(tl.where(seqs == b, tiles, 0), 0)
    ranks = tl.arange(0, RANK)
    m = tl.full([], -1.0e30, tl.float32)
    wsum = tl.zeros([], tl.float32)
    acc = tl.zeros([RANK], tl.float32)
    if c1 > c0:
        p0 = ((c0 + 1) * programs - 1) // total
        p1 = (c1 * programs - 1) // total
        for p in range(p0, p1 + 1):
            row = (p + b).to(tl.int64) * HEADS + head
            empty = (p * total) // programs == ((p + 1) * total) // programs  # more programs than tiles
            lse = tl.load(part_lse_ptr + row)
            lse = tl.where(empty, float("-inf"), lse)
            o = tl.load(part_out_ptr + row * RANK + ranks)
            o = tl.where(empty, 0.0, o)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + w * o
            wsum = wsum * alpha + w
            m = m_new
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + ranks,
             (acc / tl.maximum(wsum, 1.0)).to(out_ptr.dtype.element_ty))


def balanced_decode(q, kv, tables, lens, scale, out, programs, block_n=64, num_warps=8, num_stages=2, kv_starts=None,
           bufs=None):
    batch, heads, width = q.shape
    rank = out.shape[-1]
    rope = width - rank
    if bufs is None:
        bufs = (torch.empty(programs + batch, heads, rank, device=q.device, dtype=torch.float32),
                torch.empty(programs + batch, heads, device=q.device, dtype=torch.float32))
    part_out, part_lse = bufs
    starts, stride_sb = (kv_starts, kv_starts.stride(0)) if kv_starts is not None else (lens, 0)
    block_b = max(16, triton.next_power_of_2(batch))
    balanced_kernel[(programs,)](
        q, kv, tables, lens, starts, part_out, part_lse, q.stride(0), q.stride(1), kv.stride(0), kv.stride(2),
        tables.stride(0), stride_sb, scale * 1.4426950408889634, batch,
        HEADS=heads, RANK=rank, ROPE=rope, PAGE_SIZE=kv.shape[2], BLOCK_H=max(16, triton.next_power_of_2(heads)),
        BLOCK_N=block_n, BLOCK_P=max(16, triton.next_power_of_2(rope)), BLOCK_B=block_b,
        HAS_STARTS=kv_starts is not None, num_warps=num_warps, num_stages=num_stages)
    balanced_reduce[(batch, heads)](part_out, part_lse, lens, starts, out, stride_sb, out.stride(0), out.stride(1),
                                    batch, programs, HEADS=heads, RANK=rank, BLOCK_N=block_n, BLOCK_B=block_b,
                                    HAS_STARTS=kv_starts is not None, num_warps=4)
    return out


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
            programs = per_sm * sms
            bufs = (torch.empty(programs + batch, HEADS, RANK, device=device),
                    torch.empty(programs + batch, HEADS, device=device))
            knobs = dict(programs=programs, block_n=block_n, num_warps=warps, num_stages=stages)
            balanced_decode(q, k, tables, lens, SCALE, out, bufs=bufs, **knobs)
            want = ref if not a.smoke else torch_ops.paged_decode(q, k, v, tables, lens, SCALE)
            err = (out.float() - want.float()).abs().max().item()
            ms = time_ms(lambda: balanced_decode(q, k, tables, lens, SCALE, out, bufs=bufs, **knobs), device)
            show({"schedule": "balanced", **base, **knobs, "max_err_vs_split": err, "ms": ms,
                  "of_copy": held / ms / 1e6 / copy_bw})
            if err > 0.05:
                raise SystemExit(f"the balanced schedule departs from the split kernel by {err}")
    if a.out:
        meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "triton": triton.__version__,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
