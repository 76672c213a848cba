"""Rotary position embedding: reading its settings from a config, and its frequencies.

Configs spell rope two ways. transformers 5 keeps everything in `config.rope_parameters`
(`{"rope_theta": ..., "rope_type": "llama3", "factor": ...}`, possibly one dict per layer type);
older configs and many config.json files on the hub use `rope_theta` plus a `rope_scaling` dict
(whose type key is `rope_type` or the older `type`). `RopeSettings.from_config` accepts both.

Supported types: "default" (plain RoPE) and "llama3" (Llama 3.1's frequency-dependent
interpolation: long wavelengths divided by `factor`, short ones kept, a smooth blend between).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvc.runtime.errors import UnsupportedArchitectureError

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeSettings:
    theta: float
    rope_type: str = "default"
    # llama3 scaling only
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_config(cls, config: Any) -> RopeSettings:
        params = _rope_dict(config)
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
        theta = 10000.0 if theta is None else float(theta)
        rope_type = params.get("rope_type", params.get("type")) or "default"
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
        if partial not in (None, 1, 1.0):
            raise UnsupportedArchitectureError(
                f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported"
            )
        if rope_type == "default":
            return cls(theta=theta)
        if rope_type == "llama3":
            try:
                return cls(
                    theta=theta,
                    rope_type="llama3",
                    factor=float(params["factor"]),
                    low_freq_factor=float(params["low_freq_factor"]),
                    high_freq_factor=float(params["high_freq_factor"]),
                    original_max_position_embeddings=int(
                        params.get("original_max_position_embeddings")
                        or config.max_position_embeddings
                    ),
                )
            except KeyError as missing:
                raise UnsupportedArchitectureError(
                    f"llama3 rope scaling needs {missing} in rope_parameters/rope_scaling"
                ) from None
        raise UnsupportedArchitectureError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )


def _rope_dict(config: Any) -> Mapping[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, Mapping):
        raise UnsupportedArchitectureError(f"rope parameters must be a dict, got {params!r}")
    nested = [v for v in params.values() if isinstance(v, Mapping)]
    if nested:
        # One dict per layer type (transformers 5 models with mixed attention). kvc models use a
        # single rope for all layers, so every layer type must agree.
        if any(v != nested[0] for v in nested):
            raise UnsupportedArchitectureError("different rope settings per layer type are not supported")
        return nested[0]
    return params


def inverse_frequencies(settings: RopeSettings, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 angular frequencies (computed on CPU, so identical everywhere)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (settings.theta**exponents)
    if settings.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, settings)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeSettings) -> torch.Tensor:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    # Between the two wavelengths, blend linearly in 1/wavelength.
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)
