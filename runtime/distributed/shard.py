"""A loaded model cut to one rank of a tensor-parallel group (docs/design.md, "Tensor parallelism").

Megatron's layout, for the decoders of runtime/models/llama.py and qwen3_moe.py: each rank keeps
its query heads and their KV heads (`HeadShards`; replicated where the model has fewer KV heads
than ranks) in the fused q/k/v projection, the matching columns of the output projection, a slice
of the MLP's (and of every expert's) intermediate columns in gate/up and down, or, with expert
parallelism, an even share of whole experts (a pair routed to another rank's expert adds nothing here,
no token moves: the activations are whole on every rank). Attention and MLP
then each give a partial sum of the layer's output: `AllReduced` adds the ranks' (one all-reduce
each per layer, as vLLM's row-parallel layers). Embedding, norms, the router and the LM head stay
whole on every rank, so every rank computes the same logits. A bias after an all-reduce is added by
rank 0 only. The model's spec then counts this rank's heads: the engine's KV cache and the method's
hooks see only them.

The model is loaded whole, then cut (each rank frees what it does not hold); loading each rank's
part straight from the checkpoint is left to do.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from kvc.runtime.distributed.group import HeadShards, TPGroup
from kvc.runtime.errors import ConfigError
from kvc.runtime.models.layers import Attention, GatedMLP

SUPPORTED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


class AllReduced(nn.Module):
    """A module whose output is one rank's partial sum: the ranks' outputs added (every rank gets the sum)."""

    def __init__(self, inner: nn.Module, tp: TPGroup) -> None:
        super().__init__()
        self.inner, self.tp = inner, tp

    def forward(self, *args):
        return self.tp.all_reduce(self.inner(*args))


def shard_model(model: nn.Module, tp: TPGroup, expert_parallel: bool = False) -> HeadShards:
    """Cuts `model` (loaded whole) to rank `tp.rank`'s part, in place; its spec then counts this rank's
    heads. Returns which heads it holds. `expert_parallel`: each rank keeps whole experts (an even share of
    them) rather than every expert's columns; a token's pairs routed elsewhere add nothing on this rank,
    and the all-reduce after the layer adds the ranks' (RoutedExperts.first_expert)."""
    spec = model.spec
    if spec.architecture not in SUPPORTED:
        raise ConfigError(f"tensor parallelism runs {', '.join(SUPPORTED)}; {spec.architecture} runs on one GPU "
                          "for now", param="tensor_parallel_size")
    shards = HeadShards(spec.num_heads, spec.num_kv_heads, tp.rank, tp.size)
    for layer in model.layers:
        _shard_attention(layer.self_attn, shards, tp.rank)
        layer.self_attn = AllReduced(layer.self_attn, tp)
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            _shard_gated(mlp, tp.rank, tp.size)
        elif hasattr(mlp, "experts"):
            (_split_experts if expert_parallel else _shard_experts)(mlp.experts, tp.rank, tp.size)
        else:
            raise ConfigError(f"tensor parallelism: {type(mlp).__name__} layers are not sharded yet",
                              param="tensor_parallel_size")
        layer.mlp = AllReduced(mlp, tp)
    model.spec = replace(spec, num_heads=len(shards.heads), num_kv_heads=len(shards.kv_heads))
    return shards


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    out.requires_grad_(False)
    return out


def _shard_attention(attn: Attention, shards: HeadShards, rank: int) -> None:
    d = attn.head_dim
    q_rows = [h * d + i for h in shards.heads for i in range(d)]
    kv_rows = [h * d + i for h in shards.kv_heads for i in range(d)]
    rows = torch.tensor(q_rows + [attn.q_size + r for r in kv_rows] + [attn.q_size + attn.kv_size + r for r in kv_rows],
                        device=attn.qkv_proj.weight.device)
    qkv = attn.qkv_proj
    attn.qkv_proj = _linear(qkv.weight.index_select(0, rows), None if qkv.bias is None else qkv.bias[rows])
    cols = torch.tensor(q_rows, device=attn.o_proj.weight.device)
    o = attn.o_proj
    attn.o_proj = _linear(o.weight.index_select(1, cols), None if o.bias is None or rank else o.bias)
    attn.num_heads, attn.num_kv_heads = len(shards.heads), len(shards.kv_heads)
    attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d


def _columns(size: int, rank: int, world: int, what: str) -> slice:
    if size % world:
        raise ConfigError(f"tensor_parallel_size={world} must divide the model's {what} ({size})",
                          param="tensor_parallel_size")
    return slice(rank * size // world, (rank + 1) * size // world)


def _shard_gated(mlp: GatedMLP, rank: int, world: int) -> None:
    i = mlp.intermediate_size
    cols = _columns(i, rank, world, "intermediate size")
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    rows = torch.cat([torch.arange(cols.start, cols.stop), torch.arange(i + cols.start, i + cols.stop)])
    rows = rows.to(gate_up.weight.device)
    mlp.gate_up_proj = _linear(gate_up.weight.index_select(0, rows),
                               None if gate_up.bias is None else gate_up.bias[rows])
    mlp.down_proj = _linear(down.weight[:, cols].contiguous(), None if down.bias is None or rank else down.bias)
    mlp.intermediate_size = cols.stop - cols.start


def _shard_experts(experts: nn.Module, rank: int, world: int) -> None:
    """Every expert's intermediate columns [i0, i1) (the router stays whole: every rank routes alike)."""
    if experts.fp8_block_columns:
        raise ConfigError("tensor parallelism over FP8 expert weights is not supported yet",
                          param="tensor_parallel_size")
    i = experts.intermediate_size
    cols = _columns(i, rank, world, "expert intermediate size")
    gate_up, down = experts.gate_up_proj.data, experts.down_proj.data
    experts.gate_up_proj = nn.Parameter(torch.cat([gate_up[:, cols], gate_up[:, i + cols.start:i + cols.stop]], dim=1)
                                        .contiguous(), requires_grad=False)
    experts.down_proj = nn.Parameter(down[:, :, cols].contiguous(), requires_grad=False)
    experts.intermediate_size = cols.stop - cols.start


def _split_experts(experts: nn.Module, rank: int, world: int) -> None:
    """Experts [e0, e1) whole (expert parallelism; the router stays whole: every rank routes alike)."""
    if experts.fp8_block_columns:
        raise ConfigError("expert parallelism over FP8 expert weights is not supported yet",
                          param="expert_parallel")
    keep = _columns(experts.num_experts, rank, world, "number of routed experts")
    experts.gate_up_proj = nn.Parameter(experts.gate_up_proj.data[keep].contiguous(), requires_grad=False)
    experts.down_proj = nn.Parameter(experts.down_proj.data[keep].contiguous(), requires_grad=False)
    experts.num_experts, experts.first_expert = keep.stop - keep.start, keep.start
