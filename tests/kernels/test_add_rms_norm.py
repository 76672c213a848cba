"""The fused residual add + RMSNorm kernel (runtime/models/norm_triton.py `add_rms_norm`, used on CUDA by
`RMSNorm.forward_add`) against the torch path it replaces, under TRITON_INTERPRET=1 on a CPU:
- the new residual is torch's `x + residual` bit for bit (float32, fp16; in bf16 the kernel's one
  float32 -> bf16 cast rounds to nearest even on a GPU, as torch does, but the interpreter's truncates, so
  there it is the truncated float32 sum, bit for bit);
- the normed rows are `RMSNorm` of that sum: in float32 up to the sum order, in 16 bits within a rounding
  or two. Rows of a decode and of a prefill chunk, a width that is not a power of two.
Also: every decoder family's CPU forward, which carries the residual stream apart, gives the bits of the
unfused layers; and the kernel compiles for sm90 (tests/kernels/sm90_compile_norm.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
pytest.importorskip("triton")
from kvc.runtime.models import norm_triton  # noqa: E402
from kvc.runtime.models.base import plain_attention  # noqa: E402
from kvc.runtime.models.layers import RMSNorm  # noqa: E402
from kvc.runtime.models.loader import build_random_model  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-2, rtol=2e-2),
       torch.float16: dict(atol=1e-2, rtol=1e-2)}


def same_sum(got: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> bool:
    """got is torch's `x + residual`, or in bf16 under the interpreter the float32 sum truncated to bf16."""
    if torch.equal(got, x + residual):
        return True
    if got.dtype != torch.bfloat16 or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    total = (x.float() + residual.float()).view(torch.int32)
    return torch.equal(got, (total & -(1 << 16)).view(torch.float32).bfloat16())


def torch_norm(weight: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], eps).to(weight.device, weight.dtype)
    norm.weight.data = weight.clone()
    return norm


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("tokens", [1, 7, 130])
@pytest.mark.parametrize("hidden", [64, 96])
@torch.no_grad()
def test_add_rms_norm_equals_the_add_then_the_norm(dtype, tokens, hidden) -> None:
    g = torch.Generator().manual_seed(tokens * 1000 + hidden)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype).to(DEVICE)
    residual = (torch.randn(tokens, hidden, generator=g) * 5).to(dtype).to(DEVICE)
    w = torch.randn(hidden, generator=g).to(dtype).to(DEVICE)
    want_sum = x + residual
    want = torch_norm(w, 1e-6)(want_sum)
    x_before, stream = x.clone(), residual.clone()
    got, got_sum = norm_triton.add_rms_norm(x, stream, w, 1e-6)
    assert got_sum is stream  # updated in place
    assert same_sum(got_sum, x, residual)
    assert torch.equal(x, x_before)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **TOL[dtype])


@torch.no_grad()
def test_a_strided_input_and_no_rows() -> None:
    g = torch.Generator().manual_seed(5)
    both = torch.randn(6, 2 * 96, generator=g).to(DEVICE)
    x = both[:, :96]  # a view with rows 192 apart
    residual = torch.randn(6, 96, generator=g).to(DEVICE)
    w = torch.randn(96, generator=g).to(DEVICE)
    want_sum = x + residual
    got, got_sum = norm_triton.add_rms_norm(x, residual.clone(), w, 1e-5)
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got, torch_norm(w, 1e-5)(want_sum), **TOL[torch.float32])
    empty = torch.empty(0, 96, device=DEVICE)
    got, got_sum = norm_triton.add_rms_norm(empty, empty.clone(), w, 1e-5)
    assert got.shape == (0, 96) and got_sum.shape == (0, 96)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("tokens", [1, 33])
@torch.no_grad()
def test_parts_summed_in_the_launch(dtype, tokens) -> None:
    """x [T, k, N] over residual [T, N] (an MoE layer's expert rows, unreduced): the residual add and norm of
    their sum, `sum_parts` (float32 in order, rounded to the dtype, as the experts' pair sum), bit for bit
    but for bf16 under the interpreter (whose casts truncate: within a rounding of the partial sums there,
    0.25 at their magnitude)."""
    from kvc.runtime.models.layers import sum_parts

    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, 8, 96, generator=g) * 3).to(dtype).to(DEVICE)
    residual = (torch.randn(tokens, 96, generator=g) * 5).to(dtype).to(DEVICE)
    w = torch.randn(96, generator=g).to(dtype).to(DEVICE)
    want, want_sum = norm_triton.add_rms_norm(sum_parts(x), residual.clone(), w, 1e-6)
    got, got_sum = norm_triton.add_rms_norm(x, residual.clone(), w, 1e-6)
    assert got.shape == got_sum.shape == (tokens, 96)
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        torch.testing.assert_close(got_sum.float().cpu(), want_sum.float().cpu(), atol=0.25, rtol=1e-2)
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **TOL[dtype])
    else:
        assert torch.equal(got_sum, want_sum) and torch.equal(got, want)
    # the torch path of `RMSNorm.forward_add` takes the same parts: the sum, the add, the norm
    norm = torch_norm(w.cpu(), 1e-6)
    cpu_sum = residual.cpu().clone()
    cpu_got, _ = norm.forward_add(x.cpu(), cpu_sum)
    assert torch.equal(cpu_sum, sum_parts(x.cpu()) + residual.cpu())
    assert torch.equal(cpu_got, norm(cpu_sum))
    with pytest.raises(ValueError, match="shaped like x"):
        norm_triton.add_rms_norm(x[:, :, :48], residual.clone(), w, 1e-6)


@torch.no_grad()
def test_forward_add_on_the_cpu_is_the_add_then_forward() -> None:
    """The torch path of `RMSNorm.forward_add`: the bits of `x + residual` and of `RMSNorm(x + residual)`."""
    g = torch.Generator().manual_seed(6)
    norm = torch_norm(torch.randn(40, generator=g).bfloat16(), 1e-6)
    x, residual = (torch.randn(9, 40, generator=g).bfloat16() for _ in range(2))
    want_sum = x + residual
    got, got_sum = norm.forward_add(x, residual)
    assert got_sum is residual and torch.equal(got_sum, want_sum)
    assert torch.equal(got, norm(want_sum))


# small shapes of each decoder family: dense Llama, Qwen3-MoE (sparse every other layer), GLM's MLA + experts
SMALL = {
    "llama3-8b": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen3-30b-a3b": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2),
    "glm-4.7-flash": dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=32),
}


@plain_attention  # an MLA model's absorbed outputs up-projected
def causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True).transpose(0, 1)


def unfused_forward(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The layers as written before the stream was carried apart: each add, then the next norm."""
    x = model.embed_tokens(ids)
    cos, sin = model.rotary(positions, x.dtype)
    for layer in model.layers:
        h = x + layer.self_attn(layer.input_layernorm(x), cos, sin, causal_attention)
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(SMALL))
@torch.no_grad()
def test_the_decoders_give_the_bits_of_the_unfused_layers(name, dtype) -> None:
    """The CPU path of every decoder family: the hidden states of x + attn(norm(x)), h + mlp(norm(h))."""
    model = build_random_model(name, "cpu", dtype, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                               vocab_size=256, **SMALL[name]).model
    g = torch.Generator().manual_seed(7)
    for norm in (m for m in model.modules() if isinstance(m, RMSNorm)):  # not all ones: each norm counts
        norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=g))
    ids, positions = torch.randint(0, 256, (11,), generator=g), torch.arange(11)
    got = model(ids, positions, causal_attention)
    assert torch.equal(got, unfused_forward(model, ids, positions))


def test_the_kernel_compiles_for_sm90() -> None:
    from tests.kernels.sm90 import compiles_for_sm90

    compiles_for_sm90("tests.kernels.sm90_compile_norm")
