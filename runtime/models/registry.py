"""Which kvc class serves which Hugging Face architecture, and how an empty model is built.

Both the checkpoint loader and the random-weight mode start here: pick the class, describe the
model (`ModelSpec`), and allocate it on the target device without running any initializer (the
module is built on the meta device, then given uninitialized memory where it will live).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from kvc.runtime.errors import UnsupportedArchitectureError
from kvc.runtime.models.base import CausalLM, ModelSpec
from kvc.runtime.models.layers import head_dim_of
from kvc.runtime.models.glm4_moe_lite import Glm4MoeLiteForCausalLM
from kvc.runtime.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from kvc.runtime.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM,
}
# For configs without an `architectures` list.
MODEL_TYPES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "glm4_moe_lite": Glm4MoeLiteForCausalLM,
}


@dataclass
class LoadedModel:
    model: CausalLM
    spec: ModelSpec
    hf_config: Any  # transformers.PretrainedConfig
    path: Path | None  # None for random-weight models

    @cached_property
    def tokenizer(self):
        """The directory's tokenizer (None without one), loaded once for every engine over this model."""
        from kvc.runtime.tokenizer import load_tokenizer

        return None if self.path is None else load_tokenizer(self.path)


def model_class_for(architectures: Iterable[str] | str | None, model_type: str | None) -> type[CausalLM]:
    names = [architectures] if isinstance(architectures, str) else [str(a) for a in architectures or []]
    for name in names:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    if not names and model_type in MODEL_TYPES:
        return MODEL_TYPES[str(model_type)]
    what = ", ".join(names) if names else f"model_type {model_type!r}"
    raise UnsupportedArchitectureError(
        f"architecture {what} is not supported; supported architectures: {', '.join(MODEL_CLASSES)}"
    )


def model_class_for_config(config: Any) -> type[CausalLM]:
    return model_class_for(getattr(config, "architectures", None), getattr(config, "model_type", None))


def eos_ids_of(*sources: Mapping[str, Any] | Any) -> tuple[int, ...]:
    """Union (in order) of the eos_token_id fields of configs / generation configs."""
    ids: list[int] = []
    for source in sources:
        if isinstance(source, Mapping):
            value = source.get("eos_token_id")
        else:
            value = getattr(source, "eos_token_id", None)
        values = value if isinstance(value, (list, tuple)) else [value]
        ids.extend(int(v) for v in values if v is not None and int(v) not in ids)
    return tuple(ids)


def config_dtype(config: Any) -> torch.dtype | None:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def default_dtype(config: Any, device: torch.device) -> torch.dtype:
    """float32 on CPU; the checkpoint's dtype (bfloat16 if unstated) on accelerators."""
    if device.type == "cpu":
        return torch.float32
    return config_dtype(config) or torch.bfloat16


def make_spec(cls: type[CausalLM], config: Any, dtype: torch.dtype, eos: tuple[int, ...]) -> ModelSpec:
    num_heads = config.num_attention_heads
    fields = dict(
        architecture=getattr(cls, "architecture", cls.__name__),
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim_of(config),
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        eos_token_ids=eos,
        dtype=dtype,
    )
    return ModelSpec(**{**fields, **cls.attention_shape(config)})


def empty_model(
    config: Any, device: torch.device, dtype: torch.dtype, eos: tuple[int, ...],
    transform: Callable[[CausalLM], None] | None = None,
) -> CausalLM:
    """The model for `config` with uninitialized weights in `dtype` on `device`; `transform` changes it on
    the meta device first, after the cast (FP8 weights: runtime/models/fp8_weights.py)."""
    cls = model_class_for_config(config)
    spec = make_spec(cls, config, dtype, eos)
    with torch.device("meta"):
        model = cls(config, spec).to(dtype)
        if transform is not None:
            transform(model)
    model = model.to_empty(device=device)
    model.init_buffers()
    return model.eval().requires_grad_(False)
