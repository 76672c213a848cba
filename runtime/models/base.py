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
# value_dim], latent=None) -> out [T, num_heads, value_dim]. q and k arrive already normed and roped;
# the function owns everything else: causal masking per sequence, the softmax scale (the spec's
# `scale`), GQA head grouping, and the KV cache. An MLA model also passes `latent` (LatentQueries);
# then out is the up-projected values [T, num_heads, latent.value_dim].
AttentionFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class LatentQueries:
    """MLA's decompressed operands beside the absorbed q of an `AttentionFn` call (docs/design.md, "MLA").

    The absorbed call attends q = [W_UK^T q_nope, q_rope] over the latents [c, k_rope] and gets
    sum_t p_t c_t per head; the decompressed form attends [q_nope, q_rope] over per-head keys
    [W_UK c, k_rope] and values W_UV c, with the same logits, and is the cheaper prefill (256 + 256
    channels a pair at GLM-4.7-Flash's shape against 576 + 512). Either way the function returns
    the values W_UV (sum_t p_t c_t) [T, heads, value_dim]."""

    q_nope: torch.Tensor  # [T, heads, nope]
    q_rope: torch.Tensor  # [T, heads, rope], roped
    w_uk: torch.Tensor  # [heads, nope, rank]: head h's key up-projection
    w_uv: torch.Tensor  # [heads, value_dim, rank]: head h's value up-projection

    @property
    def rank(self) -> int:
        return self.w_uk.shape[-1]

    @property
    def value_dim(self) -> int:
        return self.w_uv.shape[1]

    def rows(self, start: int, end: int) -> LatentQueries:
        """The queries of rows [start, end) (the weights are shared)."""
        return LatentQueries(self.q_nope[start:end], self.q_rope[start:end], self.w_uk, self.w_uv)

    def values(self, out: torch.Tensor) -> torch.Tensor:
        """Absorbed outputs [n, heads, rank] (sum_t p_t c_t) up-projected: [n, heads, value_dim]."""
        return torch.einsum("thr,hvr->thv", out, self.w_uv.to(out.dtype))

    def queries(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end)'s decompressed queries [n, heads, nope + rope]."""
        return torch.cat([self.q_nope[start:end], self.q_rope[start:end]], dim=-1)

    def keys_values(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored latents [L, rank + rope] ([c, k_rope]) as per-head keys [L, heads, nope + rope] and values
        [L, heads, value_dim]."""
        c, k_rope = latents.split([self.rank, latents.shape[-1] - self.rank], dim=-1)
        w_uk, w_uv = self.w_uk.to(c.dtype), self.w_uv.to(c.dtype)
        keys = torch.einsum("lr,hnr->lhn", c, w_uk)
        keys = torch.cat([keys, k_rope[:, None].expand(-1, keys.shape[1], -1)], dim=-1)
        return keys, torch.einsum("lr,hvr->lhv", c, w_uv)


def plain_attention(attn: AttentionFn) -> AttentionFn:
    """`attn` taking no `latent` as an `AttentionFn` (its absorbed outputs up-projected where one is passed)."""

    def call(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             latent: LatentQueries | None = None) -> torch.Tensor:
        out = attn(layer, q, k, v)
        return out if latent is None else latent.values(out)

    return call


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

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32; into `out` ([N, vocab] float32) where given."""
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

