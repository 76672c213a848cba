"""Key offsets (`Quantized.offset`, runtime/kv/spec.py) for a model: each layer and KV head's mean key.

The mean, over calibration text, of the keys as the cache stores them (after RoPE), per layer and KV
head: what a store subtracts before it quantizes (docs/design.md, "Key offsets"). The model's keys
share a large part of it whatever the text (on SmolLM2-135M, a 4K mean from one text takes 50% of
another text's key energy, as much as that text's own mean), so one file serves every request.
"""

from __future__ import annotations

import torch

from kvc.runtime.calibrate.observe import observe


def key_means(model, batches: list[torch.Tensor]) -> torch.Tensor:
    """[layers, Hkv, D] float32: the mean key of each layer and KV head over `batches` of token ids (each one
    sequence from position 0), with plain causal attention in between, accumulated in float64."""
    sums: list[torch.Tensor] = []

    def see(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if len(sums) <= layer:
            sums.append(torch.zeros(k.shape[1:], dtype=torch.float64, device=k.device))
        sums[layer] += k.double().sum(0)

    observe(model, batches, see)
    return (torch.stack(sums) / sum(ids.shape[0] for ids in batches)).float().cpu()
