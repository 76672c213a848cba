"""A loaded model cut to one rank of a tensor-parallel group (docs/design.md, "Tensor parallelism").

Megatron's layout, for the decoders of runtime/models/llama.py and qwen3_moe.py: each rank keeps
its query heads and their KV heads (`HeadShards`; replicated where the model has fewer KV heads
than ranks) in the fused q/k/v projection, the matching columns of the output projection, a slice
of the MLP's (and of every expert's) intermediate columns in gate/up and down, or, with expert
parallelism, an even share of whole experts (a pair routed to another rank's expert adds nothing here,
no token moves: the activations are whole on every rank). Attention and MLP
then each give a partial sum of the layer's output: a forward hook all-reduces it (`all_reduced`;
one all-reduce each per layer, as vLLM's row-parallel layers; the parameters keep their names).
Embedding, norms, the router and the LM head stay whole on every rank, so every rank computes the
same logits. A bias after an all-reduce is added by rank 0 only. The model's spec then counts this
rank's heads: the engine's KV cache and the method's hooks see only them.

A checkpoint is cut before it is read: `shard_model` runs on the meta model (`empty_model`'s
transform), records which of the original rows or columns each cut parameter keeps (`ShardPlan`),
and `load_checkpoint` then reads only those into the rank's smaller parameters, so a rank allocates
and copies its part alone. A model built in memory (random weights) is cut after it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from kvc.runtime.distributed.group import HeadShards, TPGroup
from kvc.runtime.errors import ConfigError
from kvc.runtime.models.glm4_moe_lite import LatentAttention
from kvc.runtime.models.layers import Attention, GatedMLP

SUPPORTED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeLiteForCausalLM")
HOST = torch.device("cpu")  # the kept indices (the cut runs under the meta device's default)


@dataclass
class ShardPlan:
    """What a rank's cut parameters hold of the checkpoint's: the model's checkpoint layout before the
    cut (regions of the original parameters) and, per cut parameter, its original shape and the
    original indices it keeps along each cut axis, in its own order (`load_checkpoint` reads these)."""

    layout: object  # CheckpointLayout of the whole model
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    kept: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)  # parameters this rank does not hold (rank > 0's biases)


def shard_model(model: nn.Module, tp: TPGroup, expert_parallel: bool = False) -> HeadShards:
    """Cuts `model` to rank `tp.rank`'s part, in place; its spec then counts this rank's heads. Returns
    which heads it holds. On the meta device (before a checkpoint is read) it also leaves
    `model.shard_plan` for the loader. `expert_parallel`: each rank keeps whole experts (an even share
    of them) rather than every expert's columns; a token's pairs routed elsewhere add nothing on this
    rank, and the all-reduce after the layer adds the ranks' (RoutedExperts.first_expert)."""
    spec = model.spec
    if spec.architecture not in SUPPORTED:
        raise ConfigError(f"tensor parallelism runs {', '.join(SUPPORTED)}; {spec.architecture} runs on one GPU "
                          "for now", param="tensor_parallel_size")
    if getattr(model, "fp8_weights", None) is not None:
        raise ConfigError("tensor parallelism over FP8 weights is not supported yet", param="tensor_parallel_size")
    shards = HeadShards(spec.num_heads, spec.num_kv_heads, tp.rank, tp.size)
    layout = model.checkpoint_layout()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    cuts: list[tuple[nn.Parameter, dict[int, torch.Tensor]]] = []
    for layer in model.layers:
        attn = layer.self_attn
        cuts += (_shard_latent_attention if isinstance(attn, LatentAttention) else _shard_attention)(attn, shards,
                                                                                                      tp.rank)
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            cuts += _shard_gated(mlp, tp.rank, tp.size)
        elif hasattr(mlp, "experts"):
            cuts += (_split_experts if expert_parallel else _shard_experts)(mlp.experts, tp.rank, tp.size)
            if getattr(mlp, "shared_experts", None) is not None:  # (GLM's) by columns, as a dense MLP
                cuts += _shard_gated(mlp.shared_experts, tp.rank, tp.size)
            if hasattr(mlp, "reduce_pairs"):  # the all-reduce below sums [T, H], not each token's k expert rows
                mlp.reduce_pairs = True
        else:
            raise ConfigError(f"tensor parallelism: {type(mlp).__name__} layers are not sharded yet",
                              param="tensor_parallel_size")
        for part in (layer.self_attn, mlp):
            all_reduced(part, tp)
    model.spec = replace(spec, num_heads=len(shards.heads), num_kv_heads=len(shards.kv_heads))
    if next(model.parameters()).device.type == "meta":
        names = {id(p): name for name, p in model.named_parameters()}
        kept = {names[id(p)]: axes for p, axes in cuts}  # (the indices stay on the host)
        model.shard_plan = ShardPlan(layout, {name: shapes[name] for name in kept}, kept,
                                     set(shapes) - set(names.values()))
    return shards


def all_reduced(module: nn.Module, tp: TPGroup) -> None:
    """`module`'s output, one rank's partial sum, becomes the ranks' sum (every rank gets it)."""
    module.register_forward_hook(lambda _module, _args, out: tp.all_reduce(out))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    if weight.device.type != "meta":
        with torch.no_grad():
            out.weight.copy_(weight)
            if bias is not None:
                out.bias.copy_(bias)
    out.requires_grad_(False)
    return out


def _cut_linear(linear: nn.Linear, axis: int, index: torch.Tensor, bias: str) -> tuple[nn.Linear, list]:
    """`linear` keeping `index` [n] of its rows (axis 0) or columns (axis 1); its bias cut alike ("cut"), whole
    ("keep") or dropped ("drop": rank > 0 after an all-reduce). The new layer and its cuts."""
    at = index.to(linear.weight.device)
    b = linear.bias
    bias_value = None if b is None or bias == "drop" else b.index_select(0, at) if bias == "cut" else b
    out = _linear(linear.weight.index_select(axis, at), bias_value)
    cuts = [(out.weight, {axis: index})]
    if out.bias is not None and bias == "cut":
        cuts.append((out.bias, {0: index}))
    return out, cuts


def _shard_attention(attn: Attention, shards: HeadShards, rank: int) -> list:
    d = attn.head_dim
    q_rows = [h * d + i for h in shards.heads for i in range(d)]
    kv_rows = [h * d + i for h in shards.kv_heads for i in range(d)]
    rows = torch.tensor(q_rows + [attn.q_size + r for r in kv_rows] + [attn.q_size + attn.kv_size + r for r in kv_rows],
                        device=HOST)
    attn.qkv_proj, cuts = _cut_linear(attn.qkv_proj, 0, rows, "cut")
    attn.o_proj, more = _cut_linear(attn.o_proj, 1, torch.tensor(q_rows, device=HOST), "drop" if rank else "keep")
    attn.num_heads, attn.num_kv_heads = len(shards.heads), len(shards.kv_heads)
    attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
    return cuts + more


def _shard_latent_attention(attn: LatentAttention, shards: HeadShards, rank: int) -> list:
    """MLA: this rank's query heads' rows of the query and up projections and columns of the output one; the
    latent (`kv_a_proj_with_mqa`, its norm) and `q_a_proj` stay whole, so every rank stores the whole
    latent cache (its one KV head replicated)."""
    def rows(width: int) -> torch.Tensor:
        return torch.tensor([h * width + i for h in shards.heads for i in range(width)], device=HOST)

    name = "q_proj" if attn.q_lora_rank is None else "q_b_proj"
    query, cuts = _cut_linear(getattr(attn, name), 0, rows(attn.qk_dim), "cut")
    setattr(attn, name, query)
    attn.kv_b_proj, more = _cut_linear(attn.kv_b_proj, 0, rows(attn.nope_dim + attn.v_dim), "cut")
    attn.o_proj, out = _cut_linear(attn.o_proj, 1, rows(attn.v_dim), "drop" if rank else "keep")
    attn.num_heads = len(shards.heads)
    return cuts + more + out


def _columns(size: int, rank: int, world: int, what: str) -> slice:
    if size % world:
        raise ConfigError(f"tensor_parallel_size={world} must divide the model's {what} ({size})",
                          param="tensor_parallel_size")
    return slice(rank * size // world, (rank + 1) * size // world)


def _indices(part: slice) -> torch.Tensor:
    return torch.arange(part.start, part.stop, device=HOST)


def _gate_up_rows(cols: slice, intermediate: int) -> torch.Tensor:
    """The gate rows `cols` and the same up rows of a fused gate/up projection (gate rows first)."""
    return torch.cat([_indices(cols), intermediate + _indices(cols)])


def _shard_gated(mlp: GatedMLP, rank: int, world: int) -> list:
    i = mlp.intermediate_size
    cols = _columns(i, rank, world, "intermediate size")
    mlp.gate_up_proj, cuts = _cut_linear(mlp.gate_up_proj, 0, _gate_up_rows(cols, i), "cut")
    mlp.down_proj, more = _cut_linear(mlp.down_proj, 1, _indices(cols), "drop" if rank else "keep")
    mlp.intermediate_size = cols.stop - cols.start
    return cuts + more


def _cut_parameter(x: torch.Tensor, axis: int, index: torch.Tensor) -> tuple[nn.Parameter, list]:
    out = nn.Parameter(x.index_select(axis, index.to(x.device)).contiguous(), requires_grad=False)
    return out, [(out, {axis: index})]


def _shard_experts(experts: nn.Module, rank: int, world: int) -> list:
    """Every expert's intermediate columns [i0, i1) (the router stays whole: every rank routes alike)."""
    if experts.fp8_block_columns:
        raise ConfigError("tensor parallelism over FP8 expert weights is not supported yet",
                          param="tensor_parallel_size")
    i = experts.intermediate_size
    cols = _columns(i, rank, world, "expert intermediate size")
    experts.gate_up_proj, cuts = _cut_parameter(experts.gate_up_proj.data, 1, _gate_up_rows(cols, i))
    experts.down_proj, more = _cut_parameter(experts.down_proj.data, 2, _indices(cols))
    experts.intermediate_size = cols.stop - cols.start
    return cuts + more


def _split_experts(experts: nn.Module, rank: int, world: int) -> list:
    """Experts [e0, e1) whole (expert parallelism; the router stays whole: every rank routes alike)."""
    if experts.fp8_block_columns:
        raise ConfigError("expert parallelism over FP8 expert weights is not supported yet",
                          param="expert_parallel")
    keep = _columns(experts.num_experts, rank, world, "number of routed experts")
    index = _indices(keep)
    experts.gate_up_proj, cuts = _cut_parameter(experts.gate_up_proj.data, 0, index)
    experts.down_proj, more = _cut_parameter(experts.down_proj.data, 0, index)
    experts.num_experts, experts.first_expert = keep.stop - keep.start, keep.start
    return cuts + more
