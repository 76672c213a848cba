"""MLA's latent cache on one layer at GLM-4.7-Flash's shape (20 query heads over one latent head of 512 +
64 RoPE channels, bf16, pages of 16): the generated `latent` decode kernels' bandwidth over the latent
bytes a decode reads (TMA loads in a warp-specialized Gluon kernel, and the Triton kernel's pointer
loads; `max_diff` against the first one's output), over bf16 latents and over the `fp8` method's e4m3
codes (`decode_fp8`, half the bytes, dequantized by a converter warpgroup under TMA), against a
device-to-device copy in the same run; and
the prefill attention of one chunk in the absorbed form (the `latent` prefill kernel, FLOPs of
q . [c, k_rope] and p . c) against the decompressed form (per-head keys [nope 192 | rope 64] and values
256 through torch's SDPA, plus the up-projection of every context token that the decompressed form
needs first).

    python bench/latent_decode_bench.py --shapes 32x32768,8x131072 --sweep --out latent.json
    TRITON_INTERPRET=1 python bench/latent_decode_bench.py --smoke     # CPU, tiny: proves it runs
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from quantized_decode_bench import copy_baseline, time_ms  # bench/ is on the path

from kvc.runtime.attention.sources import fp8_latent_sources

HEADS, RANK, ROPE, NOPE, V_DIM, PAGE = 20, 512, 64, 192, 256, 16
SCALE = (NOPE + ROPE) ** -0.5
SWEEP = [dict(block_n=n, num_warps=w, num_stages=st) for n in (16, 32, 64) for w in (4, 8) for st in (1, 2, 3)]
PREFILL_SWEEP = [dict(block_m=m, block_n=n, num_warps=w, num_stages=st) for m in (32, 64) for n in (32, 64)
                 for w in (4, 8) for st in (1, 2)]


def latent_cache(batch: int, context: int, device: torch.device, dtype=torch.bfloat16):
    """(k_cache [pages + 1, 1, PAGE, RANK + ROPE], v view, tables [batch, pages], lengths, bytes held)."""
    pages = -(-context // PAGE)
    gen = torch.Generator(device=device).manual_seed(0)
    k = (torch.randn(batch * pages + 1, 1, PAGE, RANK + ROPE, generator=gen, device=device) * 0.1).to(dtype)
    tables = torch.randperm(batch * pages, generator=gen, device=device).int().view(batch, pages)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return k, k[..., :RANK], tables, lens, batch * context * (RANK + ROPE) * k.element_size()


def fp8_latent(k: torch.Tensor):
    """(keys, values) of the `fp8` method's latent cache holding `k`'s tokens: e4m3 codes with one scale (amax over
    448, as a dynamic scale is set); a token is 576 bytes instead of 1,152."""
    scale = float(k.float().abs().amax()) / 448.0
    return fp8_latent_sources((k.float() / scale).to(torch.float8_e4m3fn), scale, RANK, k.dtype)


def prefill_rows(ops, chunk: int, device: torch.device, sweep: bool, dtype=torch.bfloat16) -> list[dict]:
    """One sequence's causal chunk of `chunk` tokens with no prefix: absorbed kernel (and its launch knobs
    with `sweep`) vs decompressed SDPA."""
    k, v, tables, lens, _ = latent_cache(1, chunk, device, dtype)
    q = torch.randn(chunk, HEADS, RANK + ROPE, device=device, dtype=dtype) * 0.1
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    pairs = chunk * (chunk + 1) / 2 * HEADS
    rows = []
    for knobs in [{}] + (PREFILL_SWEEP if sweep else []):
        try:
            ms = time_ms(lambda: ops.paged_prefill(q, k, v, tables, cu, lens, SCALE, chunk, **knobs), device, reps=3)
        except Exception as e:  # a launch that does not fit (shared memory): report and go on
            rows.append({"piece": "prefill_absorbed", "chunk": chunk, **knobs, "error": type(e).__name__})
            continue
        rows.append({"piece": "prefill_absorbed", "chunk": chunk, **(knobs or {"knobs": "default"}), "ms": ms,
                     "TFLOPs": 2 * pairs * (RANK + ROPE + RANK) / ms / 1e9})
    up = torch.randn(RANK, HEADS * (NOPE + V_DIM), device=device, dtype=dtype) * 0.05
    latent = torch.randn(chunk, RANK, device=device, dtype=dtype)
    k_rope = torch.randn(chunk, 1, ROPE, device=device, dtype=dtype)
    qd = torch.randn(1, HEADS, chunk, NOPE + ROPE, device=device, dtype=dtype)

    def decompressed():
        kv = (latent @ up).view(chunk, HEADS, NOPE + V_DIM)
        keys = torch.cat([kv[..., :NOPE], k_rope.expand(chunk, HEADS, ROPE)], dim=-1).transpose(0, 1)[None]
        values = kv[..., NOPE:].transpose(0, 1)[None]
        return torch.nn.functional.scaled_dot_product_attention(qd, keys, values, is_causal=True, scale=SCALE)

    ms = time_ms(decompressed, device, reps=3)
    rows.append({"piece": "prefill_decompressed", "chunk": chunk, "ms": ms,
                 "TFLOPs": 2 * pairs * (NOPE + ROPE + V_DIM) / ms / 1e9})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32x32768,8x131072", help="BATCHxCONTEXT,...")
    p.add_argument("--prefill", default="8192,32768", help="prefill chunk lengths")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU under TRITON_INTERPRET=1")
    p.add_argument("--sweep", action="store_true", help="also time launch knobs (block_n, num_warps, num_stages)")
    p.add_argument("--out")
    a = p.parse_args()
    from kvc.runtime.attention import triton_ops

    ops = triton_ops.load("latent")
    device = torch.device("cpu" if a.smoke else "cuda")
    shapes = [(2, 64)] if a.smoke else [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    copy_bw, rows = copy_baseline(device)
    print(f"copy {copy_bw:.0f} GB/s", flush=True)

    def show(row: dict) -> None:
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    for batch, context in shapes:
        k, v, tables, lens, held = latent_cache(batch, context, device)
        q = torch.randn(batch, HEADS, RANK + ROPE, device=device, dtype=torch.bfloat16)
        out = q.new_empty(batch, HEADS, RANK)
        runs = {"decode": ["tma", "pointers"], "decode_fp8": ["tma", "pointers"]}
        for piece, (keys, values), nbytes in (("decode", (k, v), held), ("decode_fp8", fp8_latent(k), held // 2)):
            want = None
            launches = [{}] if a.smoke else [{"loads": loads} for loads in runs[piece]]
            for knobs in launches + (SWEEP if a.sweep and not a.smoke and piece == "decode" else []):
                try:
                    got = ops.paged_decode(q, keys, values, tables, lens, SCALE, max_context_len=context, **knobs)
                    ms = time_ms(lambda: ops.paged_decode(q, keys, values, tables, lens, SCALE,
                                                          max_context_len=context, out=out, **knobs), device)
                except Exception as e:  # a launch that does not fit (shared memory), no TMA: report and go on
                    show({"piece": piece, "batch": batch, "context": context, **knobs,
                          "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                want = got.float() if want is None else want  # the first kernel's output: the others must match it
                gbps = nbytes / ms / 1e6
                show({"piece": piece, "batch": batch, "context": context, **(knobs or {"knobs": "default"}),
                      "ms": ms, "GBps": gbps, "of_copy": gbps / copy_bw,
                      "max_diff": float((got.float() - want).abs().max())})
    for chunk in ([64] if a.smoke else [int(x) for x in a.prefill.split(",")]):
        for row in prefill_rows(ops, chunk, device, a.sweep and not a.smoke):
            show(row)
    if a.out:
        meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
