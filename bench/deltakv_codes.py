"""How well do linear codes of DeltaKV's deltas reconstruct the embedded model's keys and values?

Per compressed layer, over calibration text (kvc's docs, sequences of --context tokens, each
compressed once as `kvc calibrate deltakv` does), the relative squared error of each operand
(sum |x^ - x|^2 / sum |x|^2, keys before RoPE and values apart) for:

- `ref`: the reference alone (the mean of the nearest centers; a code of zero channels);
- `split`: the best linear codes of the deltas for keys and for values apart, half the channels each;
- `joint`: one code of the whole token (DeltaKV's default, kvc's), the same channels in all;
- `plain`: the best linear code of the token itself, no reference (a Palu-like projection of the
  whole token), the same channels.

Every code is the PCA optimum of its kind (runtime/calibrate/deltakv.py's initialisation).

    python bench/deltakv_codes.py [--ratio 0.25] [--layers 3,10,20,29] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def pca_error(y: torch.Tensor, code: int, parts: list[slice]) -> list[float]:
    """Relative error of y's best rank-`code` affine reconstruction, per column part (against |y| there)."""
    y = y.double()
    mu = y.mean(0)
    values, vectors = torch.linalg.eigh((y - mu).T @ (y - mu))
    u = vectors[:, values.argsort(descending=True)[:code]]
    residual = (y - mu) - (y - mu) @ u @ u.T
    return [float(residual[:, p].square().sum()) for p in parts]


def main() -> None:
    from transformers import AttentionInterface, AutoModelForCausalLM

    from kvc.runtime.calibrate import deltakv as D
    from kvc.runtime.models.loader import model_directory
    from kvc.runtime.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=float, default=0.25, help="code channels / (2 head_dim) per KV head")
    p.add_argument("--layers", default="3,10,20,29")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--out")
    a = p.parse_args()
    directory = model_directory(None)
    tokenizer = load_tokenizer(directory)
    text = "\n\n".join(f.read_text() for f in sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md")))
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
    batches = [ids[i * a.context:(i + 1) * a.context] for i in range(a.samples)]
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    config = model.config
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = heads * dim
    code = heads * round(2 * dim * a.ratio)
    layers = [int(x) for x in a.layers.split(",")]
    cfg = D.DeltaConfig(layers=layers, code=code, steps=0)
    attn = D._Attention(cfg, model.model.rotary_emb.inv_freq)
    AttentionInterface.register(D.ATTENTION_NAME, attn)
    model.set_attn_implementation(D.ATTENTION_NAME)
    recorded: dict[int, list] = {}
    attn.record = {}
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch[None])
            for layer, (x, ref, _) in attn.record.items():
                recorded.setdefault(layer, []).append((x, ref))
    k, v = slice(0, width), slice(width, 2 * width)
    rows = []
    for layer in layers:
        x = torch.cat([r[0] for r in recorded[layer]]).double()
        ref = torch.cat([r[1] for r in recorded[layer]]).double()
        energy = [float(x[:, s].square().sum()) for s in (k, v)]
        delta = x - ref
        ref_only = [float(delta[:, s].square().sum()) for s in (k, v)]
        split = [pca_error(delta[:, s], code // 2, [slice(None)])[0] for s in (k, v)]
        joint = pca_error(delta, code, [k, v])
        plain = pca_error(x, code, [k, v])
        for name, err in (("ref", ref_only), ("split", split), ("joint", joint), ("plain", plain)):
            row = {"layer": layer, "code": name, "k": err[0] / energy[0], "v": err[1] / energy[1]}
            rows.append(row)
            print(f"layer {layer:2d} {name:5s} keys {row['k']:.4f} values {row['v']:.4f}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"ratio": a.ratio, "code": code, "context": a.context,
                                           "samples": a.samples, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
