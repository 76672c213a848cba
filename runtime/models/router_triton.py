"""Routers' top-k in one Triton launch on CUDA; the models call them there (qwen3_moe.py's
`SparseMoeBlock.route`, glm4_moe_lite.py's `LatentMoE.route`) and the CPU keeps their torch paths, the parity
oracles.

- `softmax_topk` (Qwen3-MoE): the torch path is five launches a layer, the float32 softmax over every expert's
  logit, top-k's two kernels (a gather and a bitonic sort), and with `norm_topk_prob` a sum and a division. At a
  decode step of a 48-layer MoE model that is about 240 launches and 0.9 ms of a 7.7 ms step at batch 16
  (docs/benchmarks.md, "Launches per decode step").
- `gate_softmax_topk` (Qwen3-MoE, a decode step's tokens): the gate's GEMM in the same program as the route, 16
  tokens a program over every expert, instead of the library's small GEMM and `softmax_topk` (docs/design.md,
  "Routers").
- `sigmoid_topk` (GLM-4.7-Flash, DeepSeek-V3's routing): sigmoid scores, a bias added for the choice only,
  group-limited choice (the best `topk_group` of `n_group` groups by the sum of each group's two best), the
  weights the chosen scores, renormalised and scaled: about a dozen torch launches a layer.

One program routes a block of tokens: it loads their logits once, scores them in float32 (CUDA's expf and
correctly rounded divisions, as torch's kernels), picks the k best one at a time (ties to the lower expert id,
where torch's order is unspecified) and writes ids and weights, largest choice first. Only the order of the
float32 sums differs from torch's, so the weights agree to a few ulps and the ids exactly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from kvc.runtime.primitives.pdl import gate as pdl_gate
from kvc.runtime.primitives.pdl import options as pdl_options

# read once, as @triton.jit did when this module was imported: the interpreter has no libdevice
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_TOKENS = 8  # tokens a program routes (sm90, 128 experts, 4 warps: 80 registers, no spills; 16 spill)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    # tl.exp lowers to an approximation on CUDA; torch's kernels call expf (the interpreter has numpy's)
    if LIBDEVICE:
        out = libdevice.exp(x)
    else:
        out = tl.exp(x)
    return out


@triton.jit
def _divide(x, by, LIBDEVICE: tl.constexpr):
    # correctly rounded, as torch's division (`/` lowers to div.full on CUDA)
    if LIBDEVICE:
        out = tl.div_rn(x, by)
    else:
        out = x / by
    return out


@triton.jit
def _top_k(choice, values, cols, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
           BLOCK_E: tl.constexpr):
    """Per row, the TOP_K largest of `choice` [BLOCK_T, BLOCK_E], one at a time (ties to the lower column; a NaN,
    which matches nothing, never picks a column past E): (their columns [BLOCK_T, K_PAD] int64, `values` at them,
    the sum of those values)."""
    slots = tl.arange(0, K_PAD)
    ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int64)
    picked = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        pick = tl.min(tl.where(choice == best[:, None], cols[None, :], BLOCK_E), axis=1)
        pick = tl.minimum(pick, E - 1)
        hit = cols[None, :] == pick[:, None]
        value = tl.sum(tl.where(hit, values, 0.0), axis=1)
        ids = tl.where(slots[None, :] == j, pick.to(tl.int64)[:, None], ids)
        picked = tl.where(slots[None, :] == j, value[:, None], picked)
        total += value
        choice = tl.where(hit, float("-inf"), choice)
    return ids, picked, total


@triton.jit
def _store_top_k(ids_ptr, weights_ptr, rows, row_ok, ids, weights, stride_i, stride_w, TOP_K: tl.constexpr,
                 K_PAD: tl.constexpr):
    slots = tl.arange(0, K_PAD)
    keep = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(ids_ptr + rows[:, None] * stride_i + slots[None, :], ids, mask=keep)
    tl.store(weights_ptr + rows[:, None] * stride_w + slots[None, :], weights, mask=keep)


@triton.jit
def _softmax_route(x, rows, row_ok, ok, cols, ids_ptr, weights_ptr, E, stride_i, stride_w, TOP_K: tl.constexpr,
                   K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
                   LIBDEVICE: tl.constexpr):
    # the rows' routes from their float32 logits x [BLOCK_T, BLOCK_E] (-inf outside `ok`)
    top = tl.where(row_ok, tl.max(x, axis=1), 0.0)  # a padding row: no -inf - -inf
    e = tl.where(ok, _exp(x - top[:, None], LIBDEVICE), 0.0)
    p = _divide(e, tl.where(row_ok, tl.sum(e, axis=1), 1.0)[:, None], LIBDEVICE)
    # the k largest p are the k largest logits: chosen on x, no rounding of p can reorder them
    ids, weights, chosen = _top_k(x, p, cols, E, TOP_K, K_PAD, BLOCK_T, BLOCK_E)
    if RENORMALIZE:
        weights = _divide(weights, tl.where(row_ok, chosen, 1.0)[:, None], LIBDEVICE)
    _store_top_k(ids_ptr, weights_ptr, rows.to(tl.int64), row_ok, ids, weights, stride_i, stride_w, TOP_K, K_PAD)


@triton.jit
def _softmax_topk_kernel(logits_ptr, ids_ptr, weights_ptr, T, E, stride_l, stride_i, stride_w,
                         TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                         RENORMALIZE: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    ok = row_ok[:, None] & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :], mask=ok, other=float("-inf"))
    x = tl.where(ok, x.to(tl.float32), float("-inf"))
    _softmax_route(x, rows, row_ok, ok, cols, ids_ptr, weights_ptr, E, stride_i, stride_w, TOP_K, K_PAD, BLOCK_T,
                   BLOCK_E, RENORMALIZE, LIBDEVICE)


@triton.jit
def _gate_softmax_topk_kernel(x_ptr, w_ptr, ids_ptr, weights_ptr, T, E, H, stride_x, stride_g, stride_i, stride_w,
                              TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                              LIBDEVICE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    # a block of tokens' gate logits over every expert (float32 sums, rounded to the gate's dtype as its linear
    # layer's output is), then their routes, in the one program
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_ptr + cols[:, None] * stride_g + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # float32 operands (the interpreter's tl.dot misreads bf16; float32 takes ieee, not tf32)
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.where(ok, acc.to(x_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
    _softmax_route(x, rows, row_ok, ok, cols, ids_ptr, weights_ptr, E, stride_i, stride_w, TOP_K, K_PAD, BLOCK_T,
                   BLOCK_E, RENORMALIZE, LIBDEVICE)


def _outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits with a contiguous expert axis, ids [T, k] int64, weights [T, k] float32), or a ValueError."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return logits, *_routes(*logits.shape, top_k, logits.device)


def _routes(tokens: int, experts: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k] int64, weights [T, k] float32) to fill, or a ValueError for a top_k the experts cannot give."""
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}] for {experts} experts, got {top_k}")
    return (torch.empty((tokens, top_k), dtype=torch.int64, device=device),
            torch.empty((tokens, top_k), dtype=torch.float32, device=device))


def _launch(experts: int, top_k: int) -> dict:
    """Both kernels' shape constants and warps: a block of BLOCK_TOKENS tokens over every expert."""
    block_e = triton.next_power_of_2(experts)
    return {"TOP_K": top_k, "K_PAD": triton.next_power_of_2(top_k), "BLOCK_T": BLOCK_TOKENS, "BLOCK_E": block_e,
            "LIBDEVICE": not _INTERPRETED, "num_warps": 4 if block_e <= 256 else 8}


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype; rows may be strided, the expert axis contiguous) -> (ids [T, k] int64,
    weights [T, k] float32): the k largest of softmax(logits) in float32, largest first, ties to the lower
    expert id; `renormalize`: divided by their sum (a model's `norm_topk_prob`)."""
    logits, ids, weights = _outputs(logits, top_k)
    tokens, experts = logits.shape
    if tokens:
        _softmax_topk_kernel[(triton.cdiv(tokens, BLOCK_TOKENS),)](
            logits, ids, weights, tokens, experts, logits.stride(0), ids.stride(0), weights.stride(0),
            RENORMALIZE=renormalize, **_launch(experts, top_k), **pdl_options(logits.device))
    return ids, weights


GATE_BLOCK_TOKENS = 16  # tokens a program of the gate's fused router takes (tl.dot's smallest M)
GATE_BLOCK_K = 64
GATE_MAX_TOKENS = 1024  # above (prefill chunks): the gate's GEMM on the library's kernels, then `softmax_topk`
GATE_MAX_EXPERTS = 256  # a program holds its 16 tokens' logits over every expert


# Off: on an H100 the fused launch took 18-20 us a layer where the library's GEMM plus the route took 9-11 (1 to
# 276 tokens, `bench/router_bench.py`): one program reads the whole 512 KB gate for its 16 tokens, on one SM.
# A split over the experts (a second pass for the top k) is what would let it win; docs/design.md, "Routers".
FUSED_GATE = False


def gate_fits(tokens: int, experts: int) -> bool:
    """Does `gate_softmax_topk` take this router: the fused gate switched on, a decode step's tokens over at most
    256 experts?"""
    return FUSED_GATE and tokens <= GATE_MAX_TOKENS and experts <= GATE_MAX_EXPERTS


def gate_softmax_topk(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int,
                      renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_topk(x @ gate_weight.T, ...)` in one launch: x [T, H] (rows may be strided), gate_weight [E, H] in
    x's dtype, both with a contiguous last axis; the logits summed in float32 and rounded to x's dtype, as the
    gate's linear layer returns them. A decode step's router: one program reads the whole gate for its block of
    16 tokens, where the GEMM and the route were two launches (docs/design.md, "Routers")."""
    if x.dim() != 2 or gate_weight.dim() != 2 or gate_weight.shape[1] != x.shape[1]:
        raise ValueError(f"x [T, H] and the gate [E, H] do not fit: {tuple(x.shape)}, {tuple(gate_weight.shape)}")
    if x.stride(1) != 1 or gate_weight.stride(1) != 1:
        raise ValueError("x and the gate need a contiguous last axis")
    tokens, experts = x.shape[0], gate_weight.shape[0]
    ids, weights = _routes(tokens, experts, top_k, x.device)
    if tokens:
        launch = _launch(experts, top_k) | {"BLOCK_T": GATE_BLOCK_TOKENS, "num_warps": 8}
        _gate_softmax_topk_kernel[(triton.cdiv(tokens, GATE_BLOCK_TOKENS),)](
            x, gate_weight, ids, weights, tokens, experts, x.shape[1], x.stride(0), gate_weight.stride(0),
            ids.stride(0), weights.stride(0), BLOCK_K=GATE_BLOCK_K, RENORMALIZE=renormalize,
            UPCAST=_INTERPRETED or x.dtype == torch.float32, **launch, **pdl_options(x.device))
    return ids, weights


@triton.jit
def _sigmoid_topk_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, stride_l, stride_i, stride_w, scaling,
                         TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                         N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                         GROUP_SIZE: tl.constexpr, RENORMALIZE: tl.constexpr, LIBDEVICE: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_gate(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    ok = row_ok[:, None] & (cols[None, :] < E)
    rows64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows64[:, None] * stride_l + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    scores = _divide(1.0, 1.0 + _exp(-x, LIBDEVICE), LIBDEVICE)
    bias = tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)
    choice = tl.where(ok, scores + bias[None, :], float("-inf"))
    if N_GROUP > 1 and TOPK_GROUP < N_GROUP:
        # each group's score: the sum of its two best choices; the best TOPK_GROUP groups stay, the others' choices
        # become 0 (torch's masked_fill), so a kept expert below 0 can still lose to them
        group = cols // GROUP_SIZE
        group_score = tl.full((BLOCK_T, G_PAD), float("-inf"), dtype=tl.float32)
        slots = tl.arange(0, G_PAD)
        for g in tl.static_range(N_GROUP):
            members = tl.where((group == g)[None, :], choice, float("-inf"))
            first = tl.max(members, axis=1)
            at = tl.min(tl.where(members == first[:, None], cols[None, :], BLOCK_E), axis=1)
            second = tl.max(tl.where(cols[None, :] == at[:, None], float("-inf"), members), axis=1)
            group_score = tl.where(slots[None, :] == g, (first + second)[:, None], group_score)
        kept = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, axis=1)
            g = tl.min(tl.where(group_score == best[:, None], slots[None, :], G_PAD), axis=1)
            kept = kept | (group[None, :] == g[:, None])
            group_score = tl.where(slots[None, :] == g[:, None], float("-inf"), group_score)
        choice = tl.where(ok, tl.where(kept, choice, 0.0), float("-inf"))
    ids, weights, chosen = _top_k(choice, scores, cols, E, TOP_K, K_PAD, BLOCK_T, BLOCK_E)
    if RENORMALIZE:
        weights = _divide(weights, (chosen + 1e-20)[:, None], LIBDEVICE)
    _store_top_k(ids_ptr, weights_ptr, rows64, row_ok, ids, weights * scaling, stride_i, stride_w, TOP_K, K_PAD)


def sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                 renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (float32, as the model computes its router in float32), bias [E] -> (ids [T, k] int64,
    weights [T, k] float32): the k best of sigmoid(logits) + bias within the `topk_group` best of `n_group`
    equal groups of experts (each group scored by the sum of its two best), largest first, ties to the lower
    id; the weights are the chosen sigmoid scores, over their sum (+ 1e-20) when `renormalize`, times `scaling`."""
    logits, ids, weights = _outputs(logits, top_k)
    tokens, experts = logits.shape
    if n_group < 1 or experts % n_group or not 0 < topk_group <= n_group or (n_group > 1 and experts < 2 * n_group):
        raise ValueError(f"{experts} experts do not split into {n_group} groups of two or more with {topk_group} kept")
    if bias.shape != (experts,):
        raise ValueError(f"the score bias must be [{experts}], got {tuple(bias.shape)}")
    if tokens:
        _sigmoid_topk_kernel[(triton.cdiv(tokens, BLOCK_TOKENS),)](
            logits, bias.contiguous(), ids, weights, tokens, experts, logits.stride(0), ids.stride(0),
            weights.stride(0), float(scaling), N_GROUP=n_group, G_PAD=triton.next_power_of_2(n_group),
            TOPK_GROUP=topk_group, GROUP_SIZE=experts // n_group, RENORMALIZE=renormalize, **_launch(experts, top_k),
            **pdl_options(logits.device))
    return ids, weights
