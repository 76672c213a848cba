"""Tiny checkpoints in the block-wise FP8 format of the published FP8 models (Qwen3-*-FP8), for the loader's tests.

`write_fp8(src, dst, block)` quantizes a tiny Hugging Face checkpoint's linear weights as those models
store them: per block of `block` = (rows, columns) weights one float32 scale, `amax / 448` (e4m3's largest
finite value), `X.weight` the float8_e4m3fn codes of `w / scale` and `X.weight_scale_inv` the scales
[ceil(out / rows), ceil(in / cols)]; MoE experts one tensor per expert (`experts.{e}.gate_proj.weight`, as the
published files name them), routers, norms, the embedding and the LM head unquantized; config.json gets the
`quantization_config`. It also writes `dequantized`, the same model with every weight `codes x scale` in
float32 in the source's own layout: the reference a loader of the FP8 files must reproduce.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (codes float8_e4m3fn [out, in], scales float32 [ceil(out / bn), ceil(in / bk)])."""
    bn, bk = block
    out, cols = w.shape
    rows_b, cols_b = -(-out // bn), -(-cols // bk)
    padded = torch.zeros(rows_b * bn, cols_b * bk)
    padded[:out, :cols] = w.float()
    tiles = padded.view(rows_b, bn, cols_b, bk)
    scales = (tiles.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    codes = (tiles / scales[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(rows_b * bn, cols_b * bk)[:out, :cols].contiguous(), scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    out, cols = codes.shape
    expanded = scales.repeat_interleave(bn, 0)[:out].repeat_interleave(bk, 1)[:, :cols]
    return codes.float() * expanded


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    """The published files' rule: linear weights inside the decoder layers, not the MoE router."""
    return (name.startswith("model.layers.") and tensor.dim() >= 2 and ".mlp.gate.weight" not in name
            and not name.endswith("layernorm.weight"))


def write_fp8(src: Path, dst: Path, block: tuple[int, int], quantize=_quantized) -> Path:
    """`dst` holds the FP8 checkpoint, `dst / "dequantized"` its float32 reference (module docstring)."""
    reference = dst / "dequantized"
    for folder in (dst, reference):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"),
                        dirs_exist_ok=True)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors |= load_file(str(file))
    fp8, dequantized = {}, {}
    for name, tensor in tensors.items():
        if not quantize(name, tensor):
            fp8[name] = dequantized[name] = tensor.contiguous()
            continue
        if tensor.dim() == 3:  # stacked experts [E, rows, cols]: one tensor per expert, as published
            prefix, kind = name.rsplit(".", 1)  # ...mlp.experts, gate_up_proj | down_proj
            parts = []
            for e, w in enumerate(tensor):
                halves = {"gate_proj": w[: w.shape[0] // 2], "up_proj": w[w.shape[0] // 2:]} \
                    if kind == "gate_up_proj" else {"down_proj": w}
                rebuilt = []
                for part, weight in halves.items():
                    codes, scales = quantize_blocks(weight, block)
                    fp8[f"{prefix}.{e}.{part}.weight"] = codes
                    fp8[f"{prefix}.{e}.{part}.weight_scale_inv"] = scales
                    rebuilt.append(dequantize_blocks(codes, scales, block))
                parts.append(torch.cat(rebuilt))
            dequantized[name] = torch.stack(parts)
            continue
        codes, scales = quantize_blocks(tensor, block)
        fp8[name], fp8[f"{name}_scale_inv"] = codes, scales
        dequantized[name] = dequantize_blocks(codes, scales, block)
    save_file(fp8, str(dst / "model.safetensors"))
    save_file(dequantized, str(reference / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
