"""Paged attention as Triton kernels: the GPU backend, same signatures as `torch_ops.py`.

Three kernel families sit here, between the model's attention layers and the paged KV cache
(layout in `metadata.py`):

- `store_kv`: one program per new token scatters its K/V rows (all kv heads) into the token's slot.
- `paged_decode`: flash-decoding. Programs are (sequence, kv head, split); each split walks its
  share of the context in tiles of BLOCK_N tokens gathered from several pages, computing all
  query heads of the GQA group at once (one `tl.dot` with the group padded to 16 rows; a
  broadcast-multiply variant exists for tuning), and leaves a partial output plus its
  log-sum-exp (base 2). A small reduce kernel merges the splits; with one split the first
  kernel writes the output directly.
  The split layout depends only on the Python int `num_splits`: each sequence divides its own
  context_lens[b] evenly over the splits, so one launch configuration serves every length (CUDA
  graphs) and the splits past a short context are simply empty. `decode_num_splits` picks the
  count from B, Hkv, the context bound and the SM count (about four programs per SM).
- `paged_prefill`: flash attention over the pages for varlen prefill chunks. A program owns
  BLOCK_Q queries of one sequence times the GQA group's query heads (BLOCK_M = BLOCK_Q x group
  rows), so every K/V tile is loaded once per group; key tiles wholly below the block's first
  query run without the causal mask and tiles wholly above its last query are never visited.

Per-head variable counts (`kv_starts [B, Hkv]`, metadata.py): decode and prefill programs start
their tiles at their KV head's first used slot, so the slots before it are neither loaded nor
masked (tokens are gathered one at a time: tiles need no alignment). `HAS_STARTS` is a constexpr:
without starts nothing is loaded and the start folds to the constant 0, so the other methods run
the kernels they ran before starts existed.

All arithmetic after the loads is fp32 (softmax in base 2); inputs may be fp32, fp16 or bf16.
Triton is optional: importing this module without it raises a `ModuleNotFoundError` that the
backend turns into an actionable error.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 128
MIN_TOKENS_PER_SPLIT = 256  # below this, a split's fixed cost (q load, partial write) dominates


# ---------------------------------------------------------------------------------------------
# Launch configurations and their heuristics
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    num_splits: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    use_dot: bool = True  # tl.dot with the group padded to 16 rows; else broadcast-multiply


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128  # rows per program: queries x (padded) GQA group
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a nominal 8 off-GPU, for the interpreter)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(batch: int, num_kv_heads: int, max_context_len: int, sms: int) -> int:
    """Splits per (sequence, kv head) so that about four programs per SM are in flight.

    1 x 131072 tokens x 8 kv heads wants many splits; 64 x 8192 x 8 already fills the GPU with
    one. Capped so that a split keeps at least MIN_TOKENS_PER_SPLIT tokens of the longest
    context, and at MAX_SPLITS.
    """
    programs = max(batch * num_kv_heads, 1)
    wanted = round(4 * sms / programs)
    by_length = -(-max(max_context_len, 1) // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def decode_config(batch: int, num_kv_heads: int, head_dim: int, max_context_len: int, sms: int) -> DecodeConfig:
    block_n = 64 if head_dim <= 128 else 32
    return DecodeConfig(
        num_splits=decode_num_splits(batch, num_kv_heads, max_context_len, sms),
        block_n=block_n,
        num_warps=4,
        num_stages=2,
        # Measured on an H200 (bench/attention_bench.py --sweep): the broadcast path is 7-15x
        # slower for groups of 4 and 8; the padded tl.dot keeps decode at copy bandwidth.
        use_dot=True,
    )


@functools.lru_cache(maxsize=None)
def _is_hopper_or_newer(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device | None = None) -> PrefillConfig:
    if dtype == torch.float32 or head_dim > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if device is not None and _is_hopper_or_newer(device):
        # Best of the H200 sweep (bf16, D=128): ~380 TFLOP/s. Needs ~220 KB of shared memory,
        # which pre-Hopper parts do not have.
        return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)


def _dot_precision(dtype: torch.dtype) -> str:
    """How `_mma` multiplies: "ieee" for fp32 (the parity path must not drop to tf32), "native"
    for 16-bit types, "upcast" for bf16 under the interpreter, whose tl.dot misreads bf16
    (Triton 3.9); bf16 x bf16 products are exact in fp32, so upcasting changes only speed."""
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return "upcast"
    return "native"


@triton.jit
def _mma(a, b, DOT_PRECISION: tl.constexpr):
    if DOT_PRECISION == "upcast":
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT_PRECISION == "ieee":
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k/v caches must both be [pages, kv_heads, page_size, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the caches ({k_cache.dtype}) must share a dtype")
    if q.shape[-1] != k_cache.shape[-1] or q.shape[-2] % k_cache.shape[1] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last (head_dim) axis")


# ---------------------------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kch, stride_kcs,
    stride_vcp, stride_vch, stride_vcs,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # Broadcast the slot before comparing: the interpreter rejects a scalar term in a mask.
    slots = tl.full([BLOCK_H, BLOCK_D], 0, tl.int64) + slot
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & (slots >= 0)

    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + page * stride_kcp + offset * stride_kcs + offs_h[:, None] * stride_kch
    v_dst = v_cache_ptr + page * stride_vcp + offset * stride_vcs + offs_h[:, None] * stride_vch
    tl.store(k_dst + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values k, v [T, Hkv, D] into their slots; slot -1 writes nothing."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last (head_dim) axis")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_cache.shape[2],
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


# ---------------------------------------------------------------------------------------------
# paged_decode (split-KV)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _split_len(context_len, num_splits, BLOCK_N: tl.constexpr):
    # Tokens per split for this sequence: an even share, rounded up to whole tiles (>= 1 tile, so
    # that an empty context gives 0 active splits rather than a division by zero).
    share = (context_len + num_splits - 1) // num_splits
    tiles = (share + BLOCK_N - 1) // BLOCK_N
    return tl.maximum(tiles, 1) * BLOCK_N


@triton.jit
def _head_start(kv_starts_ptr, seq, kv_head, stride_sb, HAS_STARTS: tl.constexpr):
    # First stored slot of (seq, kv head): per-head variable counts are stored right-aligned
    # (metadata.py); without HAS_STARTS every head starts at slot 0 and nothing is loaded.
    if HAS_STARTS:
        head_start = tl.load(kv_starts_ptr + seq.to(tl.int64) * stride_sb + kv_head)
    else:
        head_start = 0
    return head_start


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, kv_starts_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_splits,
    stride_qb, stride_qh,
    stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs,
    stride_bt, stride_sb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT_OUT: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_STARTS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    context_len = tl.load(context_lens_ptr + seq)
    # This kv head's tokens are slots [head_start, context_len); the splits share only those, so
    # the slots before a start are never loaded (tiles need no alignment: tokens are gathered).
    head_start = _head_start(kv_starts_ptr, seq, kv_head, stride_sb, HAS_STARTS)
    split_len = _split_len(context_len - head_start, num_splits, BLOCK_N)
    start = head_start + split * split_len
    end = tl.minimum(start + split_len, context_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    dim_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_mask[:, None] & dim_mask[None, :], other=0.0,
    )
    if not USE_DOT:
        q = q.to(tl.float32)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: exp2(m_old - m_new) never sees inf-inf
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    for tile in range(start, end, BLOCK_N):
        tokens = tile + offs_n
        token_mask = tokens < end
        pages = tl.load(table + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
        in_page = tokens % PAGE_SIZE
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(
            k_base + pages[:, None] * stride_kp + in_page[:, None] * stride_ks + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        if USE_DOT:
            qk = _mma(q, tl.trans(k), DOT_PRECISION)
        else:
            qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        qk = tl.where(token_mask[None, :], qk * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_base + pages[:, None] * stride_vp + in_page[:, None] * stride_vs + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        if USE_DOT:
            pv = _mma(p.to(v.dtype), v, DOT_PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = head_mask[:, None] & dim_mask[None, :]
    if DIRECT_OUT:
        # The only split: normalise and write the answer (zeros for an empty context).
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    elif start < end:
        # Partial result of a non-empty split; the reduce kernel reads exactly these.
        row = (seq.to(tl.int64) * num_q_heads + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=out_mask)
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=head_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, context_lens_ptr, kv_starts_ptr, out_ptr,
    num_splits, stride_sb, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr, HAS_STARTS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    active_len = tl.load(context_lens_ptr + seq) - _head_start(kv_starts_ptr, seq, head // GROUP, stride_sb,
                                                               HAS_STARTS)
    split_len = _split_len(active_len, num_splits, BLOCK_N)
    num_active = (active_len + split_len - 1) // split_len

    offs_d = tl.arange(0, BLOCK_D)
    dim_mask = offs_d < HEAD_DIM
    row0 = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    m = tl.full([], -1.0e30, tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_active, SPLIT_BLOCK):
        splits = s0 + tl.arange(0, SPLIT_BLOCK)
        split_mask = splits < num_active
        lse = tl.load(part_lse_ptr + row0 + splits, mask=split_mask, other=float("-inf"))
        o = tl.load(
            part_out_ptr + (row0 + splits)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=split_mask[:, None] & dim_mask[None, :], other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        total = total * alpha + tl.sum(w, axis=0)
        m = m_new
    # The largest split has weight exactly 1, so total >= 1 unless nothing was active (then 0/1).
    o = acc / tl.maximum(total, 1.0)
    dst = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=dim_mask)


def _starts_arg(kv_starts: torch.Tensor | None, context_lens: torch.Tensor, batch: int,
                num_kv_heads: int) -> tuple[torch.Tensor, int]:
    """The kernels' (kv_starts pointer, batch stride); without starts any tensor (never read)."""
    if kv_starts is None:
        return context_lens, 0
    if kv_starts.shape != (batch, num_kv_heads) or kv_starts.stride(-1) != 1:
        raise ValueError(f"kv_starts must be [{batch}, {num_kv_heads}] with a contiguous last axis, "
                         f"got {tuple(kv_starts.shape)}")
    return kv_starts, kv_starts.stride(0)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
    kv_starts: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    use_dot: bool | None = None,
) -> torch.Tensor:
    """One query per sequence, q [B, Hq, D], over its first context_lens[b] cached tokens
    (from kv_starts[b, h] on for KV head h when `kv_starts [B, Hkv]` int32 is given).

    `max_context_len` (an upper bound; default: what the block table can address) only feeds
    the split heuristic. The keyword-only knobs override the heuristic's `DecodeConfig`.
    No host sync and no value-dependent allocation: CUDA-graph capturable.
    """
    _check_cache(q, k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if out.stride(-1) != 1:
        raise ValueError("out needs a contiguous last (head_dim) axis")
    if batch == 0:
        return out
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * page_size
    cfg = decode_config(batch, num_kv_heads, head_dim, max_context_len, num_sms(q.device))
    overrides = dict(num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                     num_stages=num_stages, use_dot=use_dot)
    cfg = replace(cfg, **{k: val for k, val in overrides.items() if val is not None})

    splits = cfg.num_splits
    if splits > 1:
        part_out = torch.empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_q_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(16, triton.next_power_of_2(group)) if cfg.use_dot else triton.next_power_of_2(group)
    starts, stride_sb = _starts_arg(kv_starts, context_lens, batch, num_kv_heads)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, starts,
        out, part_out, part_lse,
        scale * LOG2E, splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), stride_sb, out.stride(0), out.stride(1),
        GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=page_size, BLOCK_N=cfg.block_n, DIRECT_OUT=splits == 1,
        USE_DOT=cfg.use_dot, DOT_PRECISION=_dot_precision(q.dtype), HAS_STARTS=kv_starts is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        split_block = min(triton.next_power_of_2(splits), max(1, 8192 // block_d))
        _decode_reduce_kernel[(batch, num_q_heads)](
            part_out, part_lse, context_lens, starts, out,
            splits, stride_sb, out.stride(0), out.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=cfg.block_n, SPLIT_BLOCK=split_block,
            HAS_STARTS=kv_starts is not None, num_warps=4 if head_dim >= 128 else 2,
        )
    return out


# ---------------------------------------------------------------------------------------------
# paged_prefill (varlen, causal, cached prefix)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _prefill_tile(
    q, acc, m_i, l_i, tile, k_base, v_base, table, rows_pos, kv_end,
    qk_scale, stride_kp, stride_ks, stride_vp, stride_vs,
    offs_n, offs_d, dim_mask,
    PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tokens = tile + offs_n
    token_mask = tokens < kv_end
    pages = tl.load(table + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
    in_page = tokens % PAGE_SIZE
    kv_mask = token_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_base + pages[:, None] * stride_kp + in_page[:, None] * stride_ks + offs_d[None, :],
                mask=kv_mask, other=0.0)
    qk = _mma(q, tl.trans(k), DOT_PRECISION) * qk_scale
    if CAUSAL:
        visible = (tokens[None, :] <= rows_pos[:, None]) & token_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + pages[:, None] * stride_vp + in_page[:, None] * stride_vs + offs_d[None, :],
                mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, kv_starts_ptr,
    out_ptr, qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs,
    stride_bt, stride_sb, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_STARTS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    first_query = q_block * BLOCK_Q
    active = first_query < q_len  # else every loop below is empty and every store masked

    # Row r is query first_query + r // GROUP_PAD of head kv_head * GROUP + r % GROUP_PAD.
    offs_m = tl.arange(0, BLOCK_M)
    query = first_query + offs_m // GROUP_PAD
    member = offs_m % GROUP_PAD
    row_mask = (query < q_len) & (member < GROUP)
    rows_pos = context_len - q_len + query  # absolute position of each row's query
    heads = kv_head * GROUP + member
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    dim_mask = offs_d < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    tok = (q_start + query).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)

    last_pos = context_len - q_len + tl.minimum(first_query + BLOCK_Q, q_len) - 1
    kv_end = tl.where(active, last_pos + 1, 0)  # keys past the block's last query are invisible
    # Tiles run from this kv head's first stored slot (0 without starts): slots before it are
    # never loaded. Keys below the block's first query position are visible to every row: the
    # whole tiles among them need no causal mask.
    head_start = _head_start(kv_starts_ptr, seq, kv_head, stride_sb, HAS_STARTS)
    first_pos = context_len - q_len + first_query
    if HAS_STARTS:
        unmasked_tiles = tl.maximum(first_pos + 1 - head_start, 0) // BLOCK_N
        unmasked_end = tl.where(active, head_start + unmasked_tiles * BLOCK_N, head_start)
    else:
        unmasked_end = tl.where(active, (first_pos + 1) // BLOCK_N * BLOCK_N, 0)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile in range(head_start, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(
            q, acc, m_i, l_i, tile, k_base, v_base, table, rows_pos, kv_end,
            qk_scale, stride_kp, stride_ks, stride_vp, stride_vs, offs_n, offs_d, dim_mask,
            PAGE_SIZE, False, DOT_PRECISION,
        )
    for tile in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(
            q, acc, m_i, l_i, tile, k_base, v_base, table, rows_pos, kv_end,
            qk_scale, stride_kp, stride_ks, stride_vp, stride_vs, offs_n, offs_d, dim_mask,
            PAGE_SIZE, True, DOT_PRECISION,
        )

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    kv_starts: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention for prefill chunks, q [Tq, Hq, D] in varlen layout (see torch_ops); KV
    head h of sequence b from slot kv_starts[b, h] on when `kv_starts [B, Hkv]` is given.

    Rows of `out` past cu_seqlens_q[-1] are not written. The keyword-only knobs override the
    heuristic's `PrefillConfig`.
    """
    _check_cache(q, k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if out.stride(-1) != 1:
        raise ValueError("out needs a contiguous last (head_dim) axis")
    batch = context_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_query_len <= 0:
        return out
    cfg = prefill_config(head_dim, q.dtype, q.device)
    overrides = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    cfg = replace(cfg, **{k: val for k, val in overrides.items() if val is not None})

    group_pad = triton.next_power_of_2(group)
    block_q = max(1, cfg.block_m // group_pad)
    if block_q * group_pad < 16:  # tl.dot needs at least 16 rows
        block_q = 16 // group_pad
    grid = (triton.cdiv(max_query_len, block_q), batch, num_kv_heads)
    starts, stride_sb = _starts_arg(kv_starts, context_lens, batch, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, starts, out,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), stride_sb, out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size, BLOCK_N=cfg.block_n, DOT_PRECISION=_dot_precision(q.dtype),
        HAS_STARTS=kv_starts is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


__all__ = [
    "DecodeConfig", "PrefillConfig", "decode_config", "decode_num_splits", "prefill_config",
    "num_sms", "store_kv", "paged_decode", "paged_prefill",
]
