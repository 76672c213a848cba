"""A calibration pass: a model run over calibration sequences with plain causal attention, each layer's keys
and values handed to an observer (lowrank.py's second moments, offsets.py's means)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvc.runtime.models.base import plain_attention


def observe(model, batches: list[torch.Tensor], see: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
    """Runs `batches` of token ids (each one sequence from position 0) through `model`, calling `see(layer, k,
    v)` with each layer's keys (after RoPE) and values [T, Hkv, D], then attending causally over them."""

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        see(layer, k, v)
        group = q.shape[1] // k.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.repeat_interleave(group, 1).transpose(0, 1)[None],
            v.repeat_interleave(group, 1).transpose(0, 1)[None], is_causal=True)
        return out[0].transpose(0, 1).contiguous()

    with torch.no_grad():
        for ids in batches:
            model(ids, torch.arange(ids.shape[0], device=ids.device), plain_attention(attn))
