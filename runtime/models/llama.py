"""Dense decoders: Llama 3 and Qwen3 (Qwen3 = Llama + per-head q/k RMSNorm).

Read top to bottom: a decoder layer is pre-norm attention then pre-norm MLP, each added to the
residual stream; the model is embedding -> layers -> final norm, with the LM head applied
separately (`compute_logits`) so the runner can project only the rows it samples from.
Qwen3-MoE (qwen3_moe.py) reuses all of this and swaps the MLP of its sparse layers; GLM-4.7-Flash
(glm4_moe_lite.py) reuses `PreNormLayer` and `DecoderLM`.

The residual stream travels beside the hidden states: a layer takes (hidden, residual) and returns
(its MLP output, residual), and each add happens in the norm after it (`RMSNorm.forward_add`, one
launch on CUDA for add and norm): the layer's input norm adds the previous layer's MLP output, its
post-attention norm the attention output, and the model's final norm the last MLP output. The sums
are those of `h = x + attn(norm(x)); h + mlp(norm(h))`, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvc.runtime.errors import UnsupportedArchitectureError
from kvc.runtime.models.base import AttentionFn, CausalLM, CheckpointLayout, ModelSpec
from kvc.runtime.models.layers import (
    Attention,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    check_activation,
    head_dim_of,
)
from kvc.runtime.models.rope import RopeSettings


class PreNormLayer(nn.Module):
    """A pre-norm decoder layer over the residual stream; a subclass builds `input_layernorm`, `self_attn`,
    `post_attention_layernorm` and `mlp`."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        attn: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, not yet added to `residual` (None at the first layer,
        where x is the embedding and becomes the stream). Returns (this MLP's output, residual), the
        stream updated in place; the next norm adds the output."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        h, residual = self.post_attention_layernorm.forward_add(self.self_attn(h, cos, sin, attn), residual)
        return self.mlp(h), residual


class DecoderLayer(PreNormLayer):
    def __init__(self, config: Any, layer_idx: int, qk_norm: bool, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp


class DecoderLM(CausalLM):
    """What every decoder here shares: embedding -> `layers` (each `(x, residual, cos, sin, attn) -> (x,
    residual)`, module docstring) -> final norm of the last sum, the LM head (tied or not), and the checkpoint
    names of that stack; a subclass builds `embed_tokens`, `rotary`, `layers` (each with `self_attn` and
    `mlp` that lay out their own tensors), `norm`, `lm_head`."""

    tie_word_embeddings: bool

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attn)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.forward_add(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        # into `out`: the head's output converted once, with no float32 temporary (a decode graph's 160 rows
        # x 151,936 logits: 97 MB written and read again)
        return logits.float() if out is None else out.copy_(logits)

    def checkpoint_layout(self) -> CheckpointLayout:
        layout = CheckpointLayout()
        layout.add("model.embed_tokens.weight", "embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            hf, kvc = f"model.layers.{i}", f"layers.{i}"
            layout.add(f"{hf}.input_layernorm.weight", f"{kvc}.input_layernorm.weight")
            layout.add(f"{hf}.post_attention_layernorm.weight", f"{kvc}.post_attention_layernorm.weight")
            layer.self_attn.add_to_layout(layout, f"{hf}.self_attn", f"{kvc}.self_attn")
            layer.mlp.add_to_layout(layout, f"{hf}.mlp", f"{kvc}.mlp")
        layout.add("model.norm.weight", "norm.weight")
        if self.lm_head is None:
            layout.ignored.add("lm_head.weight")
        else:
            layout.add("lm_head.weight", "lm_head.weight")
        return layout


class LlamaForCausalLM(DecoderLM):
    architecture = "LlamaForCausalLM"
    qk_norm = False

    def __init__(self, config: Any, spec: ModelSpec) -> None:
        super().__init__(config, spec)
        check_activation(config)
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedArchitectureError("sliding-window attention is not supported")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(RopeSettings.from_config(config), head_dim_of(config))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.qk_norm, self.make_mlp(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        bias = bool(getattr(config, "mlp_bias", False))
        return GatedMLP(config.hidden_size, config.intermediate_size, bias=bias)


class Qwen3ForCausalLM(LlamaForCausalLM):
    architecture = "Qwen3ForCausalLM"
    qk_norm = True
