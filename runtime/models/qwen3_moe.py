"""Qwen3-MoE (the Qwen3-30B-A3B architecture): Qwen3 with routed-expert MLPs.

A layer is sparse when it is not in `mlp_only_layers` and (layer_idx + 1) is a multiple of
`decoder_sparse_step`; other layers keep a dense gated MLP of `intermediate_size`. The router is
softmax over all experts (float32), then top-k, then optionally renormalized over the k
(`norm_topk_prob`); on CUDA one Triton launch (router_triton.py). There is no shared expert. The
experts themselves run in `RoutedExperts` (experts.py): the fused Triton kernels on CUDA
(moe_triton.py), the torch path elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvc.runtime.models.base import CheckpointLayout
from kvc.runtime.models.experts import RoutedExperts
from kvc.runtime.models.llama import Qwen3ForCausalLM


def num_experts_of(config: Any) -> int:
    # Qwen3MoeConfig maps num_experts to num_local_experts when saving config.json.
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and num_experts_of(config) > 0
        and (layer_idx + 1) % step == 0
    )


class SparseMoeBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
        num_experts = num_experts_of(config)
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.experts = RoutedExperts(num_experts, config.hidden_size, config.moe_intermediate_size)
        self.reduce_pairs = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k], topk_weights [T, k] float32); on CUDA one launch with the gate's GEMM
        for a decode step's tokens, the GEMM then one launch for more (router_triton.py), elsewhere torch's
        softmax and top-k (the oracle)."""
        if x.is_cuda:
            from kvc.runtime.models import router_triton  # imports triton: only a CUDA forward asks

            if self.gate_in_router(x):
                return router_triton.gate_softmax_topk(x, self.gate.weight, self.top_k, self.norm_topk_prob)
            return router_triton.softmax_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def gate_in_router(self, x: torch.Tensor) -> bool:
        """Does the router's launch also compute the gate's GEMM (router_triton.gate_softmax_topk): few tokens
        (a decode step's), a plain bias-free gate in x's dtype, x's rows with a contiguous last axis?"""
        from kvc.runtime.models import router_triton

        gate = self.gate
        return (router_triton.gate_fits(x.shape[0], gate.weight.shape[0]) and type(gate) is nn.Linear
                and gate.bias is None and gate.weight.dtype == x.dtype and x.stride(-1) == 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the layer's output: [T, H], or on the fused kernels [T, k, H], each token's weighted
        expert rows unsummed (the decoder layer's next norm adds their sum to the residual: llama.py) unless
        `reduce_pairs` (set where the output is all-reduced across ranks: runtime/distributed/shard.py)."""
        ids, weights = self.route(x)
        return self.experts(x, ids, weights, reduce=self.reduce_pairs)

    def add_to_layout(self, layout: CheckpointLayout, hf: str, kvc: str) -> None:
        layout.add(f"{hf}.gate.weight", f"{kvc}.gate.weight")
        self.experts.add_to_layout(layout, f"{hf}.experts", f"{kvc}.experts")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    architecture = "Qwen3MoeForCausalLM"

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return SparseMoeBlock(config)
        return super().make_mlp(config, layer_idx)
