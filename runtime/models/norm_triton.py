"""A decoder layer's small steps as single Triton launches on CUDA (layers.py calls them there; the
CPU keeps the torch path, the parity oracle).

- `rms_norm`: RMSNorm of each row, one launch instead of eight (float copy, square, mean, add,
  rsqrt, multiply, cast, weight).
- `add_rms_norm`: the residual add in front of a norm, `residual += x` then RMSNorm of the sum, one
  launch that writes both (the decoder layers carry the residual stream apart: llama.py); x may be an MoE
  layer's k weighted expert rows per token, summed in the same launch.
- `norm_rope`: q and k of a step together: the per-head RMSNorm of Qwen3 (when it has one) and the
  rotary embedding, one launch instead of about thirty.
- `silu_mul`: the gated MLP's `silu(gate) * up` over the fused gate_up matmul's output, one launch
  instead of two (silu, then the product).

The arithmetic follows layers.py step by step, rounding to the activation dtype where it does (the
normalised value before the weight, each rotary product, each sum), so the results are those of
the torch path up to the order of the float32 sum of squares and the hardware rsqrt (`silu_mul` gives
its bits: the same expf and an IEEE division on CUDA). A decode
step of a 48-layer model ran ~1,900 of these small launches (docs/benchmarks.md, "fused RMSNorm").
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from kvc.runtime.primitives.pdl import gate as pdl_gate
from kvc.runtime.primitives.pdl import options as pdl_options


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis of x [..., N] (weight [N] in x's dtype): a new tensor like x."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), n, eps, BLOCK=block,
                                           num_warps=max(1, min(8, block // 256)), **pdl_options(x.device))
    return out.view(x.shape)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, N, eps, BLOCK: tl.constexpr,
                         PARTS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dt = res_ptr.dtype.element_ty
    if PARTS == 1:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    else:  # x's row is the sum of PARTS rows (a token's weighted expert rows), in order, rounded as a tensor's
        x = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(PARTS):
            x += tl.load(x_ptr + (row * PARTS + j) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(dt).to(tl.float32)
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    # the sum rounded to the activation dtype, as torch's add: float32 holds a sum of two bf16 or fp16
    # values closely enough that rounding it once more (to nearest even on a GPU; the interpreter's cast
    # to bf16 truncates) gives the correctly rounded sum
    total = (x + r).to(dt)
    tl.store(res_ptr + row * stride_r + cols, total, mask=mask)
    s = total.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / N + eps)
    normed = (s * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x`, then RMSNorm of the sum over the last axis: (normed, residual). x and residual
    [..., N] of one dtype (weight [N] too); residual must be contiguous and is updated in place (the
    bits of torch's `x + residual`); normed is a new tensor like residual. x may also be [T, k, N] over
    residual [T, N]: parts whose sum (in order, in float32, rounded to the dtype) is added (an MoE layer's
    weighted expert rows, `moe_triton.fused_experts(reduce=False)`: the sum's launch and its round trip
    through memory saved)."""
    n = x.shape[-1]
    parts = x.shape[1] if x.dim() == 3 and residual.dim() == 2 and x.shape[::2] == residual.shape else 1
    if (parts == 1 and residual.shape != x.shape) or not residual.is_contiguous():
        raise ValueError(f"residual {tuple(residual.shape)} must be contiguous and shaped like x {tuple(x.shape)}"
                         " (or x [T, k, N] over residual [T, N])")
    rows, res_rows = x.reshape(-1, n), residual.view(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(res_rows.shape, dtype=x.dtype, device=x.device)
    if res_rows.shape[0]:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(res_rows.shape[0],)](rows, res_rows, weight, out, rows.stride(0), res_rows.stride(0),
                                                   out.stride(0), n, eps, BLOCK=block, PARTS=parts,
                                                   num_warps=max(1, min(8, block // 256)), **pdl_options(x.device))
    return out.view(residual.shape), residual


@triton.jit
def _rope_half(x1, x2, c, s, DT: tl.constexpr):
    # (x1 cos - x2 sin, x2 cos + x1 sin), each product and sum rounded to DT as the torch path does
    a = (x1 * c).to(DT).to(tl.float32) - (x2 * s).to(DT).to(tl.float32)
    b = (x2 * c).to(DT).to(tl.float32) + (x1 * s).to(DT).to(tl.float32)
    return a.to(DT), b.to(DT)


NORM_ROPE_TOKENS = 16  # tokens of one head a norm_rope program takes (one program per token and head ran
# 295K one-warp programs for an 8K-token prefill chunk: ~4x its bytes' time on an H200)


@triton.jit
def _norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, vo_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, T, HQ, HKV, eps,
                      D: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                      PDL: tl.constexpr = False):
    pdl_gate(PDL)
    # a program: BLOCK_T tokens of one head (a prefill chunk's thousands of tokens in few programs); heads
    # [0, HQ) are q's, [HQ, HQ + HKV) k's, and past them (where the launch has them) v's, copied as they are
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    h = tl.program_id(1)
    i = tl.arange(0, HALF)[None, :]
    rows = t < T
    if h >= HQ + HKV:
        hv = h - HQ - HKV
        src = v_ptr + t * stride_vt + hv * stride_vh + i
        dst = vo_ptr + (t * HKV + hv) * D + i
        tl.store(dst, tl.load(src, mask=rows), mask=rows)
        tl.store(dst + HALF, tl.load(src + HALF, mask=rows), mask=rows)
    else:
        if h < HQ:
            src, w_ptr = q_ptr + t * stride_qt + h * stride_qh + i, qw_ptr
            dst = qo_ptr + (t * HQ + h) * D + i
        else:
            hk = h - HQ
            src, w_ptr = k_ptr + t * stride_kt + hk * stride_kh + i, kw_ptr
            dst = ko_ptr + (t * HKV + hk) * D + i
        dt = qo_ptr.dtype.element_ty
        x1 = tl.load(src, mask=rows, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=rows, other=0.0).to(tl.float32)
        if NORM:
            r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
            x1 = ((x1 * r).to(dt).to(tl.float32) * tl.load(w_ptr + i).to(tl.float32)).to(dt).to(tl.float32)
            x2 = ((x2 * r).to(dt).to(tl.float32) * tl.load(w_ptr + HALF + i).to(tl.float32)).to(dt).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_ct + i, mask=rows, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_ct + i, mask=rows, other=0.0).to(tl.float32)
        a, b = _rope_half(x1, x2, c, s, dt)
        tl.store(dst, a, mask=rows)
        tl.store(dst + HALF, b, mask=rows)


def norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
              eps: float, cos: torch.Tensor, sin: torch.Tensor, v: torch.Tensor | None = None):
    """q [T, Hq, D], k [T, Hkv, D] (views with a contiguous last axis; weights [D] or both None;
    cos, sin [T, D / 2] in q's dtype) -> new contiguous (q, k), normalised per head and rotated; with
    `v` [T, Hkv, D] (a view as k), also a contiguous copy of it, in the same launch: (q, k, v)."""
    tokens, hq, d = q.shape
    hkv = k.shape[1]
    qo = torch.empty((tokens, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((tokens, hkv, d), dtype=k.dtype, device=k.device)
    vo = None if v is None else torch.empty((tokens, hkv, d), dtype=v.dtype, device=v.device)
    if tokens:
        norm = q_weight is not None
        cos, sin = cos.contiguous(), sin.contiguous()
        block_t = NORM_ROPE_TOKENS if tokens >= NORM_ROPE_TOKENS else 1  # two compiled variants, whatever the batch
        v_in, v_out = (k, ko) if v is None else (v, vo)  # without v: no program reads or writes them
        _norm_rope_kernel[(triton.cdiv(tokens, block_t), hq + hkv * (1 if v is None else 2))](
            q, k, v_in, q_weight if norm else q, k_weight if norm else k, cos, sin, qo, ko, v_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v_in.stride(0), v_in.stride(1), cos.stride(0),
            tokens, hq, hkv, eps,
            D=d, HALF=d // 2, NORM=norm, BLOCK_T=block_t,
            num_warps=4 if block_t > 1 else (1 if d <= 128 else 2), **pdl_options(q.device),
        )
    return (qo, ko) if v is None else (qo, ko, vo)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    # torch's silu: x / (1 + expf(-x)) in float32, rounded to the activation dtype; then the product,
    # rounded again. tl.exp and `/` lower to approximations on CUDA (ex2.approx, div.full) that can
    # flip a bf16 rounding, so there the kernel calls CUDA's expf and divides correctly rounded; the
    # interpreter (no libdevice) has numpy's exp, as exact as the CPU's
    if LIBDEVICE:
        silu = tl.div_rn(gate, 1.0 + libdevice.exp(-gate))
    else:
        silu = gate / (1.0 + tl.exp(-gate))
    silu = silu.to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dt), mask=mask)


# read once, as @triton.jit did when this module was imported: the interpreter has no libdevice
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SILU_MUL_BLOCK = 1024  # columns a program computes: a decode row of a large MLP spreads over several


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * I] (gate columns first, the fused gate_up matmul's output; rows may be strided,
    the last axis contiguous) -> silu(gate) * up, a new contiguous [..., I] in gate_up's dtype."""
    n = gate_up.shape[-1] // 2
    if gate_up.shape[-1] != 2 * n:
        raise ValueError(f"gate_up's last axis ({gate_up.shape[-1]}) must hold gate and up, two equal halves")
    rows = gate_up.reshape(-1, 2 * n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and n:
        block = min(SILU_MUL_BLOCK, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
            rows, out, rows.stride(0), out.stride(0), n, BLOCK=block, LIBDEVICE=not _INTERPRETED,
            num_warps=max(1, min(8, block // 256)), **pdl_options(gate_up.device),
        )
    return out.view(*gate_up.shape[:-1], n)
