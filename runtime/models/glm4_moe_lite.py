"""GLM-4.7-Flash (`glm4_moe_lite`): multi-head latent attention (MLA) and routed experts with a shared one.

Attention is computed in the absorbed form, so what a token leaves in the KV cache is its latent, not
per-head keys and values (docs/design.md, "MLA"):
- a token's latent `c` = RMSNorm(the first `kv_lora_rank` of `kv_a_proj_with_mqa(x)`) and its RoPE key
  part `k_rope` (the other `qk_rope_head_dim`, roped), shared by every head;
- head h's query absorbs the key up-projection: `q_abs_h = W_UK_h^T q_nope_h` (W_UK_h: head h's
  `qk_nope_head_dim` rows of `kv_b_proj`), so q_nope_h . (W_UK_h c) = q_abs_h . c;
- the seam calls `attn(layer, q [T, heads, R + P], k [T, 1, R + P], v [T, 1, R])` with q = [q_abs, q_rope],
  k = [c, k_rope] and v = c (R = kv_lora_rank, P = qk_rope_head_dim): one KV head whose logits, scaled
  by `attention_scale` (qk_head_dim^-1/2, not (R + P)^-1/2), are exactly the decompressed model's;
- the output up-projects per head, o_h = W_UV_h (sum_t p_t c_t), then `o_proj`.
So a method's scores over these q and k are the decompressed model's attention probabilities. The call
also carries the decompressed operands (`LatentQueries`: q_nope, roped q_rope, W_UK, W_UV), so the engine
may attend a prefill chunk in the decompressed form instead (fewer FLOPs a pair; `--mla-prefill`) and
returns the up-projected values either way.

The MLP of a layer is dense (`mlp_layer_types[i] == "dense"`, or the first `first_k_dense_replace`) or a
mixture: a sigmoid router (float32) whose choice adds `e_score_correction_bias` and keeps the best
`topk_group` of `n_group` expert groups (each scored by its two best), the top-k weights from the
sigmoid scores (normalised when `norm_topk_prob`) times `routed_scaling_factor`; the routed experts run in
`RoutedExperts` (experts.py), plus the shared experts' gated MLP.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvc.runtime.errors import UnsupportedArchitectureError
from kvc.runtime.models.base import AttentionFn, CheckpointLayout, LatentQueries, ModelSpec
from kvc.runtime.models.experts import RoutedExperts
from kvc.runtime.models.fp8_weights import weight_of
from kvc.runtime.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope, check_activation
from kvc.runtime.models.llama import DecoderLM, PreNormLayer
from kvc.runtime.models.rope import RopeSettings


def mlp_is_sparse(config: Any, layer_idx: int) -> bool:
    types = getattr(config, "mlp_layer_types", None)
    if types:
        return types[layer_idx] == "sparse"
    return layer_idx >= int(getattr(config, "first_k_dense_replace", 0) or 0)


def attention_scale(config: Any) -> float:
    """qk_head_dim^-1/2, times YaRN's mscale^2 where the RoPE parameters ask for it (as the reference)."""
    scale = config.qk_head_dim ** -0.5
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """MLA in the absorbed form (module docstring)."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.interleaved = bool(getattr(config, "rope_interleave", False))
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        # [heads * (nope + v), rank]: per head, the key up-projection's rows then the value's
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, config.hidden_size, bias=bias)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:  # pairs (2i, 2i + 1) -> halves (i, i + d/2), as the reference reorders them
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        return apply_rope(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(-1, self.num_heads, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        up = weight_of(self.kv_b_proj, q.dtype).view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        w_uk, w_uv = up[:, : self.nope_dim], up[:, self.nope_dim:]  # [H, nope, R], [H, v, R]
        q_abs = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        q_rope = self._rope(q_rope, cos, sin)
        q = torch.cat([q_abs, q_rope], dim=-1)  # [T, H, R + P]
        k = torch.cat([latent, self._rope(k_rope[:, None], cos, sin)[:, 0]], dim=-1)[:, None]  # [T, 1, R + P]
        # the engine attends absorbed (decode) or decompressed (prefill) and up-projects: [T, H, v]
        values = attn(self.layer_idx, q, k, latent[:, None].contiguous(),
                      latent=LatentQueries(q_nope, q_rope, w_uk, w_uv))
        return self.o_proj(values.reshape(-1, self.num_heads * self.v_dim))

    def add_to_layout(self, layout: CheckpointLayout, hf: str, kvc: str) -> None:
        names = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        names += ["q_proj"] if self.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        for name in names:
            for kind, param in getattr(self, name).named_parameters():
                layout.add(f"{hf}.{name}.{kind}", f"{kvc}.{name}.{kind}")


class LatentMoE(nn.Module):
    """Routed experts with group-limited sigmoid routing, plus shared experts (module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.n_routed_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = bool(config.norm_topk_prob), float(config.routed_scaling_factor)
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.score_bias = nn.Parameter(torch.empty(self.num_experts, dtype=torch.float32), requires_grad=False)
        self.experts = RoutedExperts(self.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k], topk_weights [T, k] float32); past the float32 gate, on CUDA one
        launch (router_triton.py), elsewhere the torch ops below (the oracle)."""
        logits = F.linear(x.float(), self.gate.weight.float())
        if logits.is_cuda:
            from kvc.runtime.models import router_triton  # imports triton: only a CUDA forward asks

            return router_triton.sigmoid_topk(logits, self.score_bias, self.top_k, self.n_group, self.topk_group,
                                              self.norm_topk_prob, self.scaling)
        scores = logits.sigmoid()
        choice = scores + self.score_bias.float()
        groups = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1.0).bool()
        choice = choice.masked_fill(~keep[:, :, None].expand_as(groups).reshape(choice.shape), 0.0)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        return self.experts(x, ids, weights) + self.shared_experts(x)

    def add_to_layout(self, layout: CheckpointLayout, hf: str, kvc: str) -> None:
        layout.add(f"{hf}.gate.weight", f"{kvc}.gate.weight")
        layout.add(f"{hf}.gate.e_score_correction_bias", f"{kvc}.score_bias")
        self.experts.add_to_layout(layout, f"{hf}.experts", f"{kvc}.experts")
        self.shared_experts.add_to_layout(layout, f"{hf}.shared_experts", f"{kvc}.shared_experts")


class DecoderLayer(PreNormLayer):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LatentAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (LatentMoE(config) if mlp_is_sparse(config, layer_idx)
                    else GatedMLP(config.hidden_size, config.intermediate_size))


class Glm4MoeLiteForCausalLM(DecoderLM):
    architecture = "Glm4MoeLiteForCausalLM"

    @classmethod
    def attention_shape(cls, config: Any) -> dict[str, Any]:
        """One latent KV head of `kv_lora_rank + qk_rope_head_dim` channels, the values its first
        `kv_lora_rank`, scaled as the decompressed heads are (module docstring)."""
        return {"num_kv_heads": 1, "head_dim": config.kv_lora_rank + config.qk_rope_head_dim,
                "latent_values": config.kv_lora_rank, "attention_scale": attention_scale(config)}

    def __init__(self, config: Any, spec: ModelSpec) -> None:
        super().__init__(config, spec)
        check_activation(config)
        if config.num_attention_heads != (getattr(config, "num_key_value_heads", None) or config.num_attention_heads):
            raise UnsupportedArchitectureError("MLA with grouped query heads is not supported")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.kv_lora_rank, self.qk_rope_head_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.attention_scale = attention_scale(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(RopeSettings.from_config(config), config.qk_rope_head_dim)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                        bias=False)
