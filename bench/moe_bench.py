"""Routed experts on the GPU: the fused Triton kernels (runtime/models/moe_triton.py) against the
torch path (`RoutedExperts.forward_torch`: torch._grouped_mm on Hopper bf16, else a loop over
experts), Qwen3-30B-A3B's MoE shape (128 experts, top-8, hidden 2048, expert intermediate 768).

    python bench/moe_bench.py --out moe.json                  # tokens 1, 8, 64, 256, 4096
    python bench/moe_bench.py --sweep --e2e --out moe.json    # + tile sweep + decode steps
    python bench/moe_bench.py --align --tokens 8 --out moe.json  # + the alignment table, old vs new
    python bench/moe_bench.py --device cpu                    # tiny dry run, TRITON_INTERPRET=1
    python bench/moe_bench.py --tokens 8192,32768 --grouped-gemms   # + torch._grouped_mm's GEMMs alone

Per token count: median ms of each path, expert weight bandwidth (bytes of the distinct experts
the batch routes to, over the time: decode reads weights, little else), TFLOP/s (6 T k H I), the
error against the torch path, and the time of the expert alignments (one Triton launch, the split
kernels, the torch argsort; `moe_align.ALIGN_ONE_LAUNCH_MAX_PAIRS` chooses between the first two) (`--align` adds the
table of bench/moe_align_bench.py: old vs new per pair count, inside CUDA graphs). Routing is
random top-k of random logits, rotated over several sets so that the L2 cannot keep the experts
of the previous call. Up to 256 tokens the Triton call is also timed as a CUDA graph replay (how
the engine's decode steps run it); the torch path is captured too where it can be (its loop
variant syncs the host and cannot).

`--e2e` times decode steps of the engine on a random-weight Qwen3-30B-A3B (bf16, `full`, CUDA
graphs) with each experts implementation; `--e2e-layers` shrinks the model (the JSON says how
many layers ran). `--sweep` times a small grid of `MoeTileConfig`s per token count.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvc.runtime.tuning.timing import time_ms as _time_ms


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    top_k: int
    hidden: int
    inter: int

    def flops(self, tokens: int) -> int:
        return 6 * tokens * self.top_k * self.hidden * self.inter  # gate, up, down: 2 H I each

    def expert_bytes(self, dtype: torch.dtype) -> int:
        return 3 * self.hidden * self.inter * dtype.itemsize


QWEN3_30B_A3B = MoeShape(num_experts=128, top_k=8, hidden=2048, inter=768)
TINY = MoeShape(num_experts=8, top_k=2, hidden=64, inter=32)
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  vocab_size=320, max_position_embeddings=512)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: tiny sizes under TRITON_INTERPRET=1, proves the script runs")
    p.add_argument("--tokens", help="token counts, comma separated (default 1,8,64,256,4096; cpu 1,5,33)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--torch-impl", choices=["torch", "grouped_mm", "loop"], default="torch",
                   help="the torch path's grouped GEMM (torch: grouped_mm where fast, else loop)")
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile configs")
    p.add_argument("--grouped-gemms", action="store_true",
                   help="also time torch._grouped_mm's two GEMMs alone on expert-sorted rows (Hopper bf16)")
    p.add_argument("--e2e", action="store_true", help="decode steps of a random-weight model")
    p.add_argument("--align", action="store_true",
                   help="the expert alignment alone, old vs new (bench/moe_align_bench.py)")
    p.add_argument("--e2e-layers", type=int, help="layers of the e2e model (default: all 48; cpu 2)")
    p.add_argument("--e2e-batch", default="1,8,64", help="decode batch sizes, comma separated")
    p.add_argument("--e2e-context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--e2e-steps", type=int, default=32)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    return p.parse_args()


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


# ---- timing -------------------------------------------------------------------------------------


def time_ms(fn, device: torch.device, rep_ms: int) -> float:
    return _time_ms(fn, device, rep_ms, min_warmup=10)


def copy_bandwidth_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(2 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, 100)
    return 2 * (2 << 30) / (ms * 1e-3) / 1e9


def progress(items, label: str):
    try:
        from rich.progress import track

        return track(list(items), description=label, transient=True)
    except ImportError:
        return items


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ---- the micro-benchmark ------------------------------------------------------------------------


def make_experts(shape: MoeShape, dtype: torch.dtype, device: torch.device):
    from kvc.runtime.models.experts import RoutedExperts

    experts = RoutedExperts(shape.num_experts, shape.hidden, shape.inter).to(device, dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, shape.hidden ** -0.5)
        experts.down_proj.normal_(0.0, shape.inter ** -0.5)
    return experts.requires_grad_(False)


def routing_sets(shape: MoeShape, tokens: int, dtype, device, count: int) -> list[dict]:
    sets = []
    for _ in range(count):
        logits = torch.randn(tokens, shape.num_experts, device=device)
        weights, ids = torch.softmax(logits, -1).topk(shape.top_k, dim=-1)
        x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)
        sets.append({"x": x, "ids": ids, "weights": (weights / weights.sum(-1, keepdim=True)).contiguous()})
    return sets


def graph_replays(fn, sets: list[dict]):
    """One captured graph per input set, replayed in turn; None if fn cannot be captured."""
    try:
        for s in sets:
            fn(s)  # compile and settle allocations outside the graphs
        torch.cuda.synchronize()
        graphs = []
        for s in sets:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn(s)
            graphs.append(graph)
    except Exception as err:  # noqa: BLE001 - a path that cannot be captured is a result
        torch.cuda.synchronize()
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    cycle = itertools.cycle(graphs)
    return (lambda: next(cycle).replay()), None


def bench_tokens(shape: MoeShape, experts, tokens: int, args, device, copy_gbps) -> dict:
    from kvc.runtime.models import moe_triton

    dtype = experts.gate_up_proj.dtype
    count = 1 if tokens >= 1024 else 8
    sets = routing_sets(shape, tokens, dtype, device, count)
    touched = sum(int(torch.unique(s["ids"]).numel()) for s in sets) / count
    weight_bytes = touched * shape.expert_bytes(dtype)
    experts.impl = args.torch_impl

    def triton_fn(s, config=None):
        return moe_triton.fused_experts(s["x"], experts.gate_up_proj, experts.down_proj, s["ids"],
                                        s["weights"], config)

    def torch_fn(s):
        return experts.forward_torch(s["x"], s["ids"], s["weights"])

    def figures(ms: float | None) -> dict:
        if ms is None:
            return {"ms": None}
        gbps = weight_bytes / (ms * 1e-3) / 1e9
        row = {"ms": ms, "weight_gbps": gbps, "tflops": shape.flops(tokens) / (ms * 1e-3) / 1e12}
        if copy_gbps:
            row["fraction_of_copy_bw"] = gbps / copy_gbps
        return row

    rotate = itertools.cycle(sets)
    row = {"tokens": tokens, "experts_touched": touched, "weight_bytes": weight_bytes,
           "config": asdict(moe_triton.default_config(tokens, shape.top_k, shape.num_experts, dtype)),
           "rel_err_vs_torch": rel_err(triton_fn(sets[0]), torch_fn(sets[0]))}
    row["align_ms"] = {impl: time_ms(lambda: moe_triton.align_by_expert(
        next(rotate)["ids"], shape.num_experts, row["config"]["block_m"], impl), device, args.rep_ms // 4)
        for impl in ("triton", "split", "torch")}  # where ALIGN_ONE_LAUNCH_MAX_PAIRS should sit
    row["triton"] = figures(time_ms(lambda: triton_fn(next(rotate)), device, args.rep_ms))
    row["torch"] = figures(time_ms(lambda: torch_fn(next(rotate)), device, args.rep_ms))
    if device.type == "cuda" and tokens <= 256:
        for name, fn in (("triton_graph", triton_fn), ("torch_graph", torch_fn)):
            if fn is torch_fn and not torch_path_capturable(args.torch_impl, sets[0]["x"]):
                row[name] = {"ms": None, "error": "the loop over experts syncs the host"}
                continue
            replay, why = graph_replays(fn, sets)
            row[name] = figures(time_ms(replay, device, args.rep_ms)) if replay else {"ms": None, "error": why}
    if args.sweep:
        row["sweep"] = sweep(shape, tokens, triton_fn, rotate, device, args, figures)
    if args.grouped_gemms and device.type == "cuda" and hasattr(torch, "_grouped_mm"):
        row["grouped_mm"] = grouped_gemms(shape, experts, sets[0]["ids"], device, args.rep_ms)
    return row


def grouped_gemms(shape: MoeShape, experts, ids: torch.Tensor, device, rep_ms: int) -> dict:
    """torch._grouped_mm's gate_up and down GEMMs alone over the pairs of `ids` sorted by expert (what a
    grouped-GEMM path would run between its gather and its weighted sum): ms and TFLOP/s of each."""
    pairs = ids.numel()
    offsets = torch.bincount(ids.flatten().long(), minlength=shape.num_experts).cumsum(0).to(torch.int32)
    dtype = experts.gate_up_proj.dtype
    rows = torch.randn(pairs, shape.hidden, device=device, dtype=dtype)
    inner = torch.randn(pairs, shape.inter, device=device, dtype=dtype)
    out = {}
    for name, x, w, flops in (("gate_up", rows, experts.gate_up_proj, 4 * pairs * shape.hidden * shape.inter),
                              ("down", inner, experts.down_proj, 2 * pairs * shape.inter * shape.hidden)):
        ms = time_ms(lambda x=x, w=w: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets), device, rep_ms)
        out[name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
    return out


def torch_path_capturable(torch_impl: str, x: torch.Tensor) -> bool:
    from kvc.runtime.models.experts import _grouped_mm_is_fast

    return torch_impl == "grouped_mm" or (torch_impl == "torch" and _grouped_mm_is_fast(x))


def sweep_configs(tokens: int, shape: MoeShape):
    from kvc.runtime.models.moe_triton import MoeTileConfig

    rows_per_expert = tokens * shape.top_k / shape.num_experts
    if rows_per_expert > 256:  # prefill chunks: compute-bound tiles, around the 128 x 128 x 64 default
        gate_up = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 4), (64, 256, 8, 3)]
        down = [(0, 0, 0, 0), (128, 128, 8, 3), (256, 64, 8, 3), (256, 64, 8, 4), (128, 64, 8, 4), (256, 128, 8, 2)]
        for tma, (bm, bn, warps, stages), (dn, dk, dw, ds) in itertools.product([False, True], gate_up, down):
            if bm == 64 and dn:
                continue  # the 64-row tiles with the default down tiles only
            yield MoeTileConfig(block_m=bm, block_n=bn, block_k=64, group_m=8, num_warps=warps, num_stages=stages,
                                down_block_n=dn, down_block_k=dk, down_num_warps=dw, down_num_stages=ds, tma=tma)
        return
    block_ms = [16, 32] if rows_per_expert <= 16 else [32, 64, 128]
    for bm, bn, bk, warps, stages in itertools.product(block_ms, [32, 64, 128], [64, 128], [4, 8], [3, 4]):
        if bm * bn >= 128 * 128 and stages > 3:
            continue  # the shared memory of the larger tiles
        yield MoeTileConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)


def sweep(shape, tokens, triton_fn, rotate, device, args, figures) -> dict:
    results = []
    configs = list(sweep_configs(tokens, shape))
    if device.type == "cpu":
        configs = configs[:2]  # the dry run proves the loop, not the tiles
    for config in configs:
        try:
            ms = time_ms(lambda: triton_fn(next(rotate), config), device, max(args.rep_ms // 2, 20))
        except Exception as err:  # noqa: BLE001 - e.g. out of shared memory: skip that config
            results.append({"config": asdict(config), "error": type(err).__name__})
            continue
        results.append({"config": asdict(config), **figures(ms)})
    timed = [r for r in results if r.get("ms") is not None]
    return {"best": min(timed, key=lambda r: r["ms"]) if timed else None, "all": results}


# ---- decode steps end to end ---------------------------------------------------------------------


def e2e_decode(args, device: torch.device) -> dict:
    """Decode step time of the engine (random weights, `full`) per experts implementation."""
    import kvc.runtime.engine as engine_module
    from kvc.runtime.config import EngineConfig
    from kvc.runtime.models.experts import set_moe_impl
    from kvc.runtime.models.loader import build_random_model

    cpu = device.type == "cpu"
    overrides = dict(TINY_MODEL) if cpu else {}
    layers = args.e2e_layers or (2 if cpu else None)
    if layers:
        overrides["num_hidden_layers"] = layers
    # The engine resolves "random:NAME" without overrides; this run needs them (fewer layers).
    engine_module.resolve_model = lambda spec, dev, dtype: build_random_model(
        spec.removeprefix("random:"), dev, dtype, **overrides)
    batches = ints(args.e2e_batch) if not cpu else [1, 2]
    context = args.e2e_context if not cpu else 16
    steps = args.e2e_steps if not cpu else 2
    out = {"model": "random:qwen3-30b-a3b", "overrides": overrides, "context": context, "steps": steps,
           "cuda_graphs": not cpu, "rows": []}
    for impl in ("triton", args.torch_impl):
        engine = engine_module.Engine(EngineConfig(
            model="random:qwen3-30b-a3b", device=device.type, dtype="float32" if cpu else args.dtype,
            max_num_seqs=max(batches), max_num_batched_tokens=16384, max_model_len=context + steps + 16,
            kv_cache_memory=(64 if cpu else 8192) * 2**20, enable_prefix_caching=False))
        out["layers"] = engine.spec.num_layers
        set_moe_impl(engine.model, impl)
        for batch in progress(batches, f"e2e {impl}"):
            try:
                row = decode_steps(engine, batch, context, steps)
            except Exception as err:  # noqa: BLE001 - e.g. a torch path that cannot be captured
                row = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
                out["rows"].append({"impl": impl, "batch": batch, **row})
                break  # the engine's state is unknown after a failed step
            out["rows"].append({"impl": impl, "batch": batch, **row})
        del engine
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()
    return out


def decode_steps(engine, batch: int, context: int, steps: int) -> dict:
    from kvc.runtime.sampling_params import SamplingParams

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(0, engine.spec.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(s.num_generated == 0 for s in seqs):  # prefill
        engine.step()
    for _ in range(2):  # graph capture of this batch bucket
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    seconds = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return {"step_ms": 1e3 * seconds / steps, "decode_tok_s": batch * steps / seconds}


# ---- report -------------------------------------------------------------------------------------


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(result: dict) -> None:
    print(f"{result['device']}  torch {result['torch']}  triton {result['triton']}  {result['dtype']}  "
          f"copy {fmt(result['copy_gbps'], '.0f')} GB/s")
    print(f"{'tokens':>6} {'experts':>7} {'triton ms':>9} {'GB/s':>6} {'TFLOP/s':>7} {'graph ms':>8} "
          f"{'torch ms':>9} {'graph ms':>8} {'speedup':>7} {'rel err':>8} {'align ms one/split/torch':>24}")
    for r in result["micro"]:
        tr, to = r["triton"], r["torch"]
        speedup = to["ms"] / tr["ms"] if tr["ms"] and to["ms"] else None
        print(f"{r['tokens']:>6} {r['experts_touched']:>7.1f} {fmt(tr['ms']):>9} {fmt(tr['weight_gbps'], '.0f'):>6} "
              f"{fmt(tr['tflops'], '.1f'):>7} {fmt(r.get('triton_graph', {}).get('ms')):>8} {fmt(to['ms']):>9} "
              f"{fmt(r.get('torch_graph', {}).get('ms')):>8} {fmt(speedup, '.2f'):>7} {r['rel_err_vs_torch']:>8.1e} "
              + "/".join(fmt(r["align_ms"][impl], ".4f") for impl in ("triton", "split", "torch")))
    for r in result["micro"]:
        if "grouped_mm" in r:
            g = r["grouped_mm"]
            print(f"{r['tokens']:>6} tokens, torch._grouped_mm alone: gate_up {g['gate_up']['ms']:.3f} ms "
                  f"({g['gate_up']['tflops']:.0f} TFLOP/s), down {g['down']['ms']:.3f} ms ({g['down']['tflops']:.0f})")
    if result.get("align"):
        from moe_align_bench import print_align

        print_align(result["align"])
    e2e = result.get("e2e")
    if e2e:
        print(f"decode steps, {e2e['model']} with {e2e['layers']} layers, context {e2e['context']}:")
    for r in (e2e or {}).get("rows", []):
        if "error" in r:
            print(f"  {r['impl']:>10} batch {r['batch']:>4}: {r['error']}")
            continue
        print(f"  {r['impl']:>10} batch {r['batch']:>4}: {r['step_ms']:.2f} ms/step, "
              f"{r['decode_tok_s']:.0f} tok/s")


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu for a dry run of the script")
    import triton

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    shape = TINY if device.type == "cpu" else QWEN3_30B_A3B
    tokens = ints(args.tokens) if args.tokens else ([1, 5, 33] if device.type == "cpu" else [1, 8, 64, 256, 4096])
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
        "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "shape": asdict(shape),
        "torch_impl": args.torch_impl, "copy_gbps": copy_bandwidth_gbps(device), "micro": [],
    }
    experts = make_experts(shape, dtype, device)
    for n in progress(tokens, "moe"):
        result["micro"].append(bench_tokens(shape, experts, n, args, device, result["copy_gbps"]))
    del experts
    if args.align:
        from moe_align_bench import PAIRS, bench_align  # bench/ is on sys.path

        pairs = [4, 16, 66] if device.type == "cpu" else PAIRS
        result["align"] = bench_align(pairs, shape.num_experts, shape.top_k, device, 5 if device.type == "cpu" else 100)
    if args.e2e:
        result["e2e"] = e2e_decode(args, device)
    print_report(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
