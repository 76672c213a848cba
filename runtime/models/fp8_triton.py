"""A linear layer over FP8 weights as one Triton kernel: the GPU path of `fp8_weights.Fp8Linear`.

`linear(x [M, K], codes [N, K] e4m3, scales [N, ceil(K / c)], bias)` = x @ W^T + bias with W = codes x each
row's scale of its c-column block, dequantized a tile at a time in registers and rounded to the activations'
dtype as the dequantized weights are (runtime/models/fp8_weights.py), then multiplied on the tensor cores
with fp32 accumulation: one byte read per weight, no dequantized copy in memory. Tiles: BLOCK_M rows of x
(decode's few rows: 16), BLOCK_N output columns, BLOCK_K of the reduction; no host value read (CUDA graphs).
The torch path (dequantize, then `F.linear`) stays the CPU default and the oracle.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def dequantize_tile(w, s_ptrs, s_ok, k0, mask, stride_sk, dtype, SCALE_COLS: tl.constexpr, BLOCK_K: tl.constexpr):
    """A weight tile [BLOCK_K, BLOCK_N] of columns k0 .. k0 + BLOCK_K as a product reads it: FP8 codes
    (SCALE_COLS > 0) times each row's scale of their column block (`s_ptrs` [1, BLOCK_N]: the rows' scales,
    `s_ok` which rows exist), rounded to the activations' dtype as dequantized weights are
    (runtime/models/fp8_weights.py); other weights as they are. A tile inside one scale block (BLOCK_K divides
    SCALE_COLS, as the launchers choose) loads one scale a row; any other tile one a weight. The routed
    experts' kernels (moe_triton.py) use it too."""
    if SCALE_COLS > 0:
        if SCALE_COLS % BLOCK_K == 0:
            scale = tl.load(s_ptrs + (k0 // SCALE_COLS) * stride_sk, mask=s_ok, other=0.0)
        else:
            cols = k0 + tl.arange(0, BLOCK_K)
            scale = tl.load(s_ptrs + (cols // SCALE_COLS)[:, None] * stride_sk, mask=mask, other=0.0)
        w = (w.to(tl.float32) * scale).to(dtype)
    return w


@triton.jit
def _linear_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_om, stride_on,
                   SCALE_COLS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        codes = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_ok, other=0.0)
        w = dequantize_tile(codes, s_ptr + cols[None, :] * stride_sn, col_ok[None, :], k0, w_ok, stride_sk, x.dtype,
                            SCALE_COLS, BLOCK_K)
        if UPCAST:  # fp32 (IEEE, the parity path), or bf16 under the interpreter, whose tl.dot misreads it
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


# (rows up to, block_n, block_k, warps, stages): the best of a 72-launch sweep on an H100 at Qwen3-30B-A3B's
# qkv (2048 -> 5120) and o (4096 -> 2048) for 1, 18, 160 and 8,192 rows (`python bench/fp8_weights_bench.py
# --sweep`, docs/benchmarks.md): narrow column tiles and long k tiles for decode's few rows, which otherwise
# leave most SMs idle (64 x 64 tiles at 4 warps took 1.3-2.2x as long there)
LAUNCHES = ((64, 32, 128, 4, 4), (256, 64, 128, 4, 4), (None, 128, 128, 8, 3))


def linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scale_columns: int,
           bias: torch.Tensor | None = None, *, block_m: int | None = None, block_n: int | None = None,
           block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized(codes [N, K], scales)^T (+ bias) -> [..., N] in x's dtype (module docstring).
    The tile knobs default to `LAUNCHES` by row count."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = codes.shape[0]
    if codes.shape[1] != k or scales.shape != (n, -(-k // scale_columns)):
        raise ValueError(f"FP8 linear: x [..., {k}], codes {tuple(codes.shape)} and scales {tuple(scales.shape)} "
                         f"(want [{n}, {-(-k // scale_columns)}]) disagree")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = x.new_empty(m, n)
    if m == 0:
        return out.view(*lead, n)
    _, n_tile, k_tile, warps, stages = next(launch for launch in LAUNCHES if launch[0] is None or m <= launch[0])
    block_n, block_k = block_n or n_tile, block_k or k_tile
    num_warps, num_stages = num_warps or warps, num_stages or stages
    tile_m = block_m or max(16, min(64, triton.next_power_of_2(m)))
    upcast = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")
    _linear_kernel[(triton.cdiv(m, tile_m), triton.cdiv(n, block_n))](
        x2, codes, scales, bias if bias is not None else scales, out, m, n, k,
        x2.stride(0), x2.stride(1), codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1),
        out.stride(0), out.stride(1),
        SCALE_COLS=scale_columns, HAS_BIAS=bias is not None, BLOCK_M=tile_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=upcast, num_warps=num_warps, num_stages=num_stages,
    )
    return out.view(*lead, n)
