"""The model shape `kvc tune --model` tunes for: attention heads and head dim, MoE sizes, dtype.

Only the config is read (no weights): `random:NAME` is a named config
(runtime/models/named_configs.py), a directory its config.json, and no `--model` the embedded
default model. The engine's launches are then bucketed exactly as the tuner's (buckets.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvc.runtime.errors import ModelLoadError


@dataclass(frozen=True)
class MoeShape:
    experts: int
    top_k: int
    hidden: int
    inter: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_len: int  # max_position_embeddings: the largest context bucket a graph-captured decode uses
    moe: MoeShape | None


def _config(ref: str | None):
    from transformers import AutoConfig

    from kvc.runtime.models.loader import RANDOM_PREFIX, model_directory
    from kvc.runtime.models.named_configs import named_config

    path = model_directory(ref)  # None: a random:NAME shape
    if path is None:
        return named_config(ref[len(RANDOM_PREFIX):])
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json (pass a Hugging Face model directory, gguf:FILE or random:NAME)")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers raises many types; the user needs the message
        raise ModelLoadError(f"{path / 'config.json'}: transformers cannot read it: {err}") from None


def model_shape(ref: str | None, device: torch.device, dtype: torch.dtype | None = None) -> ModelShape:
    """The shape of model `ref` (None: the embedded default) in `dtype` (default: as served)."""
    from kvc.runtime.models.layers import head_dim_of
    from kvc.runtime.models.qwen3_moe import num_experts_of
    from kvc.runtime.models.registry import default_dtype

    config = _config(ref)
    heads = config.num_attention_heads
    experts = num_experts_of(config)
    moe = None
    if experts and getattr(config, "moe_intermediate_size", None):
        moe = MoeShape(experts, int(config.num_experts_per_tok), int(config.hidden_size),
                       int(config.moe_intermediate_size))
    return ModelShape(
        name=ref or "default",
        q_heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim_of(config),
        dtype=dtype or default_dtype(config, device),
        max_len=int(config.max_position_embeddings),
        moe=moe,
    )
