"""Routed experts computed grouped by expert (the MoE part of Qwen3-MoE, reusable by other MoEs).

Each token picks k experts. Instead of looping over tokens, the (token, expert) pairs are sorted
by expert id so that every expert's rows are contiguous; one grouped matmul (or one matmul per
expert that received rows) then runs each expert on all of its rows at once, and the results are
scattered back and summed with the routing weights.

Expert weights are stacked: gate_up_proj [E, 2*I, H] (gate rows first), down_proj [E, H, I].
That is transformers 5's fused layout; per-expert checkpoints are loaded into slices of it.

`RoutedExperts.impl` picks the implementation: "auto" runs the fused Triton kernels
(`moe_triton.py`) on CUDA when Triton is installed and this torch path elsewhere; "triton" forces
the kernels (on CPU only under TRITON_INTERPRET=1, as the tests do); "torch" is this path with its
grouped GEMM chosen by `grouped_linear`; "grouped_mm" and "loop" pin that choice. The torch path is
the oracle the kernels are tested against. `set_moe_impl` sets it on every expert layer of a model.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType
from typing import TYPE_CHECKING, Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from kvc.runtime.errors import ConfigError
from kvc.runtime.models.base import CheckpointLayout

if TYPE_CHECKING:
    from kvc.runtime.models.moe_triton import MoeTileConfig

log = logging.getLogger(__name__)

GroupedImpl = Literal["auto", "grouped_mm", "loop"]
ExpertsImpl = Literal["auto", "triton", "torch", "grouped_mm", "loop"]
EXPERTS_IMPLS: tuple[str, ...] = get_args(ExpertsImpl)


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, impl: GroupedImpl = "auto"
) -> torch.Tensor:
    """Rows of x sorted by group; rows of group e get x @ weight[e].T.

    x [M, K], weight [E, N, K], counts [E] (rows per group, summing to M) -> [M, N].
    """
    if impl == "auto":
        impl = "grouped_mm" if _grouped_mm_is_fast(x) else "loop"
    if impl == "grouped_mm":
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, n in enumerate(counts.tolist()):  # one host sync per call, not per expert
        if n:
            torch.matmul(x[start : start + n], weight[expert].T, out=out[start : start + n])
            start += n
    return out


def _grouped_mm_is_fast(x: torch.Tensor) -> bool:
    # torch's grouped GEMM kernel targets Hopper+ in bf16; elsewhere a loop over experts is as
    # fast and works on every torch version.
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


class RoutedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.impl: ExpertsImpl = "auto"
        self.tile_config: MoeTileConfig | None = None  # None: moe_triton's heuristic per batch
        self.fp8_block_columns = 0  # > 0: weights stored as FP8 codes with per-row block scales (`to_fp8`)
        # expert parallelism (runtime/distributed/shard.py): this rank holds experts [first_expert, first_expert + E)
        # of the model's; a pair routed to another rank's expert adds nothing here. None: every expert
        self.first_expert: int | None = None

    def local_pairs(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's expert ids as this rank's (expert parallelism): another rank's expert becomes
        `num_experts` (no expert here), its weight 0."""
        ids = topk_ids - self.first_expert
        outside = (ids < 0) | (ids >= self.num_experts)
        return (ids.masked_fill(outside, self.num_experts).contiguous(),
                topk_weights.masked_fill(outside, 0.0).contiguous())

    def to_fp8(self, names: list[str], block_columns: int) -> None:
        """Stores the weights `names` as FP8 codes plus `<name>_scale` [E, rows, ceil(cols / block)] per-row
        block scales (runtime/models/fp8_weights.py); built on the meta device, filled by the loader."""
        from kvc.runtime.models.fp8_weights import CODES

        for name in names:
            shape = getattr(self, name).shape
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=CODES), requires_grad=False))
            scales = torch.empty(*shape[:-1], -(-shape[-1] // block_columns), dtype=torch.float32)
            setattr(self, f"{name}_scale", nn.Parameter(scales, requires_grad=False))
        self.fp8_block_columns = block_columns

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) as the products read them: FP8 ones dequantized to `dtype`."""
        if not self.fp8_block_columns:
            return self.gate_up_proj, self.down_proj
        from kvc.runtime.models.fp8_weights import dequantize

        return tuple(dequantize(getattr(self, n), getattr(self, f"{n}_scale"), self.fp8_block_columns, dtype)
                     if getattr(self, n).dtype != dtype else getattr(self, n) for n in ("gate_up_proj", "down_proj"))

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, reduce: bool = True,
    ) -> torch.Tensor:
        """x [T, H], topk_ids/topk_weights [T, k] -> sum_j w_j * expert_{id_j}(x) [T, H]. `reduce=False`
        allows the k terms unsummed, [T, k, H] (the fused kernels' per-pair rows: a caller whose next step is a
        residual add, `RMSNorm.forward_add`, sums them there); the torch path sums them anyway."""
        skips = self.first_expert is not None
        if skips:
            topk_ids, topk_weights = self.local_pairs(topk_ids, topk_weights)
        kernels = triton_kernels_for(x.device, self.impl)
        if kernels is not None:  # FP8 weights dequantized tile by tile in the kernels
            scales = (self.gate_up_proj_scale, self.down_proj_scale) if self.fp8_block_columns else None
            return kernels.fused_experts(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights,
                                         self.tile_config, scales, self.fp8_block_columns, skips, reduce)
        if skips:  # the torch path (the oracle) computes another rank's pairs on expert 0, weighted 0
            topk_ids = topk_ids.masked_fill(topk_ids == self.num_experts, 0)
        return self.forward_torch(x, topk_ids, topk_weights)

    def forward_torch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        gate_up: torch.Tensor | None = None, down: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The torch path (the oracle): grouped matmuls over the pairs sorted by expert (over `weights()`
        unless given)."""
        if gate_up is None or down is None:
            gate_up, down = self.weights(x.dtype)
        grouped: GroupedImpl = "auto"
        if self.impl in ("grouped_mm", "loop"):
            grouped = self.impl
        num_tokens, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        rows = x[order // k]
        gate, up = grouped_linear(rows, gate_up, counts, grouped).chunk(2, dim=-1)
        out_sorted = grouped_linear(F.silu(gate) * up, down, counts, grouped)
        # Weight each row (float32 weights), round to the activation dtype as the reference does
        # per expert, then un-sort and sum each token's k rows.
        out_sorted = (out_sorted * topk_weights.reshape(-1)[order, None]).to(x.dtype)
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted
        return out.view(num_tokens, k, -1).sum(dim=1)

    def add_to_layout(self, layout: CheckpointLayout, hf: str, kvc: str) -> None:
        i = self.intermediate_size
        gate_up, down = f"{kvc}.gate_up_proj", f"{kvc}.down_proj"
        for e in range(self.num_experts):
            layout.add(f"{hf}.{e}.gate_proj.weight", gate_up, e, slice(0, i))
            layout.add(f"{hf}.{e}.up_proj.weight", gate_up, e, slice(i, 2 * i))
            layout.add(f"{hf}.{e}.down_proj.weight", down, e)
        # transformers >= 5 may save the stacked tensors directly.
        layout.add(f"{hf}.gate_up_proj", gate_up, alternative=True)
        layout.add(f"{hf}.down_proj", down, alternative=True)


def triton_kernels_for(device: torch.device, impl: str) -> ModuleType | None:
    """`moe_triton` when `impl` runs the Triton kernels on `device`, else None (the torch path).

    "auto" means Triton on CUDA if it is installed; "triton" insists, with an actionable error
    where it cannot run."""
    if impl not in ("auto", "triton"):
        return None
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if impl == "auto" and device.type != "cuda":
        return None
    if device.type != "cuda" and not interpret:
        raise ConfigError(
            f"the triton MoE kernels run on CUDA devices, not {device.type!r} (set "
            "TRITON_INTERPRET=1 to emulate them, slowly, or use the 'torch' experts implementation)",
            param="moe_impl",
        )
    kernels = _import_moe_triton()
    if isinstance(kernels, ModuleType):
        return kernels
    if impl == "triton":
        raise ConfigError(
            f"the triton MoE kernels need the `triton` package ({kernels}); install it with "
            "`pip install kvc[triton]` or use the 'torch' experts implementation",
            param="moe_impl",
        )
    return None


@functools.lru_cache(maxsize=None)
def _import_moe_triton() -> ModuleType | str:
    """The kernel module, or why it cannot be imported (said once, not per layer call)."""
    try:
        from kvc.runtime.models import moe_triton
    except ModuleNotFoundError as err:
        log.warning("triton is not installed: MoE layers run the torch path (%s)", err)
        return str(err)
    return moe_triton


def set_moe_impl(model: nn.Module, impl: str) -> int:
    """Set the experts implementation of every routed-expert layer of `model`; returns how many."""
    if impl not in EXPERTS_IMPLS:
        raise ConfigError(
            f"the experts implementation must be one of {', '.join(EXPERTS_IMPLS)}, got {impl!r}",
            param="moe_impl",
        )
    layers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    for layer in layers:
        layer.impl = impl  # type: ignore[assignment]
    return len(layers)
