"""Run NVIDIA kvpress (oracle 3) on a Hugging Face model and read back what it kept.

kvpress compresses each layer's `DynamicCache` in a forward hook at the end of prefill. We read
its decision without relying on its internals beyond the public cache:
- score-and-prune presses (`ScorerPress` subclasses) gather the kept K/V rows out of the cache,
  in top-k order; a forward hook registered before the press's hook copies each layer's keys
  before compression, and every compressed key row is matched to the one equal original row
  (keys of a random model are distinct; a row matching zero or two originals fails loudly);
- `AdaKVPress` keeps the cache whole and records the pruned (batch, head, token) triples in
  `module.masked_key_indices`, masking them at decode with fake keys; kept = the complement.
Then the continuation tokens run through the model with the compressed cache, one per forward,
at positions T, T+1, ... (as kvpress's pipeline does), giving the logits to compare.

kvpress is imported by the caller (tests skip without it): importing it wraps transformers'
registered attention functions (for Ada-KV masking) for the whole process.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel


def _attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def _match_rows(compressed: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Token index of each compressed key row [n, D] among the original keys [T, D], ascending."""
    equal = (compressed[:, None, :] == original[None, :, :]).all(dim=-1)
    matches = equal.sum(dim=1)
    if not bool((matches == 1).all()):
        raise AssertionError(f"compressed keys match {matches.tolist()} original rows, expected 1 each")
    return equal.int().argmax(dim=1).sort().values


def run_press(
    model: PreTrainedModel, press: Any, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor
) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """kvpress's kept indices [layer][kv head] and the continuation's logits [n, vocab]."""
    modules = _attention_modules(model)
    original: dict[int, torch.Tensor] = {}

    def copy_keys(module: torch.nn.Module, args: Any, kwargs: dict, output: Any) -> None:
        original[module.layer_idx] = kwargs["past_key_values"].layers[module.layer_idx].keys[0].clone()

    for module in modules:
        module.masked_key_indices = None  # left over from an earlier Ada-KV run on this model
    hooks = [module.register_forward_hook(copy_keys, with_kwargs=True) for module in modules]
    cache = DynamicCache()
    try:
        with torch.no_grad(), press(model):
            model.model(input_ids=prompt_ids[None], past_key_values=cache)
    finally:
        for hook in hooks:
            hook.remove()

    kept = []
    for layer, module in enumerate(modules):
        keys = original[layer]
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            _, heads, tokens = masked
            keep = torch.ones(keys.shape[:2], dtype=torch.bool)
            keep[heads, tokens] = False
            kept.append([keep[h].nonzero().flatten() for h in range(keys.shape[0])])
        else:
            compressed = cache.layers[layer].keys[0]
            kept.append([_match_rows(compressed[h], keys[h]) for h in range(keys.shape[0])])

    # One token per forward: Hugging Face sizes the attention mask of a multi-token step by layer
    # 0's cache length, which breaks once layers keep different lengths (PyramidKV).
    logits = []
    with torch.no_grad():
        for step, token in enumerate(continuation_ids.tolist()):
            position = torch.tensor([[prompt_ids.numel() + step]])
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=position)
            logits.append(out.logits[0, -1].float())
    return kept, torch.stack(logits)


def capture_scores(press: Any) -> list[torch.Tensor]:
    """Make `press` record the scores it ranks by, one [Hkv, T] tensor per layer."""
    recorded: list[torch.Tensor] = []
    score = press.score

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        scores = score(*args, **kwargs)
        recorded.append(scores[0].clone())
        return scores

    press.score = recording
    return recorded
