"""TurboQuant's key offsets against `full` on the embedded model, teacher-forced: each prompt of
`kvc eval`'s multikey task (4K tokens) is prefilled in chunks of 256, so every chunk reads the
earlier ones as the cache stores them (its own tokens as computed), and the prompt logprobs of the
actual tokens and the top-1 predictions past the first chunk are compared with `full`'s. Settings:
TurboQuant (methods/turboquant.kvm) at 3 and 4 key bits (3-bit values), and its variant with the shipped
key offsets (bench/variants/turboquant_offsets.kvm). What docs/accuracy.md ("TurboQuant's key offsets")
quotes.

Usage: python bench/turboquant_offsets.py [--cases 8] [--out bench/results/turboquant_offsets.json]
(CPU, float32; about 2 minutes a setting)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from kvc.runtime.eval.tasks import make_cases
from kvc.runtime.llm import LLM
from kvc.runtime.sampling_params import SamplingParams

CHUNK = 256
OFFSETS = str(Path(__file__).resolve().parent / "variants" / "turboquant_offsets.kvm")
SETTINGS = {  # name -> (method, key bits)
    "full": ("full", None),
    "TurboQuant K3 V3, offsets": (OFFSETS, 3),
    "TurboQuant K3 V3, no offsets": ("turboquant", 3),
    "TurboQuant K4 V3, offsets": (OFFSETS, 4),
    "TurboQuant K4 V3, no offsets": ("turboquant", 4),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--out", default="bench/results/turboquant_offsets.json")
    args = parser.parse_args()
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    scored, prompts, seconds = {}, None, {}
    for name, (method, key_bits) in SETTINGS.items():
        options = dict(device="cpu", dtype="float32", max_num_batched_tokens=CHUNK, max_prefill_chunk=CHUNK)
        if method != "full":
            options.update(method_params={"key_bits": key_bits, "value_bits": 3})
        llm = LLM(method=method, **options)
        if prompts is None:
            prompts = [list(c.prompt) for c in make_cases("multikey", llm.tokenizer, 4096, args.cases, 0)]
        start = time.perf_counter()
        outs = llm.generate(prompts, [params] * len(prompts))
        seconds[name] = time.perf_counter() - start
        entries = [e for o in outs for e in o.prompt_logprobs[CHUNK:]]  # past the first chunk
        scored[name] = (np.array([e.logprob for e in entries]), np.array([e.top[0][0] for e in entries]))
    full_lp, full_top = scored["full"]
    rows = [{"setting": name, "positions": int(lp.size), "nll": float(-lp.mean()),
             "mean_abs_dlogprob": float(np.abs(lp - full_lp).mean()),
             "top1_agreement": float((top == full_top).mean()), "seconds": round(seconds[name], 1)}
            for name, (lp, top) in scored.items()]
    print("| setting | NLL | mean abs logprob change vs full | top-1 agreement with full |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['setting']} | {r['nll']:.4f} | {r['mean_abs_dlogprob']:.4f} | {r['top1_agreement']:.4f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cases": args.cases, "chunk": CHUNK, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
