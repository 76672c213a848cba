"""A softmax router's top-k in one Triton launch on CUDA (qwen3_moe.py's `SparseMoeBlock.route` calls it there;
the CPU keeps the torch path, the parity oracle).

The torch path is five launches a layer: the float32 softmax over every expert's logit, top-k's two kernels
(a gather and a bitonic sort), and with `norm_topk_prob` a sum and a division. At a decode step of a 48-layer
MoE model that is about 240 launches and 0.9 ms of a 7.7 ms step at batch 16 (docs/benchmarks.md, issue 23's
launches per decode step). Here one program routes a block of tokens: it loads their logits once, takes the
softmax in float32, picks the k largest one at a time (ties to the lower expert id, where torch's order is
unspecified) and renormalises them over the k when asked.

The arithmetic is torch's: p = exp(x - max) / sum(exp(x - max)) in float32 (CUDA's expf and a correctly
rounded division, as the torch kernel computes them), then p / sum of the k chosen p. Only the order of the two
float32 sums differs, so the weights agree to about an ulp and the ids exactly (the k largest p are the k
largest logits).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

# read once, as @triton.jit did when this module was imported: the interpreter has no libdevice
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_TOKENS = 8  # tokens a program routes (sm90, 128 experts, 4 warps: 80 registers, no spills; 16 spill)


@triton.jit
def _softmax_topk_kernel(logits_ptr, ids_ptr, weights_ptr, T, E, stride_l, stride_i, stride_w,
                         TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                         RENORMALIZE: tl.constexpr, LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    ok = row_ok[:, None] & (cols[None, :] < E)
    rows64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows64[:, None] * stride_l + cols[None, :], mask=ok, other=float("-inf"))
    x = tl.where(ok, x.to(tl.float32), float("-inf"))
    top = tl.max(x, axis=1)
    top = tl.where(row_ok, top, 0.0)  # a padding row: no -inf - -inf
    if LIBDEVICE:
        e = libdevice.exp(x - top[:, None])
    else:
        e = tl.exp(x - top[:, None])
    e = tl.where(ok, e, 0.0)
    total = tl.where(row_ok, tl.sum(e, axis=1), 1.0)
    if LIBDEVICE:
        p = tl.div_rn(e, total[:, None])
    else:
        p = e / total[:, None]
    slots = tl.arange(0, K_PAD)
    ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int64)
    weights = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    chosen = tl.zeros((BLOCK_T,), dtype=tl.float32)
    left = x
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=1)
        pick = tl.min(tl.where(left == best[:, None], cols[None, :], BLOCK_E), axis=1)  # ties: the lower id
        pick = tl.minimum(pick, E - 1)  # a NaN logit matches nothing: never an id past the experts
        hit = cols[None, :] == pick[:, None]
        pj = tl.sum(tl.where(hit, p, 0.0), axis=1)
        ids = tl.where(slots[None, :] == j, pick.to(tl.int64)[:, None], ids)
        weights = tl.where(slots[None, :] == j, pj[:, None], weights)
        chosen += pj
        left = tl.where(hit, float("-inf"), left)
    if RENORMALIZE:
        chosen = tl.where(row_ok, chosen, 1.0)
        if LIBDEVICE:
            weights = tl.div_rn(weights, chosen[:, None])
        else:
            weights = weights / chosen[:, None]
    keep = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(ids_ptr + rows64[:, None] * stride_i + slots[None, :], ids, mask=keep)
    tl.store(weights_ptr + rows64[:, None] * stride_w + slots[None, :], weights, mask=keep)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype; rows may be strided, the expert axis contiguous) -> (ids [T, k] int64,
    weights [T, k] float32): the k largest of softmax(logits) in float32, largest first, ties to the lower
    expert id; `renormalize`: divided by their sum (a model's `norm_topk_prob`)."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], got {tuple(logits.shape)}")
    tokens, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}] for {experts} experts, got {top_k}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    if tokens:
        block_e = triton.next_power_of_2(experts)
        _softmax_topk_kernel[(triton.cdiv(tokens, BLOCK_TOKENS),)](
            logits, ids, weights, tokens, experts, logits.stride(0), ids.stride(0), weights.stride(0),
            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_T=BLOCK_TOKENS, BLOCK_E=block_e,
            RENORMALIZE=renormalize, LIBDEVICE=not _INTERPRETED, num_warps=4 if block_e <= 256 else 8,
        )
    return ids, weights
