"""FP8 weights in the block-wise e4m3 format of the published FP8 checkpoints (Qwen3-*-FP8, DeepSeek-V3).

Such a checkpoint's config has `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [bn, bk], "activation_scheme": "dynamic"}`; a quantized linear layer's `X.weight` is
float8_e4m3fn [out, in] and `X.weight_scale_inv` float32 [ceil(out / bn), ceil(in / bk)], the weight being
`fp8 x scale` of its block. Layers stored in the model dtype (the embedding, the LM head, MoE routers) have
no scale and stay as they are: which layers are FP8 is read off the checkpoint's tensor names.

kvc keeps the codes (one byte a weight) and each row's block scales, `[out, ceil(in / bk)]`: the block
scales repeated over the block's rows (`expand_rows`), so that fused layers (q/k/v, gate/up) take each
part's rows and scales side by side even where a part's rows are not whole blocks. A layer computes with
its weights dequantized: `x @ (fp8 x scale)^T` in the activations' dtype (weight-only FP8: the same products
as the dequantized checkpoint's, in half the weight bytes of bf16); on a GPU a Triton kernel dequantizes a
tile at a time (fp8_triton.py; the routed experts: moe_triton.py), on the CPU the layer dequantizes first.
docs/design.md, "FP8 weights".
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from kvc.runtime.errors import UnsupportedArchitectureError
from kvc.runtime.models.base import CheckpointLayout, Target

CODES = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # the checkpoint's name of a weight's block scales: `X.weight_scale_inv`


@dataclass(frozen=True)
class BlockFp8:
    """A checkpoint's FP8 format: `block` = (rows, columns) of weights sharing a scale."""

    block: tuple[int, int]

    @classmethod
    def of_config(cls, quantization: object, where: str) -> BlockFp8:
        """The format of a config's `quantization_config`; anything else kvc cannot load is an error."""
        q = quantization if isinstance(quantization, dict) else {}
        method, fmt = q.get("quant_method"), q.get("fmt", "e4m3")
        block = q.get("weight_block_size")
        if method != "fp8" or fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2
                                                   and all(isinstance(b, int) and b > 0 for b in block)):
            raise UnsupportedArchitectureError(
                f"{where}: quantized checkpoints are supported in the block-wise FP8 format only (quant_method "
                f"'fp8', fmt 'e4m3', weight_block_size [rows, columns]); got {q or quantization!r}")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedArchitectureError(f"{where}: FP8 with static activation scales is not supported "
                                               f"(activation_scheme {q.get('activation_scheme')!r})")
        return cls((block[0], block[1]))

    def scale_columns(self, columns: int) -> int:
        return math.ceil(columns / self.block[1])


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block_columns: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., out, in] (e4m3) x row scales [..., out, ceil(in / bk)] -> the weights in `dtype`."""
    columns = codes.shape[-1]
    expanded = scales.float().repeat_interleave(block_columns, dim=-1)[..., :columns]
    return (codes.float() * expanded).to(dtype)


class Fp8Linear(nn.Module):
    """A linear layer of FP8 codes and per-row block scales (module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: BlockFp8,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block_columns = in_features, out_features, fmt.block[1]
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=CODES), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, fmt.scale_columns(in_features),
                                                     dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.block_columns, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one kernel, dequantizing a tile at a time (runtime/models/fp8_triton.py)
            from kvc.runtime.models import fp8_triton

            return fp8_triton.linear(x, self.weight, self.weight_scale, self.block_columns, self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)


def weight_of(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight [out, in] as products read it (an FP8 one dequantized to `dtype`)."""
    return linear.dequantized(dtype) if isinstance(linear, Fp8Linear) else linear.weight


def published_rule(layout: CheckpointLayout) -> set[str]:
    """The checkpoint names the published FP8 files quantize, for random-weight FP8 models: every weight
    inside the decoder layers but norms and MoE routers (`mlp.gate`)."""
    return {name for name in layout.targets if name.startswith("model.layers.") and name.endswith(".weight")
            and "norm" not in name.rsplit(".", 2)[-2] and not name.endswith(".mlp.gate.weight")}


def quantized_weights(path: Path) -> set[str]:
    """The checkpoint's weight names that come with block scales (`X.weight` for each `X.weight_scale_inv`)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names: Iterable[str] = json.loads(index.read_text())["weight_map"]
    else:
        names = []
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                names = [*names, *f.keys()]
    return {n[: -len(SCALE_SUFFIX)] for n in names if n.endswith(SCALE_SUFFIX)}


def quantize_modules(model: nn.Module, layout: CheckpointLayout, quantized: set[str], fmt: BlockFp8) -> set[str]:
    """Stores as FP8 (on the meta device, after the model's cast to its dtype, before the weights exist) every
    weight whose checkpoint tensors all come with block scales: an nn.Linear becomes an `Fp8Linear`, a module
    with `to_fp8` (routed experts) converts those parameters. Returns the kvc parameter names now FP8 codes.
    A weight fed by FP8 and unquantized tensors at once is an error (its parts would need two formats)."""
    by_param: dict[str, list[str]] = {}
    for name, target in layout.targets.items():
        if not target.alternative:
            by_param.setdefault(target.param, []).append(name)

    def fp8(param: str) -> bool:
        sources = by_param.get(param, [])
        chosen = [s in quantized for s in sources]
        if any(chosen) and not all(chosen):
            raise UnsupportedArchitectureError(f"{param} is filled by FP8 and unquantized checkpoint tensors at "
                                               f"once ({', '.join(sources)}): kvc stores one format per weight")
        return any(chosen)

    converted = set()
    for module_name, module in list(model.named_modules()):
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, nn.Linear) and fp8(f"{prefix}weight"):
            parent_name, _, child = module_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, Fp8Linear(module.in_features, module.out_features, module.bias is not None, fmt,
                                             None if module.bias is None else module.bias.dtype))
            converted.add(f"{prefix}weight")
        elif hasattr(module, "to_fp8"):
            names = [n for n, _ in module.named_parameters(recurse=False) if fp8(f"{prefix}{n}")]
            if names:
                module.to_fp8(names, fmt.block[1])
                converted |= {f"{prefix}{n}" for n in names}
    return converted


def add_scale_targets(layout: CheckpointLayout, converted: set[str], fmt: BlockFp8) -> None:
    """A `X.weight_scale_inv` target beside every checkpoint weight that fills an FP8 parameter `P`: the same
    region of `P_scale`, the block scales repeated over their block's rows."""
    for name, target in list(layout.targets.items()):
        if target.param in converted and not target.alternative:
            layout.targets[f"{name}{SCALE_SUFFIX}"] = Target(f"{target.param}_scale", target.index,
                                                             expand_rows=fmt.block[0])
