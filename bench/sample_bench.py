"""A decode step's sampling: the torch path (argmax, gather, temperature, softmax, noise, race, argmax,
scatter) against the fused race (runtime/primitives/race_triton.py), both through `runtime/sampler.sample`
as the engine calls it, at the decode batches of the throughput tables (18, 160 and 267 rows of Qwen3's
151,936-token vocabulary, float32 logits, temperature 1, no filter). Median ms (CUDA events, L2 cleared
between repeats), and the logits' bytes over that time against the copy bandwidth measured in the run.

    python bench/sample_bench.py --out sample.json
"""

from __future__ import annotations

import argparse
import json

import torch

from kvc.runtime.bench.bandwidth import copy_gbps
from kvc.runtime.primitives.race_triton import race
from kvc.runtime.sampler import sample
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.tuning.timing import time_ms

VOCAB = 151_936


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="18,160,267")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    copy = copy_gbps()["best"]
    results = {"copy_gbps": copy, "vocab": a.vocab, "rows": []}
    print(f"copy bandwidth {copy:.0f} GB/s")
    for n in [int(x) for x in a.rows.split(",")]:
        logits = torch.randn(n, a.vocab, device=dev) * 3
        params = [SamplingParams()] * n
        gens = [None] * n
        default = torch.Generator(device=dev).manual_seed(0)
        race_gen = torch.Generator().manual_seed(0)
        inv = torch.ones(n, device=dev)
        torch_ms = time_ms(lambda: sample(logits, params, gens, default), dev)
        fused_ms = time_ms(lambda: sample(logits, params, gens, default, race_generator=race_gen), dev)
        kernel_ms = time_ms(lambda: race(logits, inv, 1), dev)
        read_gbps = logits.numel() * 4 / kernel_ms / 1e6
        row = {"rows": n, "torch_ms": torch_ms, "fused_ms": fused_ms, "kernel_ms": kernel_ms,
               "speedup": torch_ms / fused_ms, "kernel_of_copy": read_gbps / copy}
        results["rows"].append(row)
        print(f"rows={n}: torch {torch_ms:.3f} ms, fused {fused_ms:.3f} ms ({torch_ms / fused_ms:.2f}x), "
              f"kernels alone {kernel_ms:.3f} ms ({read_gbps:.0f} GB/s, {read_gbps / copy:.2f} of copy)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
