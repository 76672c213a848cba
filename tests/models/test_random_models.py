"""Random-weight models of published shapes (benchmark mode) and the grouped expert computation."""

from __future__ import annotations

import pytest
import torch

from kvc.runtime.errors import ModelLoadError
from kvc.runtime.models.experts import RoutedExperts, grouped_linear
from kvc.runtime.models.layers import RMSNorm
from kvc.runtime.models.loader import build_random_model, resolve_model
from kvc.runtime.models.named_configs import NAMED_CONFIGS
from kvc.runtime.models.qwen3_moe import SparseMoeBlock

# Published parameter counts (billions, embeddings included), to 2 decimals.
PUBLISHED_PARAMS = {"qwen3-0.6b": 0.60, "qwen3-8b": 8.19, "qwen3-30b-a3b": 30.53, "llama3-8b": 8.03}


@pytest.mark.parametrize("name", sorted(NAMED_CONFIGS))
def test_named_configs_build_on_meta(name: str) -> None:
    loaded = build_random_model(name, "meta")
    params = sum(p.numel() for p in loaded.model.parameters())
    if name in PUBLISHED_PARAMS:
        assert round(params / 1e9, 2) == PUBLISHED_PARAMS[name]
    assert loaded.spec.dtype == torch.bfloat16 and loaded.path is None


def test_qwen3_30b_a3b_shapes() -> None:
    spec = build_random_model("qwen3-30b-a3b", "meta").spec
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (48, 32, 4, 128)
    assert (spec.hidden_size, spec.vocab_size, spec.max_position_embeddings) == (2048, 151936, 40960)
    model = build_random_model("qwen3-30b-a3b", "meta", num_hidden_layers=1).model
    moe = model.layers[0].mlp
    assert isinstance(moe, SparseMoeBlock) and moe.top_k == 8 and moe.norm_topk_prob
    assert tuple(moe.experts.gate_up_proj.shape) == (128, 2 * 768, 2048)


def test_random_qwen3_06b_on_cpu_in_bf16() -> None:
    # Full 0.6B takes ~10 s on two cores; one layer and a small vocab keep every other shape.
    loaded = build_random_model("qwen3-0.6b", "cpu", torch.bfloat16, num_hidden_layers=1, vocab_size=4096)
    model = loaded.model
    assert model.lm_head is None  # tied, as published
    weight = model.layers[0].self_attn.qkv_proj.weight
    assert weight.dtype == torch.bfloat16 and weight.shape == (16 * 128 + 2 * 8 * 128, 1024)
    assert 0.015 < weight.float().std().item() < 0.025
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(bool((n == 1).all()) for n in norms)
    ids = torch.tensor([1, 2, 3])
    out = model(ids, torch.arange(3), lambda i, q, k, v: v.repeat_interleave(2, dim=1))
    assert torch.isfinite(model.compute_logits(out)).all()
    again = build_random_model("qwen3-0.6b", "cpu", torch.bfloat16, num_hidden_layers=1, vocab_size=4096)
    assert torch.equal(again.model.embed_tokens.weight, model.embed_tokens.weight)


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ModelLoadError) as err:
        resolve_model("random:qwen9-1t")
    assert "qwen9-1t" in str(err.value)
    for name in ("qwen3-8b", "qwen3-30b-a3b", "qwen3-0.6b", "llama3-8b"):
        assert name in str(err.value)


def test_resolve_random() -> None:
    assert resolve_model("random:llama3-8b", "meta").spec.vocab_size == 128256


def test_grouped_linear_implementations_agree() -> None:
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 16, generator=gen)
    w = torch.randn(4, 8, 16, generator=gen)
    want = torch.cat([x[i : i + n] @ w[e].T for e, (i, n) in enumerate(zip([0, 3, 3, 8], counts.tolist()))])
    torch.testing.assert_close(grouped_linear(x, w, counts, "loop"), want)
    if hasattr(torch, "_grouped_mm"):
        torch.testing.assert_close(grouped_linear(x, w, counts, "grouped_mm"), want)


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_routed_experts_match_per_token_reference(impl: str) -> None:
    if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    gen = torch.Generator().manual_seed(0)
    experts = RoutedExperts(num_experts=6, hidden_size=16, intermediate_size=8)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(6, 16, 16, generator=gen))
        experts.down_proj.copy_(torch.randn(6, 16, 8, generator=gen))
    experts.impl = impl  # type: ignore[assignment]
    x = torch.randn(11, 16, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(11)])
    weights = torch.rand(11, 3, generator=gen)
    want = torch.zeros(11, 16)
    for t in range(11):  # the definition, one token and one expert at a time
        for j in range(3):
            e = int(ids[t, j])
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    with torch.no_grad():
        torch.testing.assert_close(experts(x, ids, weights), want, atol=1e-4, rtol=1e-5)
