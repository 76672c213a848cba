"""Building blocks shared by kvc's decoder models: RMSNorm, rotary embedding, gated MLP, attention.

All tensors are flat over tokens ([T, ...]); there is no batch dimension. Numerics follow the
reference models so that logits match Hugging Face's: norms compute in float32 and cast back
before the weight multiply; cos/sin are computed in float32 and cast to the activation dtype.

On CUDA, RMSNorm (with the residual add in front of it, `RMSNorm.forward_add`), q/k norm + rotary and
the gated MLP's silu(gate) * up run as single Triton launches (norm_triton.py), the same steps in the
same dtypes; the CPU path below is the oracle.

`Attention` stops at the seam: it calls the engine's `AttentionFn` with roped q/k/v and applies
the output projection to what comes back.

Elementwise steps write into tensors they just made (in-place ops where the result is fresh, `out=`
halves in rope), so a prefill allocates fewer large tensors, each of which can cost page faults on the
CPU (docs/benchmarks.md, "CPU (embedded default model)"). The values are the same bits as the
out-of-place expressions of the reference models (the same operations in the same order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvc.runtime.errors import UnsupportedArchitectureError
from kvc.runtime.models.base import AttentionFn, CheckpointLayout, HasBuffers
from kvc.runtime.models.rope import RopeSettings, inverse_frequencies


def _fused():
    """The CUDA kernels of these layers (imports triton: only a CUDA forward asks)."""
    from kvc.runtime.models import norm_triton

    return norm_triton


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_activation(config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedArchitectureError(f"hidden_act={act!r} is not supported (only silu)")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.weight.dtype == x.dtype:
            return _fused().rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)  # a new tensor
        if self.weight.dtype != normed.dtype:  # weight * normed promotes: no in-place product
            return self.weight * normed
        return normed.mul_(self.weight)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add in front of the norm: `residual += x` (in place, the bits of `x + residual`),
        then (this norm of the sum, residual). x may be [T, k, N] parts over residual [T, N], added as their
        sum (an MoE layer's weighted expert rows, unreduced: `RoutedExperts.forward(reduce=False)`). On
        CUDA one launch for all; elsewhere the sum, the add, then `forward`."""
        parts = x.dim() == residual.dim() + 1
        fusable = self.weight.dtype == x.dtype == residual.dtype and residual.is_contiguous()
        if x.is_cuda and fusable and (parts or residual.shape == x.shape):
            return _fused().add_rms_norm(x, residual, self.weight, self.eps)
        if parts:
            x = sum_parts(x)
        residual.add_(x)
        return self(residual), residual


def sum_parts(x: torch.Tensor) -> torch.Tensor:
    """x [T, k, N] -> [T, N]: each row's k parts summed in order in float32, rounded to x's dtype (as
    `moe_triton`'s pair sum and the fused add + norm do)."""
    total = x[:, 0].to(torch.float32, copy=True)  # (a float32 x's own rows are not summed into)
    for j in range(1, x.shape[1]):
        total += x[:, j].float()
    return total.to(x.dtype)


class RotaryEmbedding(HasBuffers):
    """cos/sin for absolute positions, computed per step (no table, so no length limit)."""

    inv_freq: torch.Tensor

    def __init__(self, settings: RopeSettings, head_dim: int) -> None:
        super().__init__()
        self.settings = settings
        self.head_dim = head_dim
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        if not self.inv_freq.is_meta:
            self.init_buffers()

    def init_buffers(self) -> None:
        # Re-created rather than copied into: it must stay float32 when the model is bf16.
        self.inv_freq = inverse_frequencies(self.settings, self.head_dim).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, head_dim // 2] in `dtype`."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.float()[None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; rotates the pairs (i, i + head_dim/2) by the position's angles.
    Returns a new contiguous tensor: (x1 cos - x2 sin, x2 cos + x1 sin), each half computed in place."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = torch.empty(x.shape, dtype=torch.result_type(x, cos), device=x.device)
    first, second = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=first).sub_(x2 * sin)
    torch.mul(x2, cos, out=second).add_(x1 * sin)
    return out


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    # On the CPU, prefill-sized inputs run gate and up as two matmuls over the fused weight's
    # halves: oneDNN/MKL multiply [T, 576] x [576, 2 x 1536] 10-20% slower than twice x [576, 1536]
    # (SmolLM2, T = 2048, 1-2 threads; docs/benchmarks.md, "CPU"). Few rows (decode) stay fused.
    CPU_SPLIT_ROWS = 64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # silu(gate) * up in one launch over the fused output
            return self.down_proj(_fused().silu_mul(self.gate_up_proj(x)))
        if x.device.type == "cpu" and x.shape[0] > self.CPU_SPLIT_ROWS and isinstance(self.gate_up_proj, nn.Linear):
            i, w, b = self.intermediate_size, self.gate_up_proj.weight, self.gate_up_proj.bias
            gate = F.linear(x, w[:i], None if b is None else b[:i])
            up = F.linear(x, w[i:], None if b is None else b[i:])
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # silu(gate) * up in the gate's own buffer; down_proj reads a strided (fused) half as is
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))

    def add_to_layout(self, layout: CheckpointLayout, hf: str, kvc: str) -> None:
        i = self.intermediate_size
        kinds = ["weight"] + (["bias"] if self.down_proj.bias is not None else [])
        for kind in kinds:
            layout.add(f"{hf}.gate_proj.{kind}", f"{kvc}.gate_up_proj.{kind}", slice(0, i))
            layout.add(f"{hf}.up_proj.{kind}", f"{kvc}.gate_up_proj.{kind}", slice(i, 2 * i))
            layout.add(f"{hf}.down_proj.{kind}", f"{kvc}.down_proj.{kind}")


class Attention(nn.Module):
    """q/k/v projection (fused), optional per-head q/k RMSNorm (Qwen3), rope, the engine's
    attention, output projection."""

    def __init__(self, config: Any, layer_idx: int, qk_norm: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedArchitectureError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if q.is_cuda and self._fusable(q, cos):
            norms = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
            # v's contiguous copy in the same launch (the KV store reads it whole)
            q, k, v = _fused().norm_rope(q, k, *norms, self.q_norm.eps if self.q_norm else 0.0, cos, sin, v=v)
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _fusable(self, q: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether norm_triton.norm_rope computes this layer's q/k norms and rotary: a power-of-two
        half head, one dtype for q, cos and the norm weights."""
        half = self.head_dim // 2
        weights_ok = self.q_norm is None or self.q_norm.weight.dtype == self.k_norm.weight.dtype == q.dtype
        return half & (half - 1) == 0 and cos.dtype == q.dtype and weights_ok

    def add_to_layout(self, layout: CheckpointLayout, hf: str, kvc: str) -> None:
        q, kv = self.q_size, self.kv_size
        kinds = ["weight"] + (["bias"] if self.qkv_proj.bias is not None else [])
        for kind in kinds:
            layout.add(f"{hf}.q_proj.{kind}", f"{kvc}.qkv_proj.{kind}", slice(0, q))
            layout.add(f"{hf}.k_proj.{kind}", f"{kvc}.qkv_proj.{kind}", slice(q, q + kv))
            layout.add(f"{hf}.v_proj.{kind}", f"{kvc}.qkv_proj.{kind}", slice(q + kv, q + 2 * kv))
            layout.add(f"{hf}.o_proj.{kind}", f"{kvc}.o_proj.{kind}")
        if self.q_norm is not None:
            layout.add(f"{hf}.q_norm.weight", f"{kvc}.q_norm.weight")
            layout.add(f"{hf}.k_norm.weight", f"{kvc}.k_norm.weight")
