"""The model layers' in-place forms (runtime/models/layers.py, llama.py) give the bits of the
out-of-place expressions of the reference models, on the strided views the layers really see."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvc.runtime.models.layers import GatedMLP, RMSNorm, apply_rope


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_concatenated_rotation(dtype):
    g = gen(0)
    tokens, heads, dim = 37, 4, 16
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=g).to(dtype)
    x = qkv[:, : heads * dim].view(tokens, heads, dim)  # a strided view, as Attention passes it
    angles = torch.randn(tokens, dim // 2, generator=g)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    c, s = cos[:, None, :], sin[:, None, :]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    before = qkv.clone()
    got = apply_rope(x, cos, sin)
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(qkv, before)  # the input is left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_reference_formula(dtype):
    g = gen(1)
    norm = RMSNorm(24, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g))
    x = torch.randn(9, 24, generator=g).to(dtype)
    before = x.clone()
    x32 = x.float()
    want = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    with torch.inference_mode():
        got = norm(x)
    assert torch.equal(got, want)
    assert torch.equal(x, before)  # in float32 x.float() is x itself: it must not be scaled in place


def test_rms_norm_with_a_float32_weight_on_bfloat16_input_promotes():
    norm = RMSNorm(8, 1e-6)  # weight float32
    with torch.no_grad():
        norm.weight.fill_(1.5)
    x = torch.randn(3, 8, generator=gen(2)).bfloat16()
    assert norm(x).dtype == torch.float32


def test_gated_mlp_equals_silu_gate_times_up():
    g = gen(3)
    mlp = GatedMLP(20, 48)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(11, 20, generator=g)
    gate, up = F.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
    want = F.linear(F.silu(gate) * up, mlp.down_proj.weight)
    with torch.inference_mode():
        got = mlp(x)
    assert torch.equal(got, want)
