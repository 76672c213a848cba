"""Untrained DeltaKV compressor inputs for a model shape (`deltakv.safetensors`: down, up [layers, Hkv, 2 D, C],
bias [layers, Hkv, 2 D], C = Hkv x round(2 D ratio)) for throughput runs on random-weight models, whose speed
does not depend on the values (`kvc calibrate deltakv` trains the real ones through a model on disk).

    python bench/delta_inputs.py --model random:qwen3-30b-a3b --out DIR/deltakv.safetensors [--ratio 0.25]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvc.runtime.bench.plan import model_spec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ratio", type=float, default=0.25)
    a = p.parse_args()
    spec = model_spec(a.model, torch.device("cpu"), "float32")
    width = 2 * spec.head_dim
    code = spec.num_kv_heads * round(width * a.ratio)
    g = torch.Generator().manual_seed(0)
    # an orthonormal basis per (layer, head), as the PCA initialisation gives: codes of the same scale as x
    basis = torch.linalg.qr(torch.randn(spec.num_layers, spec.num_kv_heads, width, code, generator=g))[0] \
        if code <= width else torch.randn(spec.num_layers, spec.num_kv_heads, width, code, generator=g) / code**0.5
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"down": basis.contiguous(), "up": basis.contiguous(),
               "bias": torch.zeros(spec.num_layers, spec.num_kv_heads, width)}, str(out))
    print(f"wrote {out}: down, up {tuple(basis.shape)}, bias")


if __name__ == "__main__":
    main()
