"""RetroInfer's decode pieces on a GPU, one layer at the Qwen3-30B-A3B shape (32 query heads, 4 KV heads,
head dim 128, bf16, pages of 16, the method's defaults: clusters of 16 tokens, 1.8% read, 25% read or
estimated): the read over the rows' cluster indices (scores, ranking, the packed token plan and the estimate)
as the engine runs it on a GPU (the compiler's fused `cluster_scores` and every kernel after it reading the
index's views over all sequence rows through the decode rows' `rows`) and, for comparison in the same run, the
lowering's read over gathered copies of the rows (`read_hook_gathered`, the gathers not timed); the spec decode
over that plan with the estimate as more split partials; and the dense decode of full over the same rows. Each
timed as a CUDA graph of 20 calls; copy bandwidth of the same GPU in the same run. The indices are synthetic
(every indexed slot in a random cluster: sizes about Poisson(16)) in the layout `ClusterIndices.inputs` gives.
Usage: python bench/cluster_decode_bench.py [--shapes 14x32768,4x131072] [--out FILE.json]
       python bench/cluster_decode_bench.py --device cpu   # a small dry run, TRITON_INTERPRET=1"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from kvc.compiler.cache import locate
from kvc.runtime.attention import triton_ops
from kvc.runtime.bench.bandwidth import copy_gbps, graph_ms
from kvc.runtime.bench.busy import profile_busy
from kvc.runtime.compiled import folder
from kvc.runtime.compiled.folder import GeneratedCode
from kvc.runtime.kv.plans import Estimate, ReadPlan

HEADS, KV_HEADS, DIM, PAGE = 32, 4, 128, 16


def index_inputs(batch: int, context: int, params: dict, device, dtype=torch.bfloat16) -> dict:
    """A decode batch's cluster indices as `ClusterIndices.inputs` lays them out: slots [sink, context - local)
    indexed, `context / cluster_size` clusters a row and KV head, each slot in a random one; summaries in `dtype`
    (the model's, as the engine keeps them)."""
    first, last = int(params["sink"]), int(params["local"])
    indexed = context - first - last
    clusters = math.ceil(context / params["cluster_size"])
    members = torch.full((batch, KV_HEADS, context), -1, dtype=torch.long, device=device)
    members[..., :indexed] = torch.randint(0, clusters, (batch, KV_HEADS, indexed), device=device)
    sizes = torch.zeros(batch, KV_HEADS, clusters, device=device).scatter_add_(
        2, members[..., :indexed], torch.ones(batch, KV_HEADS, indexed, device=device))
    return {"sizes": sizes, "members": members,
            "starts": torch.full((batch,), first, dtype=torch.long, device=device),
            "ends": torch.full((batch,), first + indexed, dtype=torch.long, device=device),
            "lengths": torch.full((batch,), context, dtype=torch.long, device=device),
            "centroid": (torch.randn(batch, KV_HEADS, clusters, DIM, device=device) * 0.5).to(dtype),
            "value_sum": (torch.randn(batch, KV_HEADS, clusters, DIM, device=device)
                          * sizes[..., None].sqrt()).to(dtype)}


def index_views(inputs: dict, spare: int = 2) -> dict:
    """The same indices as `ClusterIndices.inputs(gather=False)` gives them: views over every sequence row of
    a two-layer store (`spare` rows more than the batch, the decode rows scattered among them) and `rows`."""
    batch = inputs["sizes"].shape[0]
    device = inputs["sizes"].device
    rows = torch.randperm(batch + spare, device=device)[:batch]
    out = {"lengths": inputs["lengths"].to(torch.int32)}
    for name in ("sizes", "members", "centroid", "value_sum"):
        x = inputs[name].to(torch.int32) if name == "members" else inputs[name]
        store = torch.zeros((batch + spare, 2, *x.shape[1:]), dtype=x.dtype, device=device)
        store[rows, 1] = x
        out[name] = store[:, 1]
    bounds = torch.zeros((batch + spare, 2), dtype=torch.int32, device=device)
    bounds[rows, 0], bounds[rows, 1] = inputs["starts"].to(torch.int32), inputs["ends"].to(torch.int32)
    return {**out, "starts": bounds[:, 0], "ends": bounds[:, 1], "rows": rows.to(torch.int32)}


def _once_ms(fn) -> float:
    """One call's milliseconds (the CPU dry run: no graphs)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="14x32768,4x131072", help="batch x context, comma separated")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = a.device
    timed = graph_ms if device == "cuda" else _once_ms
    compiled = locate("retroinfer", generated=folder.GENERATED)
    code = GeneratedCode("retroinfer", compiled.folder, compiled.manifest)
    hook, params = code.lowering.decode_before_attention, dict(code.lowering.DEFAULTS)
    fused, read_fn = code.fused("decode_before_attention"), code.lowering.decode_before_attention_read
    spec, plain = triton_ops.load("spec"), triton_ops.load("plain")
    rows = []

    def report(**row):
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    copy_bw = copy_gbps()["best"] if device == "cuda" else float("nan")  # read + write, GB/s
    report(piece="copy", GBps=copy_bw)
    for shape in a.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        width = context // PAGE
        k_cache = torch.randn(batch * width + 1, KV_HEADS, PAGE, DIM, device=device, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = (torch.randperm(batch * width, device=device) + 1).view(batch, width).to(torch.int32)
        q = torch.randn(batch, HEADS, DIM, device=device, dtype=torch.bfloat16)
        lens = torch.full((batch,), context, device=device, dtype=torch.int32)
        inputs = {**index_inputs(batch, context, params, device), "q": q}
        ctx = lens.to(torch.float64)
        sym = {"context": ctx, "prompt": ctx, "step": ctx * 0, "layer": 0, "layers": 48, "heads": HEADS,
               "kv_heads": KV_HEADS, "head_dim": DIM}
        scale = 1 / math.sqrt(DIM)
        out = torch.empty_like(q)
        kv_bytes = 2 * batch * KV_HEADS * context * DIM * 2
        dense = timed(lambda: plain.paged_decode(q, k_cache, v_cache, tables, lens, scale, out=out))
        report(piece="full_decode", batch=batch, context=context, ms=dense, of_copy=kv_bytes / dense / 1e6 / copy_bw)
        views = index_views(inputs)

        def gpu_read():  # the engine's GPU read (runtime/compiled/read.py `_cluster_plan`, fused)
            return read_fn(fused(q, {"centroid": views["centroid"]}, views["rows"]), views, sym, params)

        summary_bytes = sum(inputs[n].numel() * inputs[n].element_size() for n in ("centroid", "sizes", "members"))
        ms = timed(lambda: hook(inputs, {}, sym, params))
        report(piece="read_hook_gathered", batch=batch, context=context, ms=ms, summary_MB=summary_bytes / 1e6)
        ms = timed(gpu_read)
        report(piece="read_hook", batch=batch, context=context, ms=ms, summary_MB=summary_bytes / 1e6)
        if device == "cuda":  # the read kernel by kernel (eager, 20 calls: launches included)
            profile = profile_busy(lambda: [gpu_read() for _ in range(20)], torch.device(device), 20)
            for k in profile["by_kernel"][:12]:
                report(piece="read_hook_kernel", batch=batch, context=context, kernel=k["name"],
                       calls=k["calls"] / 20, us=k["ms_per_step"] * 1e3)
        tokens, last, estimate, counts = gpu_read()
        read = ReadPlan(tokens=tokens, last=last, estimate=Estimate(*estimate), counts=counts)
        listed = int(counts.sum()) + int(last.sum()) * KV_HEADS
        read_bytes = listed * 2 * DIM * 2 + 2 * estimate[2].numel() * DIM * 2  # slots' K, V; entries
        ms = timed(lambda: spec.paged_decode(q, k_cache, v_cache, tables, lens, scale, read=read, out=out))
        report(piece="plan_decode", batch=batch, context=context, ms=ms, slots_per_head=listed / batch / KV_HEADS,
               of_copy=read_bytes / ms / 1e6 / copy_bw)
        no_estimate = ReadPlan(tokens=tokens, last=last, counts=counts)
        ms = timed(lambda: spec.paged_decode(q, k_cache, v_cache, tables, lens, scale, read=no_estimate, out=out))
        report(piece="plan_decode_without_estimate", batch=batch, context=context, ms=ms)

        def both():
            t, la, e, c = gpu_read()
            spec.paged_decode(q, k_cache, v_cache, tables, lens, scale, out=out,
                              read=ReadPlan(tokens=t, last=la, estimate=Estimate(*e), counts=c))
        ms = timed(both)
        report(piece="retroinfer_layer", batch=batch, context=context, ms=ms, vs_full_decode=dense / ms)
    if a.out:
        with open(a.out, "w") as f:
            gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
            json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
