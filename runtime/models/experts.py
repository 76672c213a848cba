"""Routed experts computed grouped by expert (the MoE part of Qwen3-MoE, reusable by other MoEs).

Each token picks k experts. Instead of looping over tokens, the (token, expert) pairs are sorted
by expert id so that every expert's rows are contiguous; one grouped matmul (or one matmul per
expert that received rows) then runs each expert on all of its rows at once, and the results are
scattered back and summed with the routing weights.

Expert weights are stacked: gate_up_proj [E, 2*I, H] (gate rows first), down_proj [E, H, I].
That is transformers 5's fused layout; per-expert checkpoints are loaded into slices of it.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kvc.runtime.models.base import CheckpointLayout

GroupedImpl = Literal["auto", "grouped_mm", "loop"]


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
        self.impl: GroupedImpl = "auto"

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H], topk_ids/topk_weights [T, k] -> sum_j w_j * expert_{id_j}(x) [T, H]."""
        num_tokens, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        rows = x[order // k]
        gate, up = grouped_linear(rows, self.gate_up_proj, counts, self.impl).chunk(2, dim=-1)
        out_sorted = grouped_linear(F.silu(gate) * up, self.down_proj, counts, self.impl)
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
