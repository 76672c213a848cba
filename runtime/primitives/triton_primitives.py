"""Triton kernels the generated `triton_kernels.py` files share (the Triton counterpart of
`torch_primitives.py`): one copy here instead of one per method, so a fused kernel is compiled
once per process whatever the method. Their method-specific parts (windows, pooling, reductions,
state) stay in the generated wrappers (compiler/templates/attention_columns.py.jinja).

`column_votes`: per query head, the causal softmax attention of the last `queries` positions
summed over those queries, for each of the first `n_keys` keys, without writing the [query, key]
matrix: a split-K pass for each query's softmax max and normaliser, then a column pass that
recomputes QK^T tile by tile. Both passes take a KV head's whole query group per program, so each
key tile is read once per group, not once per query head (a stacked decode batch scores
rows x kv_heads groups of short windows: the keys are what it reads). Its launch knobs (BLOCK_Q,
BLOCK_K, warps) come from this GPU's `kvc tune` entry for the (queries, keys, heads, kv_heads,
head_dim, dtype) bucket when one was measured for this file's version (runtime/tuning/: kernel
`scores.column_votes`), else from `votes_config`'s heuristic. The keys may be a dense tensor or `PagedKeys`:
a decode batch's rows read where the KV store keeps them (page tables, and the slot order of a layer evicted
in place), with no gathered copy of them."""

import math

import torch
import triton
import triton.language as tl

from kvc.runtime.primitives.paged_keys import PagedKeys
from kvc.runtime.tuning import buckets as tuning_buckets
from kvc.runtime.tuning.lookup import source_hash, tuned

KERNEL = "scores.column_votes"  # the tuning cache's name for the two kernels of `column_votes`
SOURCE_HASH = source_hash(__file__)  # tuned entries recorded for another version of this file are ignored


DENSE = {"PAGED": False, "ORDERED": False, "KV_HEADS": 1, "PAGE": 1}


@triton.jit
def _key_rows(kv_head, k_offs, length, table_ptr, order_ptr, table_stride, stride_page, stride_head, stride_slot,
              HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, ORDERED: tl.constexpr, KV_HEADS: tl.constexpr,
              PAGE: tl.constexpr):
    """Element offsets of key row `kv_head`'s keys `k_offs` (their first channel): dense [kv_heads, length, D],
    or paged (`PagedKeys`)."""
    if PAGED:
        ok = k_offs < length
        if ORDERED:
            slot = tl.load(order_ptr + kv_head.to(tl.int64) * length + k_offs, mask=ok, other=0)
        else:
            slot = k_offs
        page = tl.load(table_ptr + (kv_head // KV_HEADS) * table_stride + slot // PAGE, mask=ok, other=0)
        return page.to(tl.int64) * stride_page + (kv_head % KV_HEADS) * stride_head + (slot % PAGE) * stride_slot
    return (kv_head.to(tl.int64) * length + k_offs) * HEAD_DIM


@triton.jit
def _row_stats(q_ptr, k_ptr, table_ptr, order_ptr, table_stride, stride_page, stride_head, stride_slot,
               m_ptr, l_ptr, queries, length, rows, scale, keys_per_split, q_blocks, splits,
               HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_D: tl.constexpr, IEEE: tl.constexpr, PAGED: tl.constexpr, ORDERED: tl.constexpr,
               KV_HEADS: tl.constexpr, PAGE: tl.constexpr):
    """Partial softmax max and normaliser of each query over one split of its causal keys. A program takes
    BLOCK_Q of the `rows` (= group x queries) query rows of one KV head's group (the group's heads' queries,
    each head's the last positions), so a key tile is read once for all of them; the splits are merged on
    the host side of the wrapper. One grid axis, the query blocks fastest, then the splits, then the KV heads:
    the programs that read the same keys run side by side, so the second reads them from L2."""
    pid = tl.program_id(0)
    kv_head = (pid // (q_blocks * splits)).to(tl.int64)  # a stacked batch's queries pass 2**31 elements
    split = pid // q_blocks % splits
    r_offs = pid % q_blocks * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d_offs = tl.arange(0, BLOCK_D)
    r_ok = r_offs < rows
    q_pos = length - queries + r_offs % queries
    q_tile = tl.load(q_ptr + (kv_head * rows + r_offs[:, None]) * HEAD_DIM + d_offs[None, :],
                     mask=r_ok[:, None] & (d_offs[None, :] < HEAD_DIM), other=0.0)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q], tl.float32)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, length)
    for start in range(lo, hi, BLOCK_K):
        k_offs = start + tl.arange(0, BLOCK_K)
        k_rows = _key_rows(kv_head, k_offs, length, table_ptr, order_ptr, table_stride, stride_page, stride_head,
                           stride_slot, HEAD_DIM, PAGED, ORDERED, KV_HEADS, PAGE)
        k_tile = tl.load(k_ptr + k_rows[:, None] + d_offs[None, :],
                         mask=(k_offs[:, None] < hi) & (d_offs[None, :] < HEAD_DIM), other=0.0)
        if IEEE:
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee") * scale
        else:
            s = tl.dot(q_tile, tl.trans(k_tile)) * scale
        s = tl.where((k_offs[None, :] <= q_pos[:, None]) & (k_offs[None, :] < hi), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        m = m_new
    stats = (kv_head * splits + split) * rows + r_offs
    tl.store(m_ptr + stats, m, mask=r_ok)
    tl.store(l_ptr + stats, l, mask=r_ok)


@triton.jit
def _columns(q_ptr, k_ptr, table_ptr, order_ptr, table_stride, stride_page, stride_head, stride_slot,
             m_ptr, l_ptr, out_ptr, queries, length, n_keys, rows, scale, k_blocks,
             HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_D: tl.constexpr, IEEE: tl.constexpr, PAGED: tl.constexpr, ORDERED: tl.constexpr,
             KV_HEADS: tl.constexpr, PAGE: tl.constexpr, HEADS_A_BLOCK: tl.constexpr):
    """For a block of one KV head's keys, each query head of its group: the head's attention probabilities
    summed over its queries. The key tile is read once for the whole group, whose `rows` (= group x queries)
    query rows are taken BLOCK_R at a time (one matrix product over several heads' queries, as `_row_stats`);
    QK^T is recomputed tile by tile from the row statistics, so no [query, key] matrix is written. A head
    whose rows straddle two blocks adds the second block's sums to the first's; where a block holds whole heads
    (HEADS_A_BLOCK > 0: the queries a power of two dividing BLOCK_R), one reduction over the block's rows viewed
    as [heads, queries, keys] gives all its heads' sums. One grid axis, a KV head's key
    blocks side by side: they read the same queries and statistics, from L2 after the first (a stacked decode
    batch has tens of thousands of groups, whose queries would otherwise be read again from memory per block)."""
    pid = tl.program_id(0)
    kv_head = (pid // k_blocks).to(tl.int64)  # a stacked batch's queries pass 2**31 elements
    k_offs = pid % k_blocks * BLOCK_K + tl.arange(0, BLOCK_K)
    d_offs = tl.arange(0, BLOCK_D)
    k_ok = k_offs < n_keys
    k_rows = _key_rows(kv_head, k_offs, length, table_ptr, order_ptr, table_stride, stride_page, stride_head,
                       stride_slot, HEAD_DIM, PAGED, ORDERED, KV_HEADS, PAGE)
    k_tile = tl.load(k_ptr + k_rows[:, None] + d_offs[None, :],
                     mask=k_ok[:, None] & (d_offs[None, :] < HEAD_DIM), other=0.0)
    group = rows // queries
    for r_start in range(0, rows, BLOCK_R):
        r_offs = r_start + tl.arange(0, BLOCK_R)
        r_ok = r_offs < rows
        q_pos = length - queries + r_offs % queries
        q_tile = tl.load(q_ptr + (kv_head * rows + r_offs[:, None]) * HEAD_DIM + d_offs[None, :],
                         mask=r_ok[:, None] & (d_offs[None, :] < HEAD_DIM), other=0.0)
        m = tl.load(m_ptr + kv_head * rows + r_offs, mask=r_ok, other=0.0)
        inv_l = 1.0 / tl.load(l_ptr + kv_head * rows + r_offs, mask=r_ok, other=1.0)
        if IEEE:
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee") * scale
        else:
            s = tl.dot(q_tile, tl.trans(k_tile)) * scale
        seen = r_ok[:, None] & k_ok[None, :] & (k_offs[None, :] <= q_pos[:, None])
        p = tl.where(seen, tl.exp(s - m[:, None]) * inv_l[:, None], 0.0)
        if HEADS_A_BLOCK > 0:
            votes = tl.sum(tl.reshape(p, [HEADS_A_BLOCK, BLOCK_R // HEADS_A_BLOCK, BLOCK_K]), axis=1)
            heads = r_start // queries + tl.arange(0, HEADS_A_BLOCK)
            out = out_ptr + (kv_head * group + heads)[:, None] * n_keys + k_offs[None, :]
            tl.store(out, votes, mask=(heads < group)[:, None] & k_ok[None, :])
        else:
            member = r_offs // queries
            for head in range(r_start // queries, (tl.minimum(r_start + BLOCK_R, rows) - 1) // queries + 1):
                votes = tl.sum(tl.where((member == head)[:, None], p, 0.0), axis=0)
                out = out_ptr + (kv_head * group + head) * n_keys + k_offs
                earlier = tl.full([BLOCK_K], head * queries, tl.int32) < r_start  # its rows began in an earlier block
                votes += tl.load(out, mask=k_ok & earlier, other=0.0)
                tl.store(out, votes, mask=k_ok)


TILE_BYTES = 1 << 17  # the query and key tiles of one step together, at most (shared memory; wide MLA heads)


def votes_config(queries: int, on_gpu: bool, head_dim: int = 128, element_size: int = 2) -> dict:
    """The heuristic knobs of `column_votes` (what a launch uses without a tuned entry): on a GPU, 64-query and
    128-key tiles, halved (the larger first) while both tiles of padded `head_dim` exceed TILE_BYTES (MLA's
    absorbed 576 channels pad to 1024); 8 warps over 128 keys (an H100 at a stacked evicting step's shape,
    `bench/votes_bench.py`: 7.4 ms where 64-key tiles and 4 warps took 9.2; docs/benchmarks.md), else 4."""
    if not on_gpu:
        return {"block_q": 16, "block_k": 16, "num_warps": 4}
    block_q, block_k = max(16, min(64, triton.next_power_of_2(queries))), 128
    width = max(16, triton.next_power_of_2(head_dim)) * element_size
    while (block_q + block_k) * width > TILE_BYTES and max(block_q, block_k) > 16:
        if block_k >= block_q:
            block_k //= 2
        else:
            block_q //= 2
    return {"block_q": block_q, "block_k": block_k, "num_warps": 8 if block_k >= 128 else 4}


def stats_rows(block_q: int, block_k: int, rows: int, width: int, on_gpu: bool) -> int:
    """Query rows a program of either pass takes at a time: `block_q`, doubled on a GPU up to 128 (or the
    group's rows) while the query and key tiles stay within TILE_BYTES (the statistics pass: fewer programs read
    each key tile; the column pass: a matrix product over several heads' queries)."""
    block = block_q
    limit = min(128, triton.next_power_of_2(rows))
    while on_gpu and 2 * block <= limit and (2 * block + block_k) * width <= TILE_BYTES:
        block *= 2
    return block


def launch_config(queries: int, keys: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  on_gpu: bool) -> dict:
    """This GPU's tuned knobs for the bucket (`kvc tune`), else `votes_config`."""
    cfg = votes_config(queries, on_gpu, head_dim, torch.empty((), dtype=dtype).element_size())
    knobs = tuned(KERNEL, tuning_buckets.votes(queries, keys, heads, kv_heads, head_dim, dtype), SOURCE_HASH)
    return {**cfg, **knobs} if knobs else cfg


def column_votes(q, k, n_keys, *, block_q=None, block_k=None, num_warps=None):
    """q [heads, queries, D] (the last positions), k [kv_heads, keys, D] (a tensor, or `PagedKeys`) -> float32
    [heads, n_keys] on q's device; float32 inputs are multiplied in full float32 precision, others natively with
    float32 sums. Knobs given override the launch config (tuned entry or heuristic)."""
    if isinstance(k, PagedKeys):
        key_ptr, key_args, key_consts = k.plane, k.args(), k.constants()
    else:
        k = k.contiguous()
        key_ptr, key_args, key_consts = k, (k, k, 0, 0, 0, 0), DENSE  # (table and order unread)
    q = q.to(k.dtype).contiguous()
    heads, queries = q.shape[0], q.shape[1]
    kv_heads, length, head_dim = k.shape
    group = heads // kv_heads
    device, f32 = q.device, torch.float32
    on_gpu = device.type != "cpu"
    if block_q is None or block_k is None or num_warps is None:
        cfg = launch_config(queries, length, heads, kv_heads, head_dim, k.dtype, on_gpu)
        block_q, block_k = block_q or cfg["block_q"], block_k or cfg["block_k"]
        num_warps = num_warps or cfg["num_warps"]
    block_d = max(16, triton.next_power_of_2(head_dim))
    scale = 1.0 / math.sqrt(head_dim)
    ieee = k.dtype == f32
    rows = group * queries  # a KV head's query rows: its group's heads' queries, contiguous in q
    element_size = torch.empty((), dtype=k.dtype).element_size()
    block_r = stats_rows(block_q, block_k, rows, block_d * element_size, on_gpu)
    q_blocks = triton.cdiv(rows, block_r)
    splits = max(1, min(triton.cdiv(length, 4 * block_k), triton.cdiv(512, kv_heads * q_blocks))) if on_gpu else 2
    keys_per_split = triton.cdiv(triton.cdiv(length, splits), block_k) * block_k
    splits = triton.cdiv(length, keys_per_split)
    m_part = torch.empty(kv_heads, splits, rows, dtype=f32, device=device)
    l_part = torch.empty(kv_heads, splits, rows, dtype=f32, device=device)
    _row_stats[(kv_heads * q_blocks * splits,)](
        q, key_ptr, *key_args, m_part, l_part, queries, length, rows, scale, keys_per_split, q_blocks, splits,
        HEAD_DIM=head_dim,
        BLOCK_Q=block_r, BLOCK_K=block_k, BLOCK_D=block_d, IEEE=ieee, num_warps=num_warps, **key_consts)
    m = m_part.amax(dim=1)  # [kv_heads, rows]: [heads, queries] in memory
    l = (l_part * torch.exp(m_part - m[:, None]).nan_to_num(0.0)).sum(dim=1).contiguous()
    m = m.contiguous()
    votes = torch.empty(heads, n_keys, dtype=f32, device=device)
    k_blocks = triton.cdiv(n_keys, block_k)
    whole = queries & (queries - 1) == 0 and block_r % queries == 0  # a block holds whole heads
    _columns[(kv_heads * k_blocks,)](
        q, key_ptr, *key_args, m, l, votes, queries, length, n_keys, rows, scale, k_blocks, HEAD_DIM=head_dim,
        BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_D=block_d, IEEE=ieee, HEADS_A_BLOCK=block_r // queries if whole else 0,
        num_warps=num_warps, **key_consts)
    return votes
