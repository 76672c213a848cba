"""Prefill attention of one layer against cuDNN's SDPA on contiguous K/V, in the same run (issue 23's bar:
>= 1.0x cuDNN at 8K, 32K and 128K with 32/4 and 32/8 heads, head dim 128, bf16).

Per shape, median ms and causal TFLOP/s of:
- `cudnn` / `flash`: F.scaled_dot_product_attention on contiguous [1, H, T, D] (enable_gqa), one backend each;
- `kernel`: kvc's generated paged prefill (`plain` variant) over K/V in shuffled pages of 16;
- `sdpa`: kvc's `sdpa_prefill` (runtime/attention/sdpa_prefill.py, `--prefill-attention sdpa`), the engine's
  path: a fresh chunk over its own k, v; a chunk over a cached prefix over its gathered pages, prefix and
  chunk as two calls merged by their log-sum-exps;
- `blkN`: the same in query blocks of N tokens, each over the keys before it unmasked and its own causally.
Cases: one fresh chunk of T tokens, and the last 8,192-token chunk of a T-token context (T > 8K).

    python bench/prefill_attention_bench.py --out prefill_attention.json
    python bench/prefill_attention_bench.py --smoke        # CPU, tiny: proves it runs
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kvc.runtime.tuning.timing import median_ms

PAGE, DIM, CHUNK = 16, 128, 8192


def case(context: int, chunk: int, heads: int, kv_heads: int, dim: int, device: torch.device, dtype) -> dict:
    """Random q [chunk, H, D], the context's K/V contiguous [1, Hkv, T, D] and in shuffled pages."""
    gen = torch.Generator(device=device).manual_seed(0)
    pages = -(-context // PAGE)
    k = torch.randn(1, kv_heads, pages * PAGE, dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(1, kv_heads, pages * PAGE, dim, generator=gen, device=device, dtype=dtype)
    order = torch.randperm(pages, generator=gen, device=device)
    k_cache = torch.empty(pages, kv_heads, PAGE, dim, device=device, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    k_cache[order] = k[0].view(kv_heads, pages, PAGE, dim).transpose(0, 1)
    v_cache[order] = v[0].view(kv_heads, pages, PAGE, dim).transpose(0, 1)
    q = torch.randn(chunk, heads, dim, generator=gen, device=device, dtype=dtype)
    k, v = k[:, :, :context], v[:, :, :context]
    return {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "tables": order.int()[None],
            "context": context, "chunk": chunk}


def rows_of(c: dict, ops, device: torch.device, reps: int, blocks: list[int]) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kvc.runtime.attention.sdpa_prefill import ORDER, sdpa_prefill
    from kvc.runtime.attention.torch_ops import attend_chunk

    q, context, chunk = c["q"], c["context"], c["chunk"]
    heads, kv_heads = q.shape[1], c["k"].shape[1]
    scale = q.shape[-1] ** -0.5
    qd = q.transpose(0, 1)[None]
    keys_seen = sum(range(context - chunk + 1, context + 1))  # causal pairs per head
    flops = 4 * keys_seen * heads * q.shape[-1]
    new_k = c["k"][0, :, context - chunk:].transpose(0, 1)  # the chunk's own [chunk, Hkv, D]
    new_v = c["v"][0, :, context - chunk:].transpose(0, 1)
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    lens = torch.tensor([context], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    runs = {
        "sdpa": lambda: sdpa_prefill(q, new_k, new_v, c["k_cache"], c["v_cache"], c["tables"], [0, chunk],
                                     [context], scale),  # no `out`: a prefill-only step's, as the engine calls it
    }
    for block in blocks:
        if block < chunk:
            def blocked(block=block):
                with sdpa_kernel(ORDER, set_priority=True):
                    return attend_chunk(qd, c["k"], c["v"], scale, block=block)

            runs[f"blk{block}"] = blocked
    if ops is not None:
        runs["kernel"] = lambda: ops.paged_prefill(q, c["k_cache"], c["v_cache"], c["tables"], cu, lens, scale,
                                                   chunk, out=out)
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        if device.type != "cuda":
            continue

        def run(backend=backend):
            with sdpa_kernel(backend):
                if chunk == context:
                    return F.scaled_dot_product_attention(qd, c["k"], c["v"], is_causal=True, scale=scale,
                                                          enable_gqa=True)
                return attend_chunk(qd, c["k"], c["v"], scale)  # prefix and chunk, merged

        runs[name] = run
    rows = []
    for name, fn in runs.items():
        try:
            ms = median_ms(fn, device, rep_ms=200 * reps, warmup_ms=40 * reps)
        except Exception as e:  # a backend that refuses the shape: say so, go on
            rows.append({"impl": name, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        rows.append({"impl": name, "ms": ms, "TFLOPs": flops / ms / 1e9})
    base = next((r["ms"] for r in rows if r["impl"] == "cudnn" and "ms" in r), None)
    for r in rows:
        r.update(context=context, chunk=chunk, heads=f"{heads}/{kv_heads}")
        if base and "ms" in r:
            r["vs_cudnn"] = base / r["ms"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="8192,32768,131072")
    p.add_argument("--heads", default="32/8,32/4")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--blocks", default="2048,4096,8192,16384",
                   help="query blocks of the blocked causal attention (`attend_chunk(block=)`), a row each")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    device = torch.device("cpu" if a.smoke else "cuda")
    dtype = torch.float32 if a.smoke else torch.bfloat16
    ops = None
    if not a.smoke:
        from kvc.runtime.attention import triton_ops

        ops = triton_ops.load("plain")
    contexts = [64] if a.smoke else [int(x) for x in a.contexts.split(",")]
    blocks = [16] if a.smoke else [int(x) for x in a.blocks.split(",") if x]
    rows = []
    for heads in a.heads.split(","):
        hq, hkv = (int(x) for x in heads.split("/"))
        if a.smoke:
            hq, hkv = 4, 2
        for context in contexts:
            chunks = [context] + ([CHUNK] if context > CHUNK else [16] if a.smoke else [])
            for chunk in chunks:
                c = case(context, chunk, hq, hkv, 16 if a.smoke else DIM, device, dtype)
                rows += rows_of(c, ops, device, 2 if a.smoke else a.reps, blocks)
                del c
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"{'heads':>6} {'context':>8} {'chunk':>7} {'impl':>7} {'ms':>9} {'TFLOP/s':>8} {'vs cuDNN':>8}")
    for r in rows:
        if "ms" not in r:
            print(f"{r['heads']:>6} {r['context']:>8} {r['chunk']:>7} {r['impl']:>7}  {r['error']}")
            continue
        print(f"{r['heads']:>6} {r['context']:>8} {r['chunk']:>7} {r['impl']:>7} {r['ms']:9.3f} {r['TFLOPs']:8.1f} "
              f"{r.get('vs_cudnn', float('nan')):8.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
