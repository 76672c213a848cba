"""Routed experts as fused Triton kernels: the GPU path of `experts.RoutedExperts`.

The torch path in `experts.py` stays the CPU default and the oracle; this module computes the same
`sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))` over each token's top-k experts in four launches:

1. align (moe_align.py): the (token, expert) pairs, flattened as `pair = token * k + j`, are
   grouped by expert, each expert's rows padded to a multiple of BLOCK_M so that every row block of
   the grouped GEMMs belongs to one expert: `sorted_pairs`, `block_experts`, `num_padded`. One
   parallel Triton launch (a program per expert) up to `ALIGN_ONE_LAUNCH_MAX_PAIRS` pairs, two over
   splits of the pairs above (prefill chunks); the same, stable order as the torch sort.
2. gate_up: grouped GEMM over the sorted rows, gate and up tiles of the same expert accumulated
   side by side (fp32), `silu(gate) * up` applied in registers; the [rows, I] result is written
   in the activation dtype, indexed by sorted row.
3. down: grouped GEMM of that intermediate with the expert's down projection, scaled by the
   pair's routing weight and written per pair; the k rows of a token are then summed in fp32 by one
   more launch (`_sum_pairs_kernel`; deterministic: no atomics), or with `reduce=False` left to the
   next residual add + RMSNorm, which sums them in its own launch (norm_triton.py `add_rms_norm`).

Where the tiles divide the weights (`EVEN`) the inner loops load without masks (a padding row reads
token 0 and is never stored); with `MoeTileConfig.tma` the weight tiles come through TMA descriptors
(Hopper and later, 16-bit weights), the gathered token rows through ordinary loads.

Everything is sized by host-known upper bounds (capacity = pairs + min(E, pairs) * (BLOCK_M - 1)
rows, rounded to BLOCK_M); the row count actually in use lives on the device and programs past it
return at once. No host sync, no data-dependent shape: a decode step with these kernels can be
captured in a CUDA graph. Launch tiles come from `MoeTileConfig` (a small frozen dataclass that
`kvc tune` searches): `launch_config` gives this GPU's tuned entry for the shape bucket
(runtime/tuning/, keyed by this file's sha256), else `default_config`, the heuristic per
rows-per-expert bucket.

Inputs may be fp32, fp16 or bf16 (weights in the activation dtype); products accumulate in fp32,
and fp32 inputs multiply in IEEE fp32 (never tf32), so the fp32 path matches the torch oracle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kvc.runtime.models.fp8_triton import dequantize_tile
from kvc.runtime.models.moe_align import (  # the others re-exported: the alignment is step 1 here
    ALIGN_ONE_LAUNCH_MAX_PAIRS,  # noqa: F401
    ExpertAlignment,  # noqa: F401
    align_by_expert,
    alignment_capacity,  # noqa: F401
)
from kvc.runtime.primitives.pdl import gate as pdl_gate
from kvc.runtime.primitives.pdl import options as pdl_options
from kvc.runtime.tuning import buckets as tuning_buckets
from kvc.runtime.tuning.lookup import source_hash, tuned

try:  # host-side TMA descriptors (Triton 3.4 and later)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton: the pointer path only
    TensorDescriptor = None

KERNEL = "moe.fused_experts"  # the tuning cache's name for the gate_up + down launches
SOURCE_HASH = source_hash(__file__)  # tuned entries recorded for another version of this file are ignored


@dataclass(frozen=True)
class MoeTileConfig:
    """Launch tiles of the two grouped GEMMs. block_m is shared (it fixes the alignment of both); the
    down GEMM takes its own tiles where a `down_*` field is set (0: the gate_up GEMM's)."""

    block_m: int = 16  # rows of one expert per program; each expert's rows pad to a multiple
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8  # row blocks walked together, so neighbouring programs share weight tiles
    num_warps: int = 4
    num_stages: int = 3
    down_block_n: int = 0
    down_block_k: int = 0
    down_num_warps: int = 0
    down_num_stages: int = 0
    tma: bool = False  # weight tiles through TMA descriptors (Hopper and later, 16-bit weights, tiles that divide them)

    def fit(self, n: int, k: int) -> MoeTileConfig:
        """The tiles clipped to an [n, k] weight (tl.dot needs at least 16 each way)."""
        return replace(self, block_n=min(self.block_n, _at_least_16(n)),
                       block_k=min(self.block_k, _at_least_16(k)))

    def down(self) -> MoeTileConfig:
        """The down GEMM's tiles."""
        return replace(self, block_n=self.down_block_n or self.block_n, block_k=self.down_block_k or self.block_k,
                       num_warps=self.down_num_warps or self.num_warps,
                       num_stages=self.down_num_stages or self.num_stages)


def _at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def default_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoeTileConfig:
    """The heuristic tiles for a batch, bucketed by the average rows an expert receives."""
    rows_per_expert = num_tokens * top_k / max(1, num_experts)
    if dtype == torch.float32:  # twice the bytes per tile: smaller tiles, fewer stages
        block_m = 16 if rows_per_expert <= 16 else 64
        return MoeTileConfig(block_m=block_m, block_n=32, block_k=32, num_warps=4, num_stages=2)
    if rows_per_expert <= 16:  # decode: weight-bandwidth bound, many narrow programs
        return MoeTileConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return MoeTileConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
    if rows_per_expert <= 256:
        return MoeTileConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)
    # prefill chunks: the best of `python bench/moe_bench.py --tokens 8192,32768 --sweep` on an H100: weights
    # through TMA, the down GEMM in 128 x 256 tiles; 1.05x / 1.10x the 128 x 128 pointer tiles at 8K / 32K
    # tokens (docs/benchmarks.md, issue 23's MoE prefill). Where TMA cannot serve, the same tiles by pointer.
    return MoeTileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3,
                         down_block_n=256, down_block_k=64, down_num_warps=8, down_num_stages=3, tma=True)


def launch_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                  dtype: torch.dtype) -> MoeTileConfig:
    """This GPU's tuned tiles for the batch's bucket (`kvc tune`), else `default_config`."""
    cfg = default_config(num_tokens, top_k, num_experts, dtype)
    knobs = tuned(KERNEL, tuning_buckets.moe(num_tokens, num_experts, top_k, hidden, inter, dtype), SOURCE_HASH)
    return replace(cfg, **knobs) if knobs else cfg


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr):
    if DOT_PRECISION == "upcast":
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif DOT_PRECISION == "ieee":
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    """A tile, unmasked where the tiles divide the operand (EVEN), else masked with zeros."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _block_coords(num_m_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (row block, column block), GROUP_M row blocks sweeping the columns together."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, ws_ptr,
                    num_pairs, num_m_blocks, N, K,
                    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_or, stride_on,
                    stride_se, stride_sn, stride_sk,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    SCALE_COLS: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    # EVEN: the tiles divide N and K (no column masks). TMA: w_ptr is a descriptor over W as [E * 2N, K]
    # giving [BLOCK_N, BLOCK_K] tiles (EVEN, 16-bit weights).
    pid_m, pid_n = _block_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    valid = pairs < num_pairs
    tokens = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)  # a padding row reads token 0 and is never stored
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xk
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:
        g_row = (expert * 2 * N + pid_n * BLOCK_N).to(tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs)
            gate = _mma(a, tl.trans(w_ptr.load([g_row, k0])), gate, DOT_PRECISION)
            up = _mma(a, tl.trans(w_ptr.load([g_row + N, k0])), up, DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_xk
    else:
        # [BLOCK_K, BLOCK_N] tiles of W[e].T: gate rows are [0, N), up rows [N, 2N)
        g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        u_ptrs = g_ptrs + N * stride_wn
        gs_ptrs = ws_ptr + expert * stride_se + offs_n[None, :] * stride_sn
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            w_ok = k_ok[:, None] & n_ok[None, :]
            a = _load(a_ptrs, k_ok[None, :], EVEN)
            g = _load(g_ptrs, w_ok, EVEN)
            u = _load(u_ptrs, w_ok, EVEN)
            g = dequantize_tile(g, gs_ptrs, n_ok[None, :], k0, w_ok, stride_sk, a.dtype, SCALE_COLS, BLOCK_K)
            u = dequantize_tile(u, gs_ptrs + N * stride_sn, n_ok[None, :], k0, w_ok, stride_sk, a.dtype, SCALE_COLS,
                                BLOCK_K)
            gate = _mma(a, g, gate, DOT_PRECISION)
            up = _mma(a, u, up, DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_xk
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
    h = gate * tl.sigmoid(gate) * up
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_or + offs_n[None, :] * stride_on
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, route_w_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, ws_ptr,
                 num_pairs, num_m_blocks, N, K,
                 stride_hr, stride_hk, stride_we, stride_wn, stride_wk, stride_op, stride_on,
                 stride_se, stride_sn, stride_sk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALE_COLS: tl.constexpr,
                 EVEN: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    # EVEN and TMA as in _gate_up_kernel (the descriptor over W as [E * N, K]). Every row of h exists (a
    # padding row holds whatever the gate_up kernel left there and is never stored).
    pid_m, pid_n = _block_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    valid = pairs < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hr + offs_k[None, :] * stride_hk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:
        w_row = (expert * N + pid_n * BLOCK_N).to(tl.int32)
        for k0 in range(0, K, BLOCK_K):
            acc = _mma(tl.load(a_ptrs), tl.trans(w_ptr.load([w_row, k0])), acc, DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_hk
    else:
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        s_ptrs = ws_ptr + expert * stride_se + offs_n[None, :] * stride_sn
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            w_ok = k_ok[:, None] & n_ok[None, :]
            a = _load(a_ptrs, k_ok[None, :], EVEN)
            w = _load(w_ptrs, w_ok, EVEN)
            w = dequantize_tile(w, s_ptrs, n_ok[None, :], k0, w_ok, stride_sk, a.dtype, SCALE_COLS, BLOCK_K)
            acc = _mma(a, w, acc, DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_hk
            w_ptrs += BLOCK_K * stride_wk
    route_w = tl.load(route_w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_op + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _sum_pairs_kernel(src_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = sum over j of src[t * TOP_K + j] (fp32 sum, in j order): each token's weighted expert rows."""
    pdl_gate(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(src_ptr + (token * TOP_K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def dot_precision(dtype: torch.dtype) -> str:
    """"ieee" for fp32 (the parity path must not drop to tf32), "native" for 16-bit types, and
    "upcast" for bf16 under the interpreter, whose tl.dot misreads bf16 (bf16 products are exact
    in fp32, so upcasting changes only speed)."""
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return "upcast"
    return "native"


def fused_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: MoeTileConfig | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale_columns: int = 0,
    skips: bool = False,
    reduce: bool = True,
) -> torch.Tensor:
    """x [T, H], gate_up_proj [E, 2I, H], down_proj [E, H, I], topk_ids/topk_weights [T, k]
    -> [T, H] in x's dtype: sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]); with `reduce=False`
    the k terms unsummed, [T, k, H] (the next residual add + norm sums them in its launch). FP8 weights come with
    `scales` (gate_up's [E, 2I, ceil(H / c)], down's [E, H, ceil(I / c)]: each row's scale per `scale_columns`
    = c columns, runtime/models/fp8_weights.py) and are dequantized tile by tile in the kernels. `skips`: a
    pair whose id is E (another rank's expert, expert parallelism) is computed by no expert and adds nothing."""
    _check(x, gate_up_proj, down_proj, topk_ids, topk_weights, scales, scale_columns)
    gate_up_scale, down_scale = scales if scales is not None else (gate_up_proj, down_proj)  # unread without
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return x.new_zeros(num_tokens, hidden) if reduce else x.new_zeros(num_tokens, top_k, hidden)
    config = config or launch_config(num_tokens, top_k, num_experts, hidden, inter, x.dtype)
    align = align_by_expert(topk_ids, num_experts, config.block_m, skips=skips)
    capacity = align.sorted_pairs.numel()
    num_m_blocks = capacity // config.block_m
    precision = dot_precision(x.dtype)

    scale_cols = scale_columns if scales is not None else 0
    h = x.new_empty(capacity, inter)
    tile = config.fit(inter, hidden)
    even, tma = _even_and_tma(tile, inter, hidden, gate_up_proj, scale_cols)
    _gate_up_kernel[(num_m_blocks * triton.cdiv(inter, tile.block_n),)](
        x, _weights_arg(gate_up_proj, tile, tma), h, align.sorted_pairs, align.block_experts, align.num_padded,
        gate_up_scale, num_pairs, num_m_blocks, inter, hidden,
        x.stride(0), x.stride(1), *gate_up_proj.stride(), h.stride(0), h.stride(1), *gate_up_scale.stride(),
        TOP_K=top_k, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, DOT_PRECISION=precision, SCALE_COLS=scale_cols, EVEN=even, TMA=tma,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_options(x.device),
    )
    per_pair = x.new_zeros(num_pairs, hidden) if skips else x.new_empty(num_pairs, hidden)  # skipped: never written
    route_w = topk_weights.reshape(-1)
    tile = config.down().fit(hidden, inter)
    even, tma = _even_and_tma(tile, hidden, inter, down_proj, scale_cols)
    _down_kernel[(num_m_blocks * triton.cdiv(hidden, tile.block_n),)](
        h, _weights_arg(down_proj, tile, tma), per_pair, route_w, align.sorted_pairs, align.block_experts,
        align.num_padded, down_scale, num_pairs, num_m_blocks, hidden, inter,
        h.stride(0), h.stride(1), *down_proj.stride(), per_pair.stride(0), per_pair.stride(1), *down_scale.stride(),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, DOT_PRECISION=precision, SCALE_COLS=scale_cols, EVEN=even, TMA=tma,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_options(x.device),
    )
    if not reduce:
        return per_pair.view(num_tokens, top_k, hidden)
    if top_k == 1:
        return per_pair
    out = x.new_empty(num_tokens, hidden)
    block_h = min(triton.next_power_of_2(hidden), 2048)
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden, block_h))](per_pair, out, hidden, TOP_K=top_k,
                                                                  BLOCK_H=block_h, num_warps=4,
                                                                  **pdl_options(x.device))
    return out


def _even_and_tma(tile: MoeTileConfig, n: int, k: int, weight: torch.Tensor, scale_cols: int) -> tuple[bool, bool]:
    """(the tiles divide an [n, k] weight, its tiles go through TMA): TMA where asked, the tiles divide the
    weight (a tile must not cross into the next expert's rows) and the weights are 16-bit and TMA-ready."""
    even = n % tile.block_n == 0 and k % tile.block_k == 0
    return even, tile.tma and even and not scale_cols and _tma_ready(weight)


def _tma_ready(weight: torch.Tensor) -> bool:
    """Whether `weight` [E, rows, k] can be read through a TMA descriptor here: contiguous 16-bit weights on a
    Hopper or later GPU (or under the interpreter, which emulates descriptors) with a Triton that has them."""
    if TensorDescriptor is None or weight.element_size() != 2 or not weight.is_contiguous():
        return False
    if weight.is_cuda:
        return torch.cuda.get_device_capability(weight.device) >= (9, 0)
    return os.environ.get("TRITON_INTERPRET") == "1"


def _weights_arg(weight: torch.Tensor, tile: MoeTileConfig, tma: bool):
    """The kernels' weight argument: the tensor, or a descriptor of [BLOCK_N, BLOCK_K] tiles over it as
    [E * rows, k]."""
    if not tma:
        return weight
    return TensorDescriptor.from_tensor(weight.view(-1, weight.shape[-1]), [tile.block_n, tile.block_k])


def _check(x, gate_up_proj, down_proj, topk_ids, topk_weights, scales=None, scale_columns=0) -> None:
    num_experts, two_i, hidden = gate_up_proj.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_i % 2:
        raise ValueError(f"x must be [T, {hidden}] for gate_up_proj {tuple(gate_up_proj.shape)}, "
                         f"got {tuple(x.shape)}")
    if down_proj.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"down_proj must be [{num_experts}, {hidden}, {two_i // 2}], "
                         f"got {tuple(down_proj.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [{x.shape[0]}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    want = torch.float8_e4m3fn if scales is not None else x.dtype
    if gate_up_proj.dtype != want or down_proj.dtype != want:
        raise ValueError(f"expert weights ({gate_up_proj.dtype}, {down_proj.dtype}) must have the "
                         f"activations' dtype {x.dtype}, or be FP8 codes with their scales")
    blocks = [-(-w.shape[2] // max(scale_columns, 1)) for w in (gate_up_proj, down_proj)]
    if scales is not None and (scale_columns < 1 or scales[0].shape != (*gate_up_proj.shape[:2], blocks[0])
                               or scales[1].shape != (*down_proj.shape[:2], blocks[1])):
        raise ValueError(f"FP8 expert scales must be [E, rows, ceil(columns / {scale_columns})] per weight, got "
                         f"{[tuple(t.shape) for t in scales]}")
    if not topk_ids.is_contiguous() or not topk_weights.is_contiguous():
        raise ValueError("topk_ids and topk_weights must be contiguous")
