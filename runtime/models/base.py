"""The seam between the engine and the model code.

The model runner hands a model one flat batch of new tokens (several sequences concatenated) and
an `AttentionFn`. The model does everything except attention itself: it projects, normalizes and
ropes q/k/v, then calls `attn(layer_idx, q, k, v)`, which is where the engine's KV cache and the
compiled KV-cache method live. This keeps the model files free of cache logic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# (layer_idx, q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim], v [T, num_kv_heads,
# value_dim]) -> out [T, num_heads, value_dim]. q and k arrive already normed and roped; the
# function owns everything else: causal masking per sequence, the softmax scale (the spec's
# `scale`), GQA head grouping, and the KV cache.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know about a model to size its KV memory and stop generation."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    # MLA's absorbed form (runtime/models/glm4_moe_lite.py): values are the first `value_dim` channels
    # of the keys (the latent), so the cache stores keys only; None: values are head_dim wide and stored
    latent_values: int | None = None
    # the softmax scale of q . k; None: head_dim ** -0.5
    attention_scale: float | None = None

    @property
    def value_dim(self) -> int:
        return self.latent_values or self.head_dim

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a kvc parameter, or a region of it.

    `index` selects the region (for fused q/k/v or gate/up rows, or one expert of a stacked
    expert tensor). `alternative` marks names that only some checkpoints use (e.g. fused expert
    tensors) so that "missing tensor" errors name the common layout.
    """

    param: str
    index: tuple[int | slice, ...] = ()
    alternative: bool = False
    # > 0: the tensor holds one row per this many rows of the region (FP8 block scales), repeated over them
    expand_rows: int = 0


@dataclass
class CheckpointLayout:
    """Every checkpoint tensor name a model accepts, mapped to where it goes."""

    targets: dict[str, Target] = field(default_factory=dict)
    # Names that may appear in a checkpoint and are deliberately dropped (e.g. a tied lm_head).
    ignored: set[str] = field(default_factory=set)

    def add(self, name: str, param: str, *index: int | slice, alternative: bool = False) -> None:
        self.targets[name] = Target(param, tuple(index), alternative)


class CausalLM(nn.Module):
    """Base class of kvc's decoder-only models.

    Subclasses build their modules in `__init__` from a transformers config without touching the
    weights' values (the loader builds them on the meta device and fills them from safetensors).
    """

    spec: ModelSpec
    # (parameters stored as FP8 codes, their format) of an FP8 checkpoint (runtime/models/fp8_weights.py)
    fp8_weights: tuple[set[str], Any] | None = None

    def __init__(self, config: Any, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec

    @classmethod
    def attention_shape(cls, config: Any) -> dict[str, Any]:
        """ModelSpec fields of the attention the model hands the engine where they differ from the
        config's heads (MLA: one latent KV head); {} for ordinary multi-head attention."""
        return {}

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final-normed hidden states [T, hidden]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        raise NotImplementedError

    def checkpoint_layout(self) -> CheckpointLayout:
        """The Hugging Face tensor names this model loads, and where each one goes."""
        raise NotImplementedError

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers after the module was materialized with `to_empty`."""
        for module in self.modules():
            if module is not self and isinstance(module, HasBuffers):
                module.init_buffers()


class HasBuffers(nn.Module):
    """A module whose buffers are computed, not loaded (rope frequencies)."""

    def init_buffers(self) -> None:
        raise NotImplementedError

