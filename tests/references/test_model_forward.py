"""The reference model runner against plain Hugging Face runs of the same tiny checkpoints.

Decoding from a compressed cache is checked against Hugging Face's own eager attention over the
full prompt cache with the evicted (head, token) pairs masked out: the same attention, computed
another way, with ragged per-head lengths (Ada-KV) included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from tests.references.conftest import ARCHS
from tests.references.model_forward import compress, decode, greedy_compressed, prefill, run_compressed

_models: dict[Path, PreTrainedModel] = {}


def eager(path: Path) -> PreTrainedModel:
    if path not in _models:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        _models[path] = model.eval()
    return _models[path]


def ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_records_what_transformers_computes(arch: str, tiny_dirs: dict[str, Path]) -> None:
    model, prompt = eager(tiny_dirs[arch]), ids(23, seed=1)
    layers, logits = prefill(model, prompt)
    cache = DynamicCache()
    with torch.no_grad():
        out = model(prompt[None], past_key_values=cache, output_attentions=True)
    torch.testing.assert_close(logits, out.logits[0])
    assert len(layers) == model.config.num_hidden_layers
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, t in enumerate(layers):
        torch.testing.assert_close(t.k, cache.layers[layer].keys[0])
        torch.testing.assert_close(t.v, cache.layers[layer].values[0])
        # Post-RoPE queries: their causal attention is transformers' attention matrix.
        keys = t.k.repeat_interleave(group, dim=0)
        logits_qk = (t.q @ keys.transpose(1, 2)) * t.q.shape[-1] ** -0.5
        probs = logits_qk.masked_fill(torch.ones(23, 23, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        torch.testing.assert_close(probs, out.attentions[layer][0])


@pytest.mark.parametrize("arch", ARCHS)
def test_without_eviction_decoding_is_transformers(arch: str, tiny_dirs: dict[str, Path]) -> None:
    model, prompt, continuation = eager(tiny_dirs[arch]), ids(30, seed=2), ids(4, seed=3)
    run = run_compressed(model, prompt, continuation, "snapkv", budget=30, window=8)
    with torch.no_grad():
        full = model(torch.cat([prompt, continuation])[None]).logits[0]
    torch.testing.assert_close(run.logits, full[30:], rtol=1e-5, atol=1e-5)
    tokens, _ = greedy_compressed(model, prompt, 5, "streamingllm", budget=64)
    with torch.no_grad():
        generated = model.generate(prompt[None], max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert tokens.tolist() == generated[0, 30:].tolist()


CASES = {
    "streamingllm": {"budget": 20},
    "snapkv": {"budget": 20, "window": 8},
    "pyramidkv": {"budget": 20, "window": 4, "beta": 2},
    "h2o": {"budget": 20},
    "tova": {"budget": 20},
    "adakv": {"budget": 20, "window": 8},
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", CASES)
def test_compressed_decode_is_masked_full_attention(
    method: str, arch: str, tiny_dirs: dict[str, Path]
) -> None:
    model = eager(tiny_dirs[arch])
    length, new = 57, 3
    prompt, continuation = ids(length, seed=4), ids(new, seed=5)
    run = run_compressed(model, prompt, continuation, method, **CASES[method])
    assert sum(len(head) for head in run.kept[0]) < length * len(run.kept[0])

    # Same thing through transformers: the whole prompt cache, evicted pairs masked per head.
    cache = DynamicCache()
    with torch.no_grad():
        model(prompt[None], past_key_values=cache)
    num_heads = model.config.num_attention_heads
    group = num_heads // model.config.num_key_value_heads
    masks = []
    for kept in run.kept:
        mask = torch.zeros(num_heads, new, length + new)
        mask[:, :, length:] = torch.full((new, new), float("-inf")).triu(1)
        for head in range(num_heads):
            evicted = torch.ones(length, dtype=torch.bool)
            evicted[kept[head // group]] = False
            mask[head, :, :length][:, evicted] = float("-inf")
        masks.append(mask)
    # transformers passes one 4-D mask to every layer; run it per layer by swapping masks in.
    def use_mask(mask: torch.Tensor):
        return lambda module, args, kwargs: (args, {**kwargs, "attention_mask": mask[None]})

    hooks = [
        layer.self_attn.register_forward_pre_hook(use_mask(mask), with_kwargs=True)
        for layer, mask in zip(model.model.layers, masks)
    ]
    try:
        with torch.no_grad():
            positions = torch.arange(length, length + new)[None]
            out = model(continuation[None], past_key_values=cache, position_ids=positions)
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(run.logits, out.logits[0], rtol=1e-5, atol=1e-5)


def test_positions_continue_from_the_logical_length(tiny_dirs: dict[str, Path]) -> None:
    """Decoding at the compressed length instead gives other logits: the start position matters."""
    model, prompt, token = eager(tiny_dirs["qwen3"]), ids(40, seed=6), ids(1, seed=7)
    run = run_compressed(model, prompt, token, "streamingllm", budget=10)
    _, caches = compress(prefill(model, prompt)[0], "streamingllm", budget=10)
    at_compressed_length = decode(model, caches, token, start=10)
    assert not torch.allclose(run.logits, at_compressed_length, atol=1e-3)
