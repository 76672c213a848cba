"""Issue 4's GPU figures: the fused observation-window score kernel against the unfused torch
lowering, and SnapKV's prefill-end overhead as a fraction of prefill time.

(a) Window scores at T = 32K and 128K (Qwen3-8B attention shape: 32 query / 8 KV heads, head dim
    128, bf16 K, window 32, avg pooling 5): `kernels_generated/snapkv/triton_kernels.window_score`
    (two passes over K, no [head, query, key] matrix) vs `torch_lowering.score` (materialises the
    float32 window x T probabilities); time (median of triton.testing.do_bench), peak extra memory,
    and agreement (relative score error, overlap of the kept top-k sets).
(b) One request of T tokens (random-weight Qwen3-8B, bf16, max_tokens=1) through the engine with
    `full` and with `snapkv` (budget 2048): prefill time (to the first token), time spent in the
    method's prefill_end hooks, and KV pages held after prefill.

    python bench/snapkv_gpu_bench.py --out r.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

DEVICE = "cuda"
KV_BYTES = 24 * 2**30
PROFILE = False


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def window_scores(lengths: list[int]) -> list[dict]:
    import triton

    from kvc.kernels_generated.snapkv import torch_lowering, triton_kernels

    rows = []
    params = {"window": 32, "kernel": 5, "pooling": "avg", "budget": 2048}
    for length in lengths:
        g = torch.Generator(device="cuda").manual_seed(length)
        q = torch.randn(32, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(8, length, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        row = {"T": length, "heads": 32, "kv_heads": 8, "head_dim": 128, "window": 32}
        for name, fn in [("fused", lambda q=q, k=k: triton_kernels.window_score(q, k, params)),
                         ("torch", lambda q=q, k=k: torch_lowering.score(q, k, params=params))]:
            fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = fn()
            torch.cuda.synchronize()
            row[f"{name}_peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            row[f"{name}_ms"] = triton.testing.do_bench(fn, warmup=5, rep=50)
            row[f"_{name}_out"] = out
        fused, ref = row.pop("_fused_out"), row.pop("_torch_out")
        finite = torch.isfinite(ref)
        row["max_rel_err"] = float(((fused - ref).abs()[finite] / ref.abs()[finite].clamp_min(1e-6)).max())
        top = 2048 - 32
        a, b = fused.topk(top, dim=-1).indices, ref.topk(top, dim=-1).indices
        overlap = [len(set(a[h].tolist()) & set(b[h].tolist())) / top for h in range(a.shape[0])]
        row["topk_overlap"] = sum(overlap) / len(overlap)
        row["speedup"] = row["torch_ms"] / row["fused_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, fused, ref, fn  # `fn` holds q and k as defaults: drop it too so their memory is freed
        torch.cuda.empty_cache()
    return rows


def prefill_overhead(model: str, length: int, method: str, params: dict | None) -> dict:
    from kvc.runtime.config import EngineConfig
    from kvc.runtime.engine import Engine
    from kvc.runtime.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=model, device=DEVICE, dtype="bfloat16", max_num_seqs=4,
                                 max_model_len=length + 16, enable_prefix_caching=False,
                                 kv_cache_memory=KV_BYTES, method=method, method_params=params))
    hook_s = [0.0]
    end = getattr(engine.method, "prefill_end", None)

    def timed_end(layer, view):
        sync()
        t0 = time.perf_counter()
        plan = end(layer, view)
        sync()
        hook_s[0] += time.perf_counter() - t0
        return plan

    engine.method.prefill_end = timed_end
    vocab = engine.spec.vocab_size
    g = torch.Generator().manual_seed(length)
    params_s = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(3):  # the first run JIT-compiles the kernels
        hook_s[0] = 0.0
        seq = engine.add_request(torch.randint(0, vocab, (length,), generator=g).tolist(), params_s)
        sync()
        t0 = time.perf_counter()
        while seq.num_generated == 0:
            engine.step()
        sync()
        prefill = time.perf_counter() - t0
        used = engine.pool.num_used
        while not seq.is_finished:
            engine.step()
        runs.append({"prefill_s": prefill, "prefill_end_hooks_s": hook_s[0], "pages_after_prefill": used})
    if PROFILE and method != "full":
        from torch.profiler import ProfilerActivity, profile

        seq = engine.add_request(torch.randint(0, vocab, (length,), generator=g).tolist(), params_s)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            while seq.num_generated == 0:
                engine.step()
            sync()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
        while not seq.is_finished:
            engine.step()
    best = min(runs[1:], key=lambda r: r["prefill_s"])
    out = {"method": method, "params": params, "T": length, **best, "page_size": engine.config.page_size,
           "num_layers": engine.spec.num_layers}
    print(json.dumps(out), flush=True)
    del engine
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--prefill-lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--out", default="snapkv_gpu.json")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of (b) only")
    ap.add_argument("--profile", action="store_true", help="print a torch profile of each compressing prefill")
    args = ap.parse_args()
    global DEVICE, KV_BYTES, PROFILE
    DEVICE, PROFILE = args.device, args.profile
    KV_BYTES = KV_BYTES if DEVICE == "cuda" else 2**30
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    result = {"gpu": gpu, "torch": torch.__version__, "prefill": [],
              "window_scores": window_scores(args.lengths) if DEVICE == "cuda" else []}
    for length in args.prefill_lengths:
        for method, params in [("full", None), ("snapkv", {"budget": 2048})]:
            result["prefill"].append(prefill_overhead(args.model, length, method, params))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n| T | full prefill s | snapkv prefill s | overhead | in prefill_end hooks s | pages full / snapkv |")
    print("|---|---|---|---|---|---|")
    rows = result["prefill"]
    for full, snap in zip(rows[0::2], rows[1::2]):
        print(f"| {full['T']} | {full['prefill_s']:.3f} | {snap['prefill_s']:.3f} | "
              f"{(snap['prefill_s'] - full['prefill_s']) / full['prefill_s']:+.1%} | "
              f"{snap['prefill_end_hooks_s']:.3f} | "
              f"{full['pages_after_prefill']} / {snap['pages_after_prefill']} |")


if __name__ == "__main__":
    main()
