"""Compaction of kept K/V (issue 4's last kernel) and what SnapKV's prefill end costs, on the GPU.

(a) Micro-benchmark: one prefill end's compaction of a whole model, 36 layers of a sequence of
    T = 32K tokens on shuffled pages (page 16, 8 KV heads, head dim 128, bf16) keeping 2048 tokens
    per head (`equal`, SnapKV) or per-head counts averaging 2048 (`per_head`, Ada-KV-like, stored
    right-aligned), for 1 and 4 sequences per layer call. Backends: `torch` (gather into a
    temporary, then scatter, one call per plan), `torch_checked` (the same with the value checks,
    which read the indices back: a device sync per plan), `triton` (one launch per layer for every
    plan). Time: CUDA events around the 36 calls, median of repeats; GB/s counts the kept rows read
    and written, K and V. A one-layer copy checks that both backends give the same bytes.
    `--sweep` also times the kernel's chunk / head-dim slice / warp options.
(b) End to end: one SnapKV (budget 2048) request of T tokens through the engine on a random-weight
    Qwen3-8B (bf16), against `full`. Prefill time to the first token, and the prefill-end overhead
    broken down by CUDA events (and host time) around: the method's prefill_end hooks (scoring and
    selection; the dense `LayerCacheView.keys()/values()` copies inside them are counted apart),
    prefill_chunk (the query window capture), compaction (`model_runner.compact_batch`), and the
    rest (overhead not in those regions).

    python bench/compaction_bench.py --out compaction.json          # on the GPU
    python bench/compaction_bench.py --device cpu --out /tmp/c.json # a dry run at tiny sizes

Prints one JSON object per measurement and writes them all to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections import defaultdict

import torch

from kvc.runtime.kv import compaction

SIZES = {  # per device: the shapes of (a) and (b)
    "cuda": {"tokens": 32768, "kept": 2048, "heads": 8, "head_dim": 128, "layers": 36, "page": 16,
             "dtype": torch.bfloat16, "model": "random:qwen3-8b", "prompt": 32768, "budget": 2048, "repeats": 20},
    "cpu": {"tokens": 300, "kept": 48, "heads": 2, "head_dim": 16, "layers": 2, "page": 16,
            "dtype": torch.float32, "model": None, "prompt": 200, "budget": 48, "repeats": 2},
}


class Clock:
    """Elapsed milliseconds of a region: CUDA events on a GPU (no sync inside), host time elsewhere."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, start) -> float | torch.cuda.Event:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return (time.perf_counter() - start) * 1e3

    def ms(self, start, stop) -> float:
        return start.elapsed_time(stop) if self.cuda else stop


# ---- (a) micro-benchmark ---------------------------------------------------------------------

def make_jobs(sz: dict, plan: str, batch: int, layers: int, device: str, seed: int = 0):
    """Per layer, `batch` compaction jobs over disjoint shuffled pages; and the pool."""
    tokens, kept, heads, page = sz["tokens"], sz["kept"], sz["heads"], sz["page"]
    pages_per_seq = -(-tokens // page)
    num_pages = layers * batch * pages_per_seq
    k = torch.randn((num_pages, heads, page, sz["head_dim"]), dtype=sz["dtype"], device=device)
    v = torch.randn_like(k)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_pages, generator=g).tolist()
    window = min(32, kept)
    per_layer = []
    for layer in range(layers):
        jobs = []
        for b in range(batch):
            base = (layer * batch + b) * pages_per_seq
            table = order[base : base + pages_per_seq]
            if plan == "equal":
                counts = [kept] * heads
            else:  # Ada-KV-like: counts averaging `kept`, the most-keeping head ~1.5x
                spread = torch.linspace(0.5, 1.5, heads)[torch.randperm(heads, generator=g)]
                counts = [max(window, min(tokens, int(kept * s))) for s in spread.tolist()]
            keep = torch.zeros((heads, max(counts)), dtype=torch.long)
            for h, c in enumerate(counts):
                picked = torch.randperm(tokens - window, generator=g)[: c - window].sort().values
                keep[h, :c] = torch.cat([picked, torch.arange(tokens - window, tokens)])
            jobs.append(compaction.CompactionJob(table, tokens, keep.to(device),
                                                 None if plan == "equal" else torch.tensor(counts)))
        per_layer.append(jobs)
    return k, v, per_layer


def time_layers(k, v, per_layer, run, repeats: int, clock: Clock) -> float:
    """Median ms of one pass over every layer (all calls of one prefill end)."""
    for jobs in per_layer[:2]:
        run(k, v, jobs)  # warm-up (JIT)
    if clock.cuda:
        torch.cuda.synchronize()
    spans = []
    for _ in range(repeats):
        t0 = clock.start()
        for jobs in per_layer:
            run(k, v, jobs)
        spans.append((t0, clock.stop(t0)))
    if clock.cuda:
        torch.cuda.synchronize()
    return statistics.median(clock.ms(a, b) for a, b in spans)


def backends(device: str) -> dict:
    out = {
        "torch": lambda k, v, jobs: compaction.compact_many(k, v, jobs, backend="torch", checked=False),
        "torch_checked": lambda k, v, jobs: compaction.compact_many(k, v, jobs, backend="torch", checked=True),
    }
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        out["triton"] = lambda k, v, jobs: compaction.compact_many(k, v, jobs, backend="triton", checked=False)
    return out


def same_bytes(sz: dict, plan: str, device: str) -> bool:
    """Both backends on copies of one layer's pool give identical caches."""
    k, v, per_layer = make_jobs(sz, plan, 2, 1, device, seed=1)
    results = []
    for name, run in backends(device).items():
        kc, vc = k.clone(), v.clone()
        run(kc, vc, per_layer[0])
        results.append((kc, vc))
    return all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(results, results[1:]))


def micro(sz: dict, device: str, sweep: bool) -> list[dict]:
    clock = Clock(device)
    rows = []
    for plan in ("equal", "per_head"):
        for batch in (1, 4):
            k, v, per_layer = make_jobs(sz, plan, batch, sz["layers"], device)
            rows_moved = sum(int(j.counts.sum()) if j.counts is not None else j.keep.numel()
                             for jobs in per_layer for j in jobs)
            moved_bytes = rows_moved * sz["head_dim"] * k.element_size() * 2 * 2  # K and V, read + write
            row = {"bench": "compaction", "plan": plan, "seqs_per_call": batch, "layers": sz["layers"],
                   "tokens": sz["tokens"], "kept_avg": sz["kept"], "kv_heads": sz["heads"],
                   "head_dim": sz["head_dim"], "dtype": str(sz["dtype"]).replace("torch.", "")}
            for name, run in backends(device).items():
                ms = time_layers(k, v, per_layer, run, sz["repeats"], clock)
                row[f"{name}_ms"] = ms
                row[f"{name}_GBps"] = moved_bytes / ms / 1e6
            if "triton_ms" in row:
                row["speedup_vs_torch"] = row["torch_ms"] / row["triton_ms"]
            if sweep and "triton_ms" in row:
                row["sweep"] = sweep_configs(k, v, per_layer, sz, clock)
            row["same_bytes"] = same_bytes(sz, plan, device)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del k, v, per_layer
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def sweep_configs(k, v, per_layer, sz: dict, clock: Clock) -> list[dict]:
    from kvc.runtime.kv.compaction_triton import compact_triton

    resolved = [[compaction._resolve(k, job, False) for job in jobs] for jobs in per_layer]
    out = []
    for block_t in (64, 128, 256):
        for block_d in (32, 64, 128):
            for warps in (4, 8):
                def run(k_, v_, plans, bt=block_t, bd=block_d, w=warps):
                    compact_triton(k_, v_, plans, block_t=bt, block_d=bd, num_warps=w)
                ms = time_layers(k, v, resolved, run, max(3, sz["repeats"] // 4), clock)
                out.append({"block_t": block_t, "block_d": block_d, "num_warps": warps, "ms": ms})
    return sorted(out, key=lambda r: r["ms"])[:5]


# ---- (b) prefill-end breakdown ---------------------------------------------------------------

class Regions:
    """Time per named region, from wrapped callables: CUDA event spans and host seconds."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        self.spans: dict[str, list] = defaultdict(list)
        self.host: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0, h0 = self.clock.start(), time.perf_counter()
            out = fn(*args, **kwargs)
            self.host[name] += time.perf_counter() - h0
            self.spans[name].append((t0, self.clock.stop(t0)))
            return out
        return timed

    def totals(self) -> dict[str, dict]:
        return {name: {"ms": sum(self.clock.ms(a, b) for a, b in spans), "host_ms": self.host[name] * 1e3,
                       "calls": len(spans)} for name, spans in self.spans.items()}


def prefill_run(sz: dict, device: str, method: str, params: dict | None) -> dict:
    import kvc.runtime.model_runner as model_runner
    from kvc.runtime.config import EngineConfig
    from kvc.runtime.engine import Engine
    from kvc.runtime.method_api import LayerCacheView
    from kvc.runtime.sampling_params import SamplingParams

    length = sz["prompt"]
    engine = Engine(EngineConfig(model=sz["model"], device=device, dtype=str(sz["dtype"]).replace("torch.", ""),
                                 max_num_seqs=4, max_model_len=length + 16, enable_prefix_caching=False,
                                 kv_cache_memory=(24 if device == "cuda" else 1) * 2**30, method=method,
                                 method_params=params))
    clock = Clock(device)
    regions = Regions(clock)
    saved = (LayerCacheView.keys, LayerCacheView.values, model_runner.compact_batch)
    LayerCacheView.keys = regions.wrap("keys_copies", LayerCacheView.keys)
    LayerCacheView.values = regions.wrap("keys_copies", LayerCacheView.values)
    model_runner.compact_batch = regions.wrap("compaction", model_runner.compact_batch)
    m = engine.method
    for hook, name in (("prefill_end", "prefill_end_hooks"), ("prefill_chunk", "query_capture")):
        if hasattr(m, hook):
            setattr(m, hook, regions.wrap(name, getattr(m, hook)))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(length)
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    runs = []
    try:
        for _ in range(3):  # the first run compiles the kernels
            regions.reset()
            seq = engine.add_request(torch.randint(0, engine.spec.vocab_size, (length,), generator=g).tolist(),
                                     sampling)
            sync()
            t0 = time.perf_counter()
            while seq.num_generated == 0:
                engine.step()
            sync()
            prefill_ms = (time.perf_counter() - t0) * 1e3
            pages = engine.pool.num_used
            while not seq.is_finished:
                engine.step()
            runs.append({"prefill_ms": prefill_ms, "pages_after_prefill": pages, "regions": regions.totals()})
    finally:
        LayerCacheView.keys, LayerCacheView.values, model_runner.compact_batch = saved
    best = min(runs[1:], key=lambda r: r["prefill_ms"])
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"method": method, "params": params, "T": length, **best}


def breakdown(sz: dict, device: str) -> dict:
    full = prefill_run(sz, device, "full", None)
    snap = prefill_run(sz, device, "snapkv", {"budget": sz["budget"]})
    r = snap["regions"]
    zero = {"ms": 0.0, "host_ms": 0.0, "calls": 0}
    keys, hooks = r.get("keys_copies", zero), r.get("prefill_end_hooks", zero)
    capture, compact = r.get("query_capture", zero), r.get("compaction", zero)
    overhead = snap["prefill_ms"] - full["prefill_ms"]
    parts = {
        "scoring_and_selection_ms": hooks["ms"] - keys["ms"],
        "keys_copies_ms": keys["ms"],
        "query_capture_ms": capture["ms"],
        "compaction_ms": compact["ms"],
    }
    parts["rest_ms"] = overhead - sum(parts.values())
    out = {"bench": "prefill_end", "model": sz["model"] or "embedded default", "T": sz["prompt"],
           "budget": sz["budget"], "full_prefill_ms": full["prefill_ms"], "snapkv_prefill_ms": snap["prefill_ms"],
           "overhead_ms": overhead, "overhead_frac": overhead / full["prefill_ms"],
           **{k: v for k, v in parts.items()},
           **{k.replace("_ms", "_frac"): v / full["prefill_ms"] for k, v in parts.items()},
           "host_ms": {name: reg["host_ms"] for name, reg in r.items()},
           "calls": {name: reg["calls"] for name, reg in r.items()},
           "pages_after_prefill": {"full": full["pages_after_prefill"], "snapkv": snap["pages_after_prefill"]}}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run at tiny sizes")
    ap.add_argument("--out", default="compaction.json")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's block / warp options")
    ap.add_argument("--skip-e2e", action="store_true", help="only the micro-benchmark")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu for a dry run")
    sz = SIZES[args.device]
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "compaction": micro(sz, args.device, args.sweep),
              "prefill_end": None if args.skip_e2e else breakdown(sz, args.device)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
