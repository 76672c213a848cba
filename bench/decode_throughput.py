"""Decode tokens/s of kvc (`full`) against Hugging Face transformers `generate`, same GPU, same
model shape (random weights: speed does not depend on weight values).

For each batch size B: B prompts of --context random tokens are prefilled, then decode time is
measured over a window of steps. HF's decode time is the difference of two `generate` runs with
different max_new_tokens (so its prefill cancels out).

    python bench/decode_throughput.py --model random:qwen3-8b --batch 1 32 --context 8192 --out r.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch


def kvc_decode_tps(model: str, batch: int, context: int, steps: int, warmup: int) -> dict:
    from kvc.runtime.config import EngineConfig
    from kvc.runtime.engine import Engine
    from kvc.runtime.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_num_seqs=max(batch, 1),
                                 max_num_batched_tokens=16384, max_model_len=context + warmup + steps + 8,
                                 enable_prefix_caching=False))
    g = torch.Generator().manual_seed(0)
    vocab = engine.spec.vocab_size
    params = SamplingParams(max_tokens=warmup + steps + 4, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(torch.randint(0, vocab, (context,), generator=g).tolist(), params) for _ in range(batch)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while any(s.num_generated == 0 for s in seqs):
        engine.step()
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    for _ in range(warmup):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = {"engine": "kvc", "batch": batch, "context": context, "prefill_s": prefill_s,
           "step_ms": 1e3 * dt / steps, "decode_tok_s": batch * steps / dt}
    del engine, seqs
    gc.collect()
    torch.cuda.empty_cache()
    return out


def hf_decode_tps(model: str, batch: int, context: int, steps: int) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    from kvc.runtime.models.named_configs import named_config

    config = named_config(model.removeprefix("random:"))
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (batch, context), device="cuda")

    def run(lm, n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(hf, 2)  # warm-up
    short, long = run(hf, 4), run(hf, 4 + steps)
    dt = long - short
    out = {"engine": "hf-transformers", "version": transformers.__version__, "batch": batch, "context": context,
           "step_ms": 1e3 * dt / steps, "decode_tok_s": batch * steps / dt}
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for b in a.batch:
        rows.append(kvc_decode_tps(a.model, b, a.context, a.steps, a.warmup))
        print(json.dumps(rows[-1]), flush=True)
        if not a.skip_hf:
            rows.append(hf_decode_tps(a.model, b, a.context, a.steps))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| engine | batch | context | step ms | decode tok/s |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['engine']} | {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r['decode_tok_s']:.1f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
