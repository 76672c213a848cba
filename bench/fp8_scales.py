"""FP8 KV cache against `full` on a real model, teacher-forced: every token of some English
paragraphs (kvc's own docs, 4 files x 4 paragraphs) is scored by the `full` engine and by `fp8`
with each format and scale (`unit`, `dynamic`), and the logprobs of the actual tokens and the top-1
predictions are compared. What docs/design.md ("KV spec", float codes) quotes for the default of
`fp8`'s `scale` parameter.

Usage: python bench/fp8_scales.py [--dtype float32|bfloat16] [--out bench/results/fp8_scales.json]
(the embedded default model, SmolLM2-135M-Instruct, on the CPU; a few minutes)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from kvc.runtime.llm import LLM
from kvc.runtime.sampling_params import SamplingParams

DOCS = Path(__file__).resolve().parents[1] / "docs"
SETTINGS = {"full": {}, "fp8 e4m3 unit": {"scale": "unit"}, "fp8 e4m3 dynamic": {"scale": "dynamic"},
            "fp8 e5m2 unit": {"format": "e5m2", "scale": "unit"},
            "fp8 e5m2 dynamic": {"format": "e5m2", "scale": "dynamic"}}


def texts() -> list[str]:
    out = []
    for doc in ("design.md", "compiler.md", "serving.md", "language.md"):
        out += [p for p in (DOCS / doc).read_text().split("\n\n") if len(p) > 900][:4]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="bench/results/fp8_scales.json")
    args = parser.parse_args()
    prompts = texts()
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    scored = {}
    for name, method_params in SETTINGS.items():
        llm = LLM(method=name.split()[0], method_params=method_params, device="cpu", dtype=args.dtype)
        outs = llm.generate(prompts, [params] * len(prompts))
        scored[name] = (np.array([e.logprob for o in outs for e in o.prompt_logprobs[1:]]),
                        np.array([e.top[0][0] for o in outs for e in o.prompt_logprobs[1:]]))
    full_lp, full_top = scored["full"]
    rows = []
    for name, (lp, top) in scored.items():
        rows.append({"setting": name, "positions": int(lp.size), "nll": float(-lp.mean()),
                     "mean_abs_dlogprob": float(np.abs(lp - full_lp).mean()),
                     "top1_agreement": float((top == full_top).mean())})
    print(f"| setting ({args.dtype}) | NLL | mean abs logprob change | top-1 agreement with full |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['nll']:.4f} | {r['mean_abs_dlogprob']:.4f} | {r['top1_agreement']:.4f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(out.read_text()) if out.exists() else {}
    data[args.dtype] = rows
    out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
