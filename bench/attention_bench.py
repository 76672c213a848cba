"""Paged attention on the GPU: the Triton decode kernel against the copy-bandwidth ceiling and
against torch SDPA (cuDNN, flash) on contiguous KV; the prefill kernel against a causal SDPA.

Decode is memory-bound, so the figure of merit is the effective bandwidth (bytes of K+V read,
plus q and out, over the kernel time) as a fraction of a plain device-to-device copy.

    python bench/attention_bench.py --out decode.json             # default shapes
    python bench/attention_bench.py --sweep --out sweep.json      # also tune the kernel configs
    TRITON_INTERPRET=1 python bench/attention_bench.py --smoke    # CPU, tiny: proves it runs

SDPA gets q [B, Hq, 1, D] and K/V [B, Hkv, T, D] with enable_gqa=True; where a backend refuses
that, K/V expanded to [B, Hq, T, D] ("expanded" in the table; bandwidth still counts the
unexpanded bytes, so the numbers compare); where it refuses both, "unsupported".
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from kvc.runtime.tuning.timing import time_ms


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.batch}x{self.context} {self.num_q_heads}/{self.num_kv_heads}"

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def io_bytes(self) -> int:
        q_and_out = 2 * self.batch * self.num_q_heads * self.head_dim * self.dtype.itemsize
        tables = self.batch * -(-self.context // self.page_size) * 4
        return self.kv_bytes + q_and_out + tables


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU under TRITON_INTERPRET=1")
    p.add_argument("--sweep", action="store_true", help="try several kernel configs per shape")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--shapes", default="1x131072,32x32768,64x8192", help="BATCHxCONTEXT,...")
    p.add_argument("--heads", default="32/8,32/4", help="QHEADS/KVHEADS,...")
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill check")
    return p.parse_args()


def shapes_from(args: argparse.Namespace) -> list[Shape]:
    dtype = getattr(torch, args.dtype)
    if args.smoke:
        sizes, heads, head_dim, page = [(1, 600), (3, 70)], [(4, 2), (4, 1)], 32, 5
    else:
        sizes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
        head_dim, page = args.head_dim, args.page_size
    return [Shape(b, t, hq, hkv, head_dim, page, dtype) for (b, t), (hq, hkv) in itertools.product(sizes, heads)]


# ---- timing ------------------------------------------------------------------------------------


def copy_bandwidth_gbps(device: torch.device, smoke: bool) -> float:
    """A large device-to-device copy: (bytes read + bytes written) / time."""
    n = (1 << 20) if smoke else (2 << 30)  # bytes of the source
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * n / (ms * 1e-3) / 1e9


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 << 20
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)


# ---- inputs ------------------------------------------------------------------------------------


def make_inputs(shape: Shape, device: torch.device, gen: torch.Generator) -> dict:
    """Dense K/V [B, Hkv, T, D] and the same values on randomly permuted pages."""
    b, t, hkv, d, s = shape.batch, shape.context, shape.num_kv_heads, shape.head_dim, shape.page_size
    pages_per_seq = -(-t // s)
    num_pages = b * pages_per_seq
    perm = torch.randperm(num_pages, generator=gen).to(device)
    q = torch.randn(b, shape.num_q_heads, d, device=device, dtype=shape.dtype)
    inputs = {"q": q, "block_tables": perm.view(b, pages_per_seq).to(torch.int32),
              "context_lens": torch.full((b,), t, dtype=torch.int32, device=device)}
    for name in ("k", "v"):
        dense = torch.randn(b, hkv, t, d, device=device, dtype=shape.dtype)
        padded = F.pad(dense, (0, 0, 0, pages_per_seq * s - t))
        tiles = padded.view(b, hkv, pages_per_seq, s, d).transpose(1, 2).reshape(num_pages, hkv, s, d)
        cache = torch.empty_like(tiles)
        cache[perm] = tiles  # block_tables[b, j] = perm[b * pages_per_seq + j] holds tile (b, j)
        inputs[name], inputs[f"{name}_cache"] = dense, cache
    return inputs


def input_sets(shape: Shape, device: torch.device, gen: torch.Generator) -> list[dict]:
    """Enough input sets that rotating through them defeats the L2 (one set for real sizes)."""
    count = max(1, min(8, -(-3 * l2_bytes(device) // max(shape.io_bytes, 1))))
    return [make_inputs(shape, device, gen) for _ in range(count)]


def rotating(fn, sets: list[dict]):
    state = itertools.cycle(sets)
    return lambda: fn(next(state))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ---- decode ------------------------------------------------------------------------------------


def triton_decode(ops, x: dict, shape: Shape, **config) -> torch.Tensor:
    return ops.paged_decode(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"],
                            shape.head_dim ** -0.5, max_context_len=shape.context, **config)


def sdpa_decode(x: dict, shape: Shape, expanded: bool) -> torch.Tensor:
    """[B, Hq, D], from q as [B, Hq, 1, D]."""
    q, scale = x["q"][:, :, None, :], shape.head_dim ** -0.5
    if expanded:
        out = F.scaled_dot_product_attention(q, x["k_expanded"], x["v_expanded"], scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, x["k"], x["v"], scale=scale, enable_gqa=True)
    return out[:, :, 0]


def bench_sdpa(backend_name: str, sets: list[dict], shape: Shape, device: torch.device) -> dict:
    """Time SDPA with one backend forced; try native GQA first, then expanded K/V."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    group = shape.num_q_heads // shape.num_kv_heads
    for expanded in (False, True):
        try:
            if expanded:
                for x in sets:
                    x["k_expanded"] = x["k"].repeat_interleave(group, dim=1)
                    x["v_expanded"] = x["v"].repeat_interleave(group, dim=1)
            with sdpa_kernel(backend):
                sdpa_decode(sets[0], shape, expanded)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                ms = time_ms(rotating(lambda x: sdpa_decode(x, shape, expanded), sets), device)
            return {"ms": ms, "how": "expanded" if expanded else "gqa"}
        except RuntimeError as err:  # includes CUDA out-of-memory
            last = str(err).splitlines()[0][:120]
        finally:
            for x in sets:
                x.pop("k_expanded", None)
                x.pop("v_expanded", None)
    return {"ms": None, "how": "unsupported", "why": last}


def bench_decode(ops, shape: Shape, device: torch.device, copy_gbps: float, gen: torch.Generator) -> dict:
    sets = input_sets(shape, device, gen)
    ref = sdpa_decode(sets[0], shape, expanded=False)
    out = triton_decode(ops, sets[0], shape)
    cfg = ops.decode_config(shape.batch, shape.num_kv_heads, shape.head_dim, shape.context, ops.num_sms(device))
    ms = time_ms(rotating(lambda x: triton_decode(ops, x, shape), sets), device)
    gbps = shape.io_bytes / (ms * 1e-3) / 1e9
    row = {"shape": shape.label, "dtype": str(shape.dtype), "page_size": shape.page_size,
           "config": asdict(cfg), "rel_err_vs_sdpa": rel_err(out, ref), "triton_ms": ms,
           "triton_gbps": gbps, "fraction_of_copy": gbps / copy_gbps}
    if device.type == "cuda":
        for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            row[name.lower()] = bench_sdpa(name, sets, shape, device)
    else:
        row["math"] = bench_sdpa("MATH", sets, shape, device)
    return row


def sweep_decode(ops, shape: Shape, device: torch.device, gen: torch.Generator, smoke: bool) -> dict:
    """Tile configs at the heuristic's split count, then split counts at the best tile config."""
    sets = input_sets(shape, device, gen)
    ref = sdpa_decode(sets[0], shape, expanded=False)
    base = ops.decode_config(shape.batch, shape.num_kv_heads, shape.head_dim, shape.context, ops.num_sms(device))
    rep = 5 if smoke else 40
    tried = []

    def attempt(cfg) -> None:
        try:
            err = rel_err(triton_decode(ops, sets[0], shape, **asdict(cfg)), ref)
            ms = time_ms(rotating(lambda x: triton_decode(ops, x, shape, **asdict(cfg)), sets), device, rep)
            tried.append({**asdict(cfg), "ms": ms, "rel_err": err, "gbps": shape.io_bytes / (ms * 1e-3) / 1e9})
        except Exception as err:  # out of shared memory / registers: record and move on
            tried.append({**asdict(cfg), "ms": None, "error": f"{type(err).__name__}: {str(err)[:100]}"})

    tiles = [(32, 64), (2, 4), (1, 2), (True, False)] if smoke else [(32, 64, 128), (4, 8), (2, 3, 4), (True, False)]
    for block_n, warps, stages, use_dot in progress(list(itertools.product(*tiles)), f"sweep {shape.label}"):
        attempt(replace(base, block_n=block_n, num_warps=warps, num_stages=stages, use_dot=use_dot))

    def ok(r):
        return r["ms"] is not None and r["rel_err"] < 2e-2

    best = min(filter(ok, tried), key=lambda r: r["ms"], default=None)
    if best is not None:
        h = base.num_splits
        for splits in sorted({1, max(1, h // 4), max(1, h // 2), 2 * h, 4 * h} - {h}):
            if splits <= ops.MAX_SPLITS:
                attempt(replace(base, **{k: best[k] for k in ("block_n", "num_warps", "num_stages", "use_dot")},
                                num_splits=splits))
        best = min(filter(ok, tried), key=lambda r: r["ms"])
    return {"shape": shape.label, "heuristic": asdict(base), "best": best, "tried": tried}


def progress(items: list, label: str):
    try:
        from rich.progress import track

        return track(items, description=label, transient=True)
    except ImportError:
        return items


def check_graph_capture(ops, device: torch.device, gen: torch.Generator) -> dict:
    """Capture decode with a loose context bound, shrink the lengths, replay, compare to eager."""
    shape = Shape(8, 4096, 32, 8, 128, 16, torch.bfloat16)
    x = make_inputs(shape, device, gen)
    out = torch.empty_like(x["q"])
    ops.paged_decode(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"], 0.088,
                     max_context_len=shape.context, out=out)  # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.paged_decode(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"], 0.088,
                         max_context_len=shape.context, out=out)
    lens = torch.randint(0, shape.context + 1, (shape.batch,), generator=gen, dtype=torch.int32)
    x["context_lens"].copy_(lens)
    graph.replay()
    torch.cuda.synchronize()
    eager = ops.paged_decode(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"], 0.088,
                             max_context_len=shape.context)
    return {"lens": lens.tolist(), "max_abs_diff": (out.float() - eager.float()).abs().max().item()}


# ---- prefill -----------------------------------------------------------------------------------


def prefill_cases(device: torch.device, gen: torch.Generator, smoke: bool) -> list[dict]:
    """Chunks over cached prefixes, each with a dense causal SDPA reference (offset mask)."""
    sizes = [(1, 64, 64), (2, 48, 16)] if smoke else [(1, 8192, 8192), (4, 8192, 2048)]
    cases = []
    for batch, context, chunk in sizes:
        shape = Shape(batch, context, 4 if smoke else 32, 2 if smoke else 8, 32 if smoke else 128,
                      16, torch.bfloat16)
        x = make_inputs(shape, device, gen)
        q = torch.randn(batch * chunk, shape.num_q_heads, shape.head_dim, device=device, dtype=shape.dtype)
        cu = torch.arange(0, batch * chunk + 1, chunk, dtype=torch.int32, device=device)
        positions = torch.arange(context - chunk, context, device=device)
        mask = torch.arange(context, device=device)[None, :] <= positions[:, None]
        qd = q.view(batch, chunk, shape.num_q_heads, shape.head_dim).transpose(1, 2)
        ref = F.scaled_dot_product_attention(qd, x["k"], x["v"], attn_mask=mask, scale=shape.head_dim ** -0.5,
                                             enable_gqa=True)
        # causal FLOPs: each query attends to (its position + 1) keys, for QK and for PV
        keys_seen = batch * sum(range(context - chunk + 1, context + 1))
        cases.append({"shape": shape, "chunk": chunk, "q": q, "cu": cu, "x": x,
                      "ref": ref.transpose(1, 2).reshape_as(q),
                      "flops": 4 * keys_seen * shape.num_q_heads * shape.head_dim})
    return cases


def run_prefill(ops, case: dict, **config) -> torch.Tensor:
    x, shape = case["x"], case["shape"]
    return ops.paged_prefill(case["q"], x["k_cache"], x["v_cache"], x["block_tables"], case["cu"],
                             x["context_lens"], shape.head_dim ** -0.5, case["chunk"], **config)


def prefill_row(ops, case: dict, device: torch.device, rep_ms: int = 100, **config) -> dict:
    err = rel_err(run_prefill(ops, case, **config), case["ref"])
    ms = time_ms(lambda: run_prefill(ops, case, **config), device, rep_ms)
    shape = case["shape"]
    return {**config, "batch": shape.batch, "context": shape.context, "chunk": case["chunk"], "ms": ms,
            "tflops": case["flops"] / (ms * 1e-3) / 1e12, "rel_err_vs_sdpa": err}


def sweep_prefill(ops, case: dict, device: torch.device, smoke: bool) -> dict:
    grid = [(16, 32), (16, 32), (4,), (1,)] if smoke else [(64, 128), (32, 64, 128), (4, 8), (2, 3, 4)]
    tried = []
    label = f"sweep prefill {case['shape'].batch}x{case['chunk']}"
    for block_m, block_n, warps, stages in progress(list(itertools.product(*grid)), label):
        config = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            tried.append(prefill_row(ops, case, device, 5 if smoke else 40, **config))
        except Exception as err:  # out of shared memory / registers: record and move on
            tried.append({**config, "ms": None, "error": f"{type(err).__name__}: {str(err)[:100]}"})
    good = [r for r in tried if r["ms"] is not None and r["rel_err_vs_sdpa"] < 2e-2]
    shape = case["shape"]
    return {"case": f"{shape.batch}x{shape.context} chunk {case['chunk']}",
            "heuristic": asdict(ops.prefill_config(shape.head_dim, shape.dtype, device)),
            "best": min(good, key=lambda r: r["ms"], default=None), "tried": tried}


# ---- report ------------------------------------------------------------------------------------


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(result: dict) -> None:
    print(f"\n## Decode attention on {result['device']}  (copy bandwidth {result['copy_gbps']:.0f} GB/s)\n")
    sdpa = "cuDNN ms | flash ms" if result["device"] != "cpu (interpreter)" else "math ms | -"
    print(f"| shape (BxT q/kv) | splits | triton ms | GB/s | of copy | rel err | {sdpa} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["decode"]:
        sdpa = [r.get("cudnn_attention") or r.get("math") or {}, r.get("flash_attention") or {}]
        cells = [f"{fmt(s.get('ms'))} ({s.get('how')})" if s else "-" for s in sdpa]
        print(f"| {r['shape']} | {r['config']['num_splits']} | {r['triton_ms']:.3f} | {r['triton_gbps']:.0f} | "
              f"{r['fraction_of_copy']:.0%} | {r['rel_err_vs_sdpa']:.1e} | {cells[0]} | {cells[1]} |")
    if result.get("graph"):
        print(f"\nCUDA graph replay with shorter contexts: max |diff| vs eager {result['graph']['max_abs_diff']:.2e}")
    if result.get("prefill"):
        print("\n| prefill B x context (chunk) | ms | TFLOP/s | rel err |\n|---|---|---|---|")
        for r in result["prefill"]:
            print(f"| {r['batch']} x {r['context']} ({r['chunk']}) | {r['ms']:.3f} | {r['tflops']:.0f} | "
                  f"{r['rel_err_vs_sdpa']:.1e} |")
    if result.get("prefill_sweep"):
        print("\n| prefill case | heuristic ms | best ms | best (block_m, block_n, warps, stages) |\n|---|---|---|---|")
        for s, r in zip(result["prefill_sweep"], result["prefill"]):
            b = s["best"] or {}
            print(f"| {s['case']} | {r['ms']:.3f} | {fmt(b.get('ms'))} | ({b.get('block_m')}, {b.get('block_n')}, "
                  f"{b.get('num_warps')}, {b.get('num_stages')}) |")
    if result.get("sweep"):
        print("\n| shape | heuristic ms | best ms | best (block_n, warps, stages, dot, splits) |\n|---|---|---|---|")
        for s, r in zip(result["sweep"], result["decode"]):
            b = s["best"] or {}
            print(f"| {s['shape']} | {r['triton_ms']:.3f} | {fmt(b.get('ms'))} | ({b.get('block_n')}, "
                  f"{b.get('num_warps')}, {b.get('num_stages')}, {b.get('use_dot')}, {b.get('num_splits')}) |")


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        if not args.smoke:
            sys.exit("no CUDA device: run with --smoke (and TRITON_INTERPRET=1) to check the script on CPU")
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    from kvc.runtime.attention import triton_ops as ops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    result = {"device": name, "torch": torch.__version__, "triton": __import__("triton").__version__,
              "copy_gbps": copy_bandwidth_gbps(device, args.smoke), "decode": []}
    for shape in progress(shapes_from(args), "decode"):
        result["decode"].append(bench_decode(ops, shape, device, result["copy_gbps"], gen))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":
        result["graph"] = check_graph_capture(ops, device, gen)
    if not args.no_prefill:
        cases = prefill_cases(device, gen, args.smoke)
        result["prefill"] = [prefill_row(ops, case, device) for case in cases]
        if args.sweep:
            result["prefill_sweep"] = [sweep_prefill(ops, case, device, args.smoke) for case in cases]
        del cases
    if args.sweep:
        result["sweep"] = [sweep_decode(ops, s, device, gen, args.smoke) for s in shapes_from(args)]
    print_report(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
