"""Random DuoAttention gates for a random-weight benchmark model, which has no model directory to hold
calibrated ones: uniform in [0, 1) over [layer, kv_head], seeded. With random weights only how many
heads stream, and where, matters for speed. Read through `--method-inputs DIR`.

    python bench/random_gates.py --model qwen3-30b-a3b --out OUT/inputs/duo_attention_heads.safetensors
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvc.runtime.models.method_inputs import save_input
from kvc.runtime.models.named_configs import named_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="a named config (as in random:NAME)")
    p.add_argument("--out", required=True, help="the safetensors file to write")
    p.add_argument("--name", default="gate", help="the input's name in the method (default: gate)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    config = named_config(a.model)
    gates = torch.rand(config.num_hidden_layers, config.num_key_value_heads,
                       generator=torch.Generator().manual_seed(a.seed))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_input(out, a.name, gates)
    print(f"{out}: {a.name} [{config.num_hidden_layers}, {config.num_key_value_heads}], seed {a.seed}")


if __name__ == "__main__":
    main()
