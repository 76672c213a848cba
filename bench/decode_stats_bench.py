"""Decode attention with the statistics a method reads (H2O's column sums, TOVA's last row): the
fused path against plain decode plus a separate statistics pass.

Variants timed per shape and fold (group/mean as H2O reads them, head/mean as TOVA does):
- `plain`: the plain attention variant's decode alone (the floor: no statistics);
- `fused`: the `decode_stats` variant (kernels_generated/_attention/decode_stats.py): the split
  kernel keeps its scaled scores, the reduce writes each head's log-sum-exp, a fold kernel writes
  the [B, R, T] statistics;
- `separate_triton`: plain decode, then the two-pass Triton statistics kernels the engine ran
  before the fusion (softmax max/normaliser pass + probabilities pass; kept below, in this file
  only, as the baseline);
- `separate_torch`: plain decode, then `decode_stats_torch` (the torch path, for scale).
Each also reports its error against `decode_stats_torch` and its overhead over `plain`.

    python bench/decode_stats_bench.py --out decode_stats.json               # H200: the default grid
    TRITON_INTERPRET=1 python bench/decode_stats_bench.py --device cpu       # CPU dry run, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def _dry_run_requested(argv: list[str]) -> bool:
    """`--device cpu` asked for? Checked before argparse: the baseline kernels below are jitted at
    import, and TRITON_INTERPRET must be set before triton is imported."""
    return "--device=cpu" in argv or any(a == "--device" and b == "cpu" for a, b in zip(argv, argv[1:]))


if _dry_run_requested(sys.argv):
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_bench import Shape, make_inputs, time_ms  # noqa: E402 -- one timing and input code

FOLDS = [("group", "mean"), ("head", "mean")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a dry run at tiny sizes under TRITON_INTERPRET=1")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--shapes", default="32x4096,64x2048", help="BATCHxCONTEXT,...")
    p.add_argument("--heads", default="32/8", help="QHEADS/KVHEADS")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    return p.parse_args()


def shapes_from(args: argparse.Namespace) -> list[Shape]:
    dtype = getattr(torch, args.dtype)
    if args.device == "cpu":
        return [Shape(2, 70, 4, 2, 32, 5, dtype), Shape(3, 300, 8, 2, 32, 16, dtype)]
    hq, hkv = (int(x) for x in args.heads.split("/"))
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    return [Shape(b, t, hq, hkv, args.head_dim, args.page_size, dtype) for b, t in sizes]


# ---- the baseline: the two-pass statistics kernels the engine ran before the fusion ----------------


@triton.jit
def _load_group(q_ptr, seq, kv_head, stride_qb, stride_qh,
                GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    mask = (offs_h < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask,
                other=0.0)
    return q.to(tl.float32)


@triton.jit
def _load_keys(k_cache_ptr, table, kv_head, tokens, token_mask, stride_kp, stride_kh, stride_ks,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    pages = tl.load(table + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
    ptrs = (k_cache_ptr + kv_head * stride_kh + pages[:, None] * stride_kp
            + (tokens % PAGE_SIZE)[:, None] * stride_ks + offs_d[None, :])
    k = tl.load(ptrs, mask=token_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    return k.to(tl.float32)


@triton.jit
def _row_stats_kernel(
    q_ptr, k_cache_ptr, block_tables_ptr, context_lens_ptr, m_ptr, l_ptr, scale,
    stride_qb, stride_qh, stride_kp, stride_kh, stride_ks, stride_bt,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_heads = tl.num_programs(1) * GROUP
    context_len = tl.load(context_lens_ptr + seq)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    q = _load_group(q_ptr, seq, kv_head, stride_qb, stride_qh, GROUP, BLOCK_H, HEAD_DIM, BLOCK_D)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: exp(m_old - m_new) never sees inf - inf
    l = tl.zeros([BLOCK_H], tl.float32)
    for tile in range(0, context_len, BLOCK_N):
        tokens = tile + offs_n
        token_mask = tokens < context_len
        k = _load_keys(k_cache_ptr, table, kv_head, tokens, token_mask, stride_kp, stride_kh, stride_ks,
                       HEAD_DIM, BLOCK_D, PAGE_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(token_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m = m_new
    row = seq.to(tl.int64) * num_heads + kv_head * GROUP + offs_h
    tl.store(m_ptr + row, m, mask=offs_h < GROUP)
    tl.store(l_ptr + row, l, mask=offs_h < GROUP)


@triton.jit
def _probs_kernel(
    q_ptr, k_cache_ptr, block_tables_ptr, context_lens_ptr, m_ptr, l_ptr, out_ptr, scale, width, num_kv_heads,
    stride_qb, stride_qh, stride_kp, stride_kh, stride_ks, stride_bt, stride_ob, stride_or,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KV_PER_PROGRAM: tl.constexpr,
    REDUCE: tl.constexpr, MEAN: tl.constexpr,
):
    seq = tl.program_id(0)
    program_row = tl.program_id(1)
    num_heads = num_kv_heads * GROUP
    context_len = tl.load(context_lens_ptr + seq)
    offs_h = tl.arange(0, BLOCK_H)
    head_mask = offs_h < GROUP
    tokens = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_mask = tokens < context_len
    in_width = tokens < width
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    out_row = out_ptr + seq.to(tl.int64) * stride_ob
    acc = tl.zeros([BLOCK_N], tl.float32)
    for i in range(KV_PER_PROGRAM):
        kv_head = program_row * KV_PER_PROGRAM + i
        q = _load_group(q_ptr, seq, kv_head, stride_qb, stride_qh, GROUP, BLOCK_H, HEAD_DIM, BLOCK_D)
        k = _load_keys(k_cache_ptr, table, kv_head, tokens, token_mask, stride_kp, stride_kh, stride_ks,
                       HEAD_DIM, BLOCK_D, PAGE_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        heads = kv_head * GROUP + offs_h
        stats = seq.to(tl.int64) * num_heads + heads
        m = tl.load(m_ptr + stats, mask=head_mask, other=0.0)
        l = tl.load(l_ptr + stats, mask=head_mask, other=1.0)
        s = tl.where(head_mask[:, None] & token_mask[None, :], s, float("-inf"))
        p = tl.exp(s - m[:, None]) / tl.where(l > 0, l, 1.0)[:, None]  # masked entries: exactly 0
        if REDUCE == 0:
            tl.store(out_row + heads[:, None] * stride_or + tokens[None, :], p,
                     mask=head_mask[:, None] & in_width[None, :])
        else:
            acc += tl.sum(p, axis=0)
    if REDUCE != 0:
        if MEAN:
            acc = acc / (GROUP * KV_PER_PROGRAM)
        tl.store(out_row + program_row * stride_or + tokens, acc, mask=in_width)


def decode_stats_two_pass(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    reduce: str,
    fn: str | None = "mean",
) -> torch.Tensor:
    """Same contract as `decode_stats.decode_stats_torch`."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    width = out.shape[-1]
    if num_seqs == 0 or width == 0:
        return out
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("q, the cache and out need a contiguous last axis")
    group = num_heads // num_kv_heads
    stats = torch.empty((2, num_seqs * num_heads), dtype=torch.float32, device=q.device)
    block_h = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if head_dim <= 128 else 32
    common = dict(GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=page_size,
                  BLOCK_N=block_n)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               block_tables.stride(0))
    _row_stats_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, block_tables, context_lens, stats[0], stats[1], scale, *strides, **common)
    per_program = num_kv_heads if reduce == "head" else 1
    grid = (num_seqs, num_kv_heads // per_program, triton.cdiv(width, block_n))
    _probs_kernel[grid](
        q, k_cache, block_tables, context_lens, stats[0], stats[1], out, scale, width, num_kv_heads,
        *strides, out.stride(0), out.stride(1), KV_PER_PROGRAM=per_program,
        REDUCE={"none": 0, "group": 1, "head": 2}[reduce], MEAN=fn == "mean", **common)
    return out


# ---- the benchmark ---------------------------------------------------------------------------------


def bench_shape(ops_plain, ops_stats, shape: Shape, device: torch.device, gen: torch.Generator) -> list[dict]:
    from kvc.runtime.attention.decode_stats import decode_stats_torch, rows
    from kvc.runtime.attention.metadata import DecodeStats

    x = make_inputs(shape, device, gen)
    scale = shape.head_dim ** -0.5
    args = (x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"], scale)
    out = torch.empty_like(x["q"])

    def plain():
        ops_plain.paged_decode(*args, max_context_len=shape.context, out=out)

    results = []
    for reduce, fn in FOLDS:
        stats = torch.empty(shape.batch, rows(reduce, shape.num_q_heads, shape.num_kv_heads), shape.context,
                            dtype=torch.float32, device=device)
        request = DecodeStats(reduce, fn, stats)
        stats_args = (x["q"], x["k_cache"], x["block_tables"], x["context_lens"], scale, stats, reduce, fn)

        def fused():
            ops_stats.paged_decode(*args, max_context_len=shape.context, out=out, stats=request)

        def separate_triton():
            plain()
            decode_stats_two_pass(*stats_args)

        def separate_torch():
            plain()
            decode_stats_torch(*stats_args)

        want = torch.empty_like(stats)
        decode_stats_torch(*stats_args[:5], want, reduce, fn)
        row = {"shape": shape.label, "batch": shape.batch, "context": shape.context,
               "heads": f"{shape.num_q_heads}/{shape.num_kv_heads}", "head_dim": shape.head_dim,
               "dtype": str(shape.dtype).removeprefix("torch."), "reduce": reduce, "fn": fn, "ms": {}, "max_err": {}}
        for name, run in (("plain", plain), ("fused", fused), ("separate_triton", separate_triton),
                          ("separate_torch", separate_torch)):
            stats.fill_(float("nan"))
            run()
            if name != "plain":
                row["max_err"][name] = (stats - want).abs().max().item()
            row["ms"][name] = time_ms(run, device)
        base = row["ms"]["plain"]
        row["overhead_vs_plain"] = {k: v / base - 1 for k, v in row["ms"].items() if k != "plain"}
        row["fused_speedup_vs_separate_triton"] = row["ms"]["separate_triton"] / row["ms"]["fused"]
        row["kv_gbps_plain"] = shape.kv_bytes / (base * 1e-3) / 1e9
        results.append(row)
    return results


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu for a dry run under TRITON_INTERPRET=1")
    from kvc.runtime.attention import triton_ops

    device = torch.device(args.device)
    ops_plain, ops_stats = triton_ops.load("plain"), triton_ops.load("decode_stats")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "triton": __import__("triton").__version__, "rows": []}
    for shape in shapes_from(args):
        result["rows"] += bench_shape(ops_plain, ops_stats, shape, device, gen)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("| shape | fold | plain ms | fused ms | separate triton ms | separate torch ms | fused err |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        ms = r["ms"]
        print(f"| {r['shape']} | {r['reduce']}/{r['fn']} | {ms['plain']:.3f} | {ms['fused']:.3f} | "
              f"{ms['separate_triton']:.3f} | {ms['separate_torch']:.3f} | {r['max_err']['fused']:.1e} |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
