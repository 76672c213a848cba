"""What one engine step tells the attention layers about its batch.

A step is a flat list of new tokens from several sequences ("varlen" layout): the decoding
sequences first (one token each), then prefill chunks. Each sequence's K/V live in the paged cache;
the new tokens' K/V are written at `slot_mapping` before attention reads them back.

Cache layout: one global pool k_cache, v_cache of shape [num_pages, num_kv_heads, page_size,
head_dim] shared by all layers; each layer of each sequence has its own page table, so the tables,
physical lengths and slots below carry a leading layer axis (layer l's row is what the kernels see).
A slot is `page_id * page_size + offset`; slot -1 means "padding, write nothing".

Per-head variable counts (a keep plan with `lengths`, Ada-KV): pages are head-major, so every KV
head has its own copy of each slot. After compaction KV head h's `len_h` kept tokens sit
right-aligned in slots [M - len_h, M), M = max_h len_h the layer's physical length, and
`kv_starts[l, b, h] = M - len_h` marks the front slots it does not use. New tokens append at the
common slots M, M + 1, ... of every head (slot_mapping is unchanged); head h attends over
[kv_starts[l, b, h], context_lens[l, b]). `kv_starts` is None when every start is 0 (every other
method): the kernels then compile and run exactly as without it.

Decode statistics (`DecodeStats`): a method whose decode hook reads the step's attention (H2O's
column sums, TOVA's last row) gets it from the decode attention itself. The caller hands
`paged_decode` a request (how to fold the probabilities over query heads, and a float32 buffer
`out [num_decodes, R, W]`, W >= every row's length); the kernels fill it, 0 past a row's length
and before a KV head's start. `StatsFold` is the fold alone, as a method declares it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvc.runtime.attention.decode_stats import rows as stats_rows


@dataclass(frozen=True)
class StatsFold:
    """How decode statistics fold the softmax probabilities over query heads: `reduce` "group"
    (each KV head's query heads: R = Hkv rows), "head" (every head: R = 1) or "none" (R = Hq),
    with `fn` "mean" or "sum" (None for "none"). Validated by `decode_stats.check_args`."""

    reduce: str
    fn: str | None = None

    def rows(self, num_heads: int, num_kv_heads: int) -> int:
        return stats_rows(self.reduce, num_heads, num_kv_heads)


@dataclass(frozen=True)
class DecodeStats:
    """A decode step's request for attention statistics: fold `reduce`/`fn`, output `out`
    [num_decodes, R, W] float32 (contiguous last axis), written by `paged_decode(..., stats=)`."""

    reduce: str
    fn: str | None
    out: torch.Tensor


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [L, T] int64: where each new token's K/V go per layer; -1 = skip
    block_tables: torch.Tensor  # [L, B, max_pages] int32: page ids per layer and sequence (pad: 0)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: offsets of each sequence's new tokens in the step
    context_lens: torch.Tensor  # [L, B] int32: physical KV length per layer after this step
    num_decodes: int  # the first num_decodes sequences each have exactly one new token
    max_query_len: int  # longest run of new tokens of one sequence in this step
    max_context_len: int  # bound on context_lens: its longest entry, or a decode graph's context bucket
    kv_starts: torch.Tensor | None = None  # [L, B, Hkv] int32: first slot each KV head reads; None = 0
    # the KV spec's per-sequence rows (runtime/kv/rows.py), when it has SEQ tensors: [B] int32
    rows: torch.Tensor | None = None
    # [L, B] int32: the newest slots each row's residual window held before the step (the ops read
    # those and the step's own from it: torch_ops.window_reads); None: no window
    resid_lens: torch.Tensor | None = None
    # [L, B] int32: the tokens each row's prefill covered, in that layer's slots (the `prompt` of a
    # decode hook: the prompt, or prompt + generated after a recompute; a chain's reused history
    # counted as stored); None where the step builds no decode views
    prompt_lens: torch.Tensor | None = None
    # host copies of cu_seqlens_q, context_lens [L][B] and rows, where the step was built on the host (the
    # runner's eager steps; None in a graph replay): ops that need host values read these, not the device
    host_cu_seqlens: list[int] | None = None
    # [T] int64: each new token's logical position (its RoPE position), which a spec with positions
    # stores per slot (runtime/kv/slot_order.py); None: the step stores none
    positions: torch.Tensor | None = None
    host_context_lens: list[list[int]] | None = None
    # [L, B] int64: the slot each decode row's ranked ring hands to the method's ranking after the step, and
    # the ranked slots [0, first) it competes with (runtime/kv/ring.py `ring_offsets`; -1 and 0: none); None: no
    # row has a ranked ring
    ring_leave: torch.Tensor | None = None
    ring_first: torch.Tensor | None = None
    host_rows: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[1]

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes
