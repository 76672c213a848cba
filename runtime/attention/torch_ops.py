"""Paged attention in plain PyTorch: the CPU backend and the oracle for the Triton kernels.

Sits between the model's attention layers and the paged KV cache (see `metadata.py` for the
layout). Each sequence's keys and values are gathered from its pages into a dense tensor and
attention runs through `torch.nn.functional.scaled_dot_product_attention` in the input dtype, so
that in float32 the engine matches Hugging Face token for token. The generated Triton kernels
(kernels_generated/_attention/, loaded by `triton_ops.py`) implement the same three functions with
the same signatures. `paged_decode(..., stats=)` also computes the decode statistics a method
reads (`decode_stats.decode_stats_torch`, the oracle of the kernels that emit them).

K and V are each a dense cache or a `QuantizedPages` source (sources.py: codes, scales, zero
points and an optional full-precision residual window), decoded by runtime/kv/encodings.py; a dense
operand takes exactly the code path it always took. `rows [B]` (each sequence's SEQ row) and
`resid_lens [B]` say which newest slots come from the residual; `paged_decode(..., read=ReadPlan)`
attends only to the slots a plan lists (runtime/kv/plans.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvc.runtime.attention import decode_stats
from kvc.runtime.attention.decode_stats import decode_stats_torch
from kvc.runtime.attention.metadata import DecodeStats
from kvc.runtime.attention.sources import LowRankPages, QuantizedPages, Source, is_dense, within_keys
from kvc.runtime.kv import encodings, lowrank, rotation
from kvc.runtime.kv.plans import Estimate, ReadPlan
from kvc.runtime.kv.spec import flush_from, flushed


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: Source,
    v_cache: Source,
    slot_mapping: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    context_lens: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    window_tokens: int | None = None,
    resid_lens: torch.Tensor | None = None,
) -> None:
    """Write new keys/values k, v [T, Hkv, D] into their slots; slot -1 writes nothing.

    A `QuantizedPages` operand gets the tokens quantized into its codes, scale and zero point
    (float codes: into the codes only, against the layer's fixed scale);
    one with a residual window also gets them in full precision at `residual[row, h, t % R]`, t
    being the token's slot in its sequence's layer. That needs each token's sequence: give the
    step's `cu_seqlens_q [B + 1]`, `context_lens [B]` (lengths after the step) and `rows [B]` (the
    sequences' SEQ rows); token i of sequence b sits at slot `context_lens[b] - cu_seqlens_q[b + 1]
    + i`. Only a sequence's newest R tokens of the step are written to the window (older ones
    would be overwritten within the step anyway). An encoding with a flush block (`Quantized.
    flush_block`) writes no codes per token: the blocks the step leaves behind are quantized first,
    from the window and the step's tokens, into the slots `block_tables [B, pages]` address; given the
    windows' counts before the step, `resid_lens [B]`, a block the window does not hold is left as it is
    (`spec.flush_from`: its codes came with a prefix-cache hit).
    `window_tokens` n: only tokens [0, n) enter the windows now (the decodes); a prefill chunk's
    enter after its attention (`store_window`), which reads the window's older slots that the
    chunk's would overwrite.

    Uses a boolean mask (one host sync), so this path is not CUDA-graph capturable; the Triton
    version is. Each (token, head) is one row of the cache seen as [pages * Hkv * page_size, D]
    (pages are head-major), written by `index_copy_`: a row copy, where indexing pages and offsets
    around the head slice took the slow generic path (2.5x the time at a 2K-token chunk).
    """
    _, num_kv_heads, page_size, head_dim = k_cache.shape
    for x, cache in ((k, k_cache), (v, v_cache)):
        if isinstance(cache, QuantizedPages) and cache.enc.flush_block:
            _flush_blocks(cache, x, cu_seqlens_q, context_lens, rows, block_tables, resid_lens)
    keep = slot_mapping >= 0
    tokens = None  # the kept tokens' indices, when a residual window needs their sequences
    if bool(keep.all()):  # the usual step: no padding, so no masked copies of k and v
        slots = slot_mapping.long()
    else:
        slots, k, v = slot_mapping[keep].long(), k[keep], v[keep]
        tokens = keep.nonzero().flatten()
    heads = torch.arange(num_kv_heads, device=slots.device)
    flat = ((slots // page_size * num_kv_heads)[:, None] + heads[None, :]) * page_size + (slots % page_size)[:, None]
    flat = flat.flatten()  # [n * Hkv], token-major like k
    for x, cache in ((k, k_cache),) if within_keys(v_cache, k_cache) else ((k, k_cache), (v, v_cache)):
        if is_dense(cache):
            cache.view(-1, head_dim).index_copy_(0, flat, x.reshape(-1, head_dim).to(cache.dtype))
            continue
        if isinstance(cache, LowRankPages):  # the latent of each head's group, keys at their slots' positions
            positions = None if cache.rope is None else _token_slots(
                cache, slot_mapping.shape[0], tokens, cu_seqlens_q, context_lens, x.device)
            _write_slots(cache.latent, flat, slots, heads, cache.encode(x, positions))
            continue
        if cache.enc.format:  # float codes against the layer's fixed scale (read at the slots' pages: any)
            scale = cache.scale[0, :, 0].float()  # [Hkv, 1]
            stored = rotation.to_stored(x, cache.enc.rotation)
            codes = encodings.quantize_float(stored, torch.where(scale > 0, scale, 1.0), cache.enc.format)
            _write_slots(cache.codes, flat, slots, heads, codes)
            continue
        if cache.enc.flush_block:
            _store_residual(cache, x, slot_mapping.shape[0], tokens, cu_seqlens_q, context_lens, rows, window_tokens)
            continue
        codes, scale, zero = encodings.quantize(
            x, cache.enc, cache.codes.dtype, packing=encodings.packing_of(head_dim, cache.codes.shape[-1]),
            scale_dtype=cache.scale.dtype, zero_dtype=cache.scale.dtype if cache.zero is None else cache.zero.dtype)
        for dst, new in ((cache.codes, codes), (cache.scale, scale), (cache.zero, zero)):
            if dst is not None:
                _write_slots(dst, flat, slots, heads, new)
        if cache.residual is not None:
            _store_residual(cache, x, slot_mapping.shape[0], tokens, cu_seqlens_q, context_lens, rows, window_tokens)


def store_window(k: torch.Tensor, v: torch.Tensor, k_cache: Source, v_cache: Source, slot_mapping: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, rows: torch.Tensor, first: int) -> None:
    """The step's tokens [first, T) (its prefill chunks, after their attention) into the residual
    windows of their sequences' rows (`store_kv(..., window_tokens=first)` left them out)."""
    stored = (slot_mapping >= 0) & (torch.arange(slot_mapping.shape[0], device=slot_mapping.device) >= first)
    tokens = stored.nonzero().flatten()
    for x, cache in ((k, k_cache), (v, v_cache)):
        if not is_dense(cache) and cache.residual is not None:
            _store_residual(cache, x[tokens], slot_mapping.shape[0], tokens, cu_seqlens_q, context_lens, rows)


def _flush_blocks(source: QuantizedPages, x: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                  context_lens: torch.Tensor | None, rows: torch.Tensor | None,
                  block_tables: torch.Tensor | None, resid_lens: torch.Tensor | None = None) -> None:
    """The codes of every block that the step's tokens x [T, Hkv, D] leave behind (runtime/kv/spec.py,
    `Quantized.flush_block`): slots from the window where an earlier step stored them, from x where
    this one does. Runs before the window takes the step's tokens, which may overwrite its slots."""
    if cu_seqlens_q is None or context_lens is None or rows is None or block_tables is None:
        raise ValueError(f"store_kv: quantized {source.enc.codes!r} is written a block at a time; pass cu_seqlens_q, "
                         "context_lens, rows and block_tables")
    enc, window, page_size = source.enc, source.window, source.codes.shape[2]
    starts, lengths, row_ids = cu_seqlens_q.tolist(), context_lens.tolist(), rows.tolist()
    held = None if resid_lens is None else resid_lens.tolist()
    scale_pages = source.scale[:, :, 0]  # [P, Hkv, D]: the page's one row (the slots are a stride-0 view of it)
    zero_pages = None if source.zero is None else source.zero[:, :, 0]
    for b, end in enumerate(lengths):
        new = starts[b + 1] - starts[b]
        first = end - new
        lo = flushed(first, enc.flush_block) if held is None else flush_from(first, held[b], enc.flush_block)
        hi = flushed(end, enc.flush_block)
        if hi <= lo:
            continue
        slots = torch.arange(lo, hi, device=x.device)
        old = slots < first
        values = torch.where(old[:, None, None],
                             source.residual[row_ids[b], :, slots % window].transpose(0, 1).to(x.dtype),
                             x[(starts[b] + slots - first).clamp(min=starts[b])])
        codes, scale, zero = encodings.quantize(
            values, enc, source.codes.dtype, packing=encodings.packing_of(source.head_dim, source.codes.shape[-1]),
            scale_dtype=source.scale.dtype, zero_dtype=source.scale.dtype if source.zero is None else source.zero.dtype)
        pages, offsets = block_tables[b].long()[slots // page_size], slots % page_size
        source.codes[pages, :, offsets] = codes
        scale_pages[pages] = scale.repeat_interleave(enc.group, dim=0)  # every slot's page: its group's row
        if zero_pages is not None:
            zero_pages[pages] = zero.repeat_interleave(enc.group, dim=0)


def _write_slots(dst: torch.Tensor, flat: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor,
                 new: torch.Tensor) -> None:
    """new [n, Hkv, E] into the TOKEN tensor dst [pages, Hkv, page_size, E] at `slots`."""
    new, dst = encodings.raw(new.to(dst.dtype)), encodings.raw(dst)
    if dst.is_contiguous():
        dst.view(-1, dst.shape[-1]).index_copy_(0, flat, new.reshape(-1, dst.shape[-1]).to(dst.dtype))
    else:
        page_size = dst.shape[2]
        dst[(slots // page_size)[:, None], heads[None, :], (slots % page_size)[:, None]] = new.to(dst.dtype)


def token_slots(tokens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq, slot) of a step's new tokens `tokens` (their indices in the step): each one's sequence
    (clamped to the batch) and its slot in that sequence's layer, `context_lens[b] - cu_seqlens_q[b
    + 1] + i`. Device tensors only (CUDA-graph safe): what residual windows and keys stored before
    RoPE are written by."""
    ends = cu_seqlens_q[1:].to(device=tokens.device, dtype=torch.long)
    seq = torch.searchsorted(ends, tokens, right=True).clamp(max=max(ends.shape[0] - 1, 0))
    return seq, context_lens.to(device=tokens.device, dtype=torch.long)[seq] - ends[seq] + tokens


def _token_slots(source: Source, num_tokens: int, tokens: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                 context_lens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Each kept new token's slot (`tokens`: their indices in the step, None: all): what a
    position-dependent store (keys stored before RoPE) reads its position from."""
    if cu_seqlens_q is None or context_lens is None:
        raise ValueError(f"store_kv: {source.enc.latent!r} stores keys before RoPE at their slots' positions; pass "
                         "cu_seqlens_q and context_lens")
    return token_slots(torch.arange(num_tokens, device=device) if tokens is None else tokens, cu_seqlens_q,
                       context_lens)[1]


def _store_residual(source: QuantizedPages, x: torch.Tensor, num_tokens: int, tokens: torch.Tensor | None,
                    cu_seqlens_q: torch.Tensor | None, context_lens: torch.Tensor | None,
                    rows: torch.Tensor | None, window_tokens: int | None = None) -> None:
    """The kept tokens x [n, Hkv, D] (`tokens`: their indices in the step, None: all; only those
    below `window_tokens` when given) into the residual window of their sequences' rows."""
    if cu_seqlens_q is None or context_lens is None or rows is None:
        raise ValueError(f"store_kv: quantized {source.enc.codes!r} keeps a residual window; pass cu_seqlens_q, "
                         "context_lens and rows so that each new token finds its sequence's row")
    device = x.device
    if tokens is None:
        tokens = torch.arange(num_tokens, device=device)
    seq, position = token_slots(tokens, cu_seqlens_q, context_lens)  # the token's slot in its sequence's layer
    lengths = context_lens.to(device=device, dtype=torch.long)[seq]
    window = source.window
    newest = position >= lengths - window  # older tokens of a long chunk would be overwritten anyway
    if window_tokens is not None:
        newest &= tokens < window_tokens
    row = rows.to(device=device, dtype=torch.long)[seq][newest]
    heads = torch.arange(x.shape[1], device=device)
    source.residual[row[:, None], heads[None, :], (position[newest] % window)[:, None]] = x[newest].to(source.dtype)


def gather_kv(
    cache: torch.Tensor, page_ids: torch.Tensor, length: int | None = None
) -> torch.Tensor:
    """Pages `page_ids` [..., n] of one layer's cache as dense [..., Hkv, n * page_size, D].

    `index_select` copies whole pages (a few KB each) where advanced indexing copied element by
    element: 3x faster on the CPU for a 2K-token chunk, 1.6x for a decode batch's tables. On CUDA one
    row's pages go head-major in one pass (runtime/primitives/pages_triton.py) instead of two copies."""
    if cache.is_cuda:
        from kvc.runtime.primitives import pages_triton  # imports triton: only a CUDA gather asks

        if pages_triton.fits(cache, page_ids):
            dense = pages_triton.gather(cache, page_ids)
            return dense if length is None else dense[..., :length, :]
    ids = page_ids.long()
    pages = cache.index_select(0, ids.flatten()).view(*ids.shape, *cache.shape[1:])  # [..., n, Hkv, S, D]
    pages = pages.movedim(-3, -4)  # [..., Hkv, n, S, D]
    dense = pages.flatten(-3, -2)  # [..., Hkv, n * S, D]
    return dense if length is None else dense[..., :length, :]


def gather_source(source: Source, page_ids: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """`gather_kv` of a dense cache or a quantized source, decoded: [..., Hkv, n * page_size, D] in
    the source's dtype (before any residual override, `with_residual`)."""
    if is_dense(source):
        return gather_kv(source, page_ids, length)
    if isinstance(source, LowRankPages):  # a sequence's pages from its first: slot t is position t
        latent = gather_kv(source.latent, page_ids, length)
        return source.decode(latent, torch.arange(latent.shape[-2], device=latent.device))
    codes = gather_kv(source.codes, page_ids, length)
    scale = gather_kv(source.scale, page_ids, length)
    zero = None if source.zero is None else gather_kv(source.zero, page_ids, length)
    return encodings.dequantize(codes, scale, zero, source.enc, source.head_dim, source.dtype)


def reads_chunk_exact(source: Source, resid_lens: torch.Tensor | None) -> bool:
    """Does a prefill chunk read this operand's own slots as computed (`Quantized.exact_chunk`)?"""
    return reads_residual(source, resid_lens) or (not is_dense(source) and source.enc.exact_chunk)


def reads_residual(source: Source, resid_lens: torch.Tensor | None) -> bool:
    return resid_lens is not None and not is_dense(source) and source.residual is not None


def window_reads(source: QuantizedPages, resid_lens: torch.Tensor, context_lens: torch.Tensor,
                 new: torch.Tensor | int = 1) -> torch.Tensor:
    """[B] int64: each row's newest slots read from the source's window: the step's `new` tokens and
    those the window held before the step (`resid_lens`), at most the residual length R = W - 1,
    and under a flush block B only those of the unfinished block (`first % B`, first = the step's
    first slot; runtime/kv/spec.py)."""
    held = resid_lens.long()
    new = torch.as_tensor(new, device=held.device).long()
    first = context_lens.to(held.device).long() - new
    block = source.enc.flush_block
    cap = first % block if block else torch.full_like(first, source.window - 1)
    return torch.minimum(held, cap) + new


def with_residual(x: torch.Tensor, source: Source, rows: torch.Tensor | None, resid_lens: torch.Tensor | None,
                  context_lens: torch.Tensor, new: torch.Tensor | int = 1) -> torch.Tensor:
    """x [B, Hkv, L, D] (slot t of row b at x[b, :, t]) with each row's newest slots taken from the
    source's residual window (`window_reads`: `resid_lens[b]` held before the step, `new` stored by
    it; x itself when nothing is read from one)."""
    if not reads_residual(source, resid_lens):
        return x
    if rows is None:
        raise ValueError("a residual window is read by the sequences' rows: pass rows with resid_lens")
    length, window = x.shape[2], source.window
    slots = torch.arange(length, device=x.device)
    lengths = context_lens.to(x.device).long()[:, None]
    newest = (slots[None, :] >= lengths - window_reads(source, resid_lens, context_lens, new).to(x.device)[:, None]) & (
        slots[None, :] < lengths)
    recent = source.residual[rows.to(x.device).long()[:, None], :, (slots % window)[None, :]]  # [B, L, Hkv, D]
    return torch.where(newest[:, None, :, None], recent.transpose(1, 2).to(x.dtype), x)


def plan_slots(read: ReadPlan, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [B, Hkv, n] int64, listed [B, Hkv, n] bool) of a read plan: every slot of each listed
    page (n = P * page_size) or the listed tokens (n = T); -1 entries are not listed."""
    if read.pages is not None:
        pages = read.pages.long()
        offsets = torch.arange(page_size, device=pages.device)
        slots = (pages[..., None] * page_size + offsets).flatten(-2)
        return slots, (pages >= 0)[..., None].expand(*pages.shape, page_size).flatten(-2)
    tokens = read.tokens.long()
    return tokens, tokens >= 0


def read_slots(source: Source, page_ids: torch.Tensor, offsets: torch.Tensor,
               slots: torch.Tensor | None = None) -> torch.Tensor:
    """Slot `offsets` of page `page_ids` (both [B, Hkv, n]) of each KV head, decoded: [B, Hkv, n, D].
    `slots` [B, Hkv, n]: those slots' indices in their sequences (a low-rank source's positions)."""
    heads = torch.arange(page_ids.shape[1], device=page_ids.device)[None, :, None]
    if is_dense(source):
        return source[page_ids, heads, offsets]
    if isinstance(source, LowRankPages):  # each head reads its group's latent: every member's share at the slot
        g = source.enc.group
        members = (heads // g * g)[..., None] + torch.arange(g, device=page_ids.device)  # [1, Hkv, 1, g]
        shares = source.latent[page_ids[..., None], members, offsets[..., None]]  # [B, Hkv, n, g, c]
        # every head of the group sees the same latent: decode it as head j's own with its up rows
        latent = shares.flatten(-2)  # [B, Hkv, n, rank]
        up = source.up.float()  # [Hkv, D, rank]
        x = torch.einsum("bhnr,hdr->bhnd", latent.float(), up)
        if source.rope is not None:
            if slots is None:
                raise ValueError(f"read_slots: {source.enc.latent!r} decodes keys at their slots: pass slots")
            x = lowrank.rope(x, slots, source.rope)
        return x.to(source.dtype)
    zero = None if source.zero is None else source.zero[page_ids, heads, offsets]
    return encodings.dequantize(source.codes[page_ids, heads, offsets], source.scale[page_ids, heads, offsets], zero,
                                source.enc, source.head_dim, source.dtype)


def paged_decode(
    q: torch.Tensor,
    k_cache: Source,
    v_cache: Source,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
    kv_starts: torch.Tensor | None = None,
    stats: DecodeStats | None = None,
    rows: torch.Tensor | None = None,
    resid_lens: torch.Tensor | None = None,
    read: ReadPlan | None = None,
) -> torch.Tensor:
    """One query per sequence, q [B, Hq, D], over its first context_lens[b] cached tokens;
    `stats` (metadata.py) also asks for the step's attention statistics (into `stats.out`).

    Rows with context_lens == 0 (CUDA-graph padding) come out as zeros. `kv_starts [B, Hkv]`
    (None: all 0): KV head h of sequence b reads only slots [kv_starts[b, h], context_lens[b])
    (per-head variable counts, stored right-aligned; see `metadata.py`). `max_context_len` bounds
    every row's length (default: everything the block table can address).

    `k_cache` / `v_cache`: dense caches or `QuantizedPages` (sources.py). With `resid_lens [B]`
    int32 (the newest slots each row's window held before the step), the step's token and the
    window's newest `window_reads` are read from a quantized operand's residual window,
    `residual[rows[b], h, t % W]` (`rows [B]` int32: the SEQ rows).
    `read` (a ReadPlan): KV head h of row b attends only to the slots the plan lists for it that
    are stored (below context_lens[b], at or past kv_starts[b, h]); a row that reads none comes out
    as zeros. With `stats`, the statistics cover the slots read, every other entry 0.

    On a GPU all sequences run in one batched SDPA over `max_context_len` keys with a key-padding
    mask, so there is no host sync (CUDA graphs capture it). On the CPU, where reading the lengths
    costs nothing, each row gathers and attends over its own keys only: the batched form copied
    every row's pages up to the longest row and then masked them (half a decode step at batch 8 of
    500-2,000 tokens). A read plan gathers only the slots it lists, batched, on either device.
    """
    residual = (rows, resid_lens)
    if read is not None and read.last is not None and _gathers_last(read, max_context_len, block_tables, k_cache):
        o = _decode_by_plan(q, k_cache, v_cache, block_tables, context_lens, scale, kv_starts,
                            _last_listed(read, context_lens), residual, stats)
    elif read is not None and read.last is not None:
        o = _decode_by_token_mask(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, kv_starts,
                                  read, residual, stats)
    elif read is not None:
        o = _decode_by_plan(q, k_cache, v_cache, block_tables, context_lens, scale, kv_starts, read, residual,
                            stats)
    elif q.device.type == "cpu":
        o = _decode_by_row(q, k_cache, v_cache, block_tables, context_lens, scale, kv_starts, out, residual)
    else:
        o = _decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, kv_starts,
                           residual)
    if stats is not None and read is None:
        if is_dense(k_cache):
            decode_stats_torch(q, k_cache, block_tables, context_lens, scale, stats.out, stats.reduce, stats.fn,
                               kv_starts=kv_starts)
        else:
            decode_stats.check_args(q, k_cache, stats.out, stats.reduce, stats.fn)
            width = stats.out.shape[-1]
            pages = min(-(-width // k_cache.shape[2]), block_tables.shape[1])
            keys = with_residual(gather_source(k_cache, block_tables[:, :pages]), k_cache, rows, resid_lens,
                                 context_lens)
            decode_stats.stats_from_keys(q, keys, context_lens, scale, stats.out, stats.reduce, stats.fn, kv_starts)
    if out is None or o is out:
        return o
    out.copy_(o)
    return out


def _decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, kv_starts,
                   residual=(None, None)):
    """paged_decode as one batched SDPA with a key-padding mask (no host value read)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * page_size
    max_context_len = max(int(max_context_len), 1)
    num_pages = min(-(-max_context_len // page_size), block_tables.shape[1])
    length = min(max_context_len, num_pages * page_size)

    page_ids = block_tables[:, :num_pages]
    keys = with_residual(gather_source(k_cache, page_ids, length), k_cache, *residual, context_lens)  # [B, Hkv, L, D]
    values = with_residual(gather_source(v_cache, page_ids, length), v_cache, *residual, context_lens)
    slots = torch.arange(length, device=q.device)
    valid = slots[None, :] < context_lens[:, None]  # [B, L]
    if kv_starts is None:
        mask = valid[:, None, None, :]
    else:  # [B, Hkv, 1, L]: each kv head from its own start
        mask = (valid[:, None, :] & (slots[None, None, :] >= kv_starts[:, :, None]))[:, :, None, :]

    # The query heads of one GQA group become the "query length" axis of their kv head: the same
    # q.k dot products as repeating K/V per query head, without the copy.
    grouped_q = q.reshape(batch, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(
        grouped_q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale,
    )
    o = o.reshape(batch, num_q_heads, -1)
    return torch.where((context_lens > 0)[:, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))


def _decode_by_row(q, k_cache, v_cache, block_tables, context_lens, scale, kv_starts, out, residual=(None, None)):
    """paged_decode one row at a time over exactly its context_lens[b] keys (host lengths); a mask
    only for a row with per-head starts. Writes into `out` when given."""
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    rows, resid_lens = residual
    o = q.new_zeros(*q.shape[:2], v_cache.shape[-1]) if out is None else out
    head_starts = None if kv_starts is None else kv_starts.tolist()
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            o[b] = 0
            continue
        pages = block_tables[b, : -(-length // page_size)]
        keys, values = (_row_operand(cache, pages, length, b, context_lens, residual, q.dtype)  # [1, Hkv, n, D]
                        for cache in (k_cache, v_cache))
        mask = None
        if head_starts is not None and any(head_starts[b]):  # [1, Hkv, 1, n]
            mask = (torch.arange(length, device=q.device)[None, :] >= kv_starts[b][:, None])[None, :, None, :]
        grouped_q = q[b].reshape(1, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # as in _decode_padded
        row = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=scale)
        o[b] = row.reshape(num_q_heads, -1)
    return o


def _row_operand(cache: Source, pages: torch.Tensor, length: int, b: int, context_lens: torch.Tensor,
                 residual: tuple, dtype: torch.dtype, new: int = 1) -> torch.Tensor:
    """Row b's first `length` slots of one operand, [1, Hkv, length, D] in `dtype`, decoded and with
    its residual window read in (a dense cache: the plain gather it always was)."""
    rows, resid_lens = residual
    if is_dense(cache):
        return gather_kv(cache, pages, length).to(dtype)[None]
    one = slice(b, b + 1)
    x = gather_source(cache, pages, length)[None]
    return with_residual(x, cache, None if rows is None else rows[one], None if resid_lens is None else resid_lens[one],
                         context_lens[one], new).to(dtype)


def _decode_by_plan(q, k_cache, v_cache, block_tables, context_lens, scale, kv_starts, read, residual, stats):
    """paged_decode over the slots a read plan lists, gathered per (row, KV head) into [B, Hkv, n, D]
    (batched, no host value read) and attended with a mask of the stored ones."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    plan = read.pages if read.pages is not None else read.tokens
    if plan.shape[:2] != (batch, num_kv_heads):
        raise ValueError(f"the read plan is for [{plan.shape[0]}, {plan.shape[1]}] rows x KV heads, the step has "
                         f"[{batch}, {num_kv_heads}]")
    slots, listed = plan_slots(read, page_size)  # [B, Hkv, n]
    lengths = context_lens.to(q.device).long()
    stored = listed & (slots < lengths[:, None, None]) & (slots >= 0)
    if kv_starts is not None:
        stored &= slots >= kv_starts.to(q.device).long()[:, :, None]
    safe = torch.where(stored, slots, 0)
    table_index = (safe // page_size).clamp(max=block_tables.shape[1] - 1)
    page_ids = block_tables.long().gather(1, table_index.flatten(1)).view_as(safe)
    rows, resid_lens = residual
    operands = []
    for cache in (k_cache, v_cache):
        x = read_slots(cache, page_ids, safe % page_size, safe)  # [B, Hkv, n, D]
        if reads_residual(cache, resid_lens):
            if rows is None:
                raise ValueError("a residual window is read by the sequences' rows: pass rows with resid_lens")
            newest = safe >= (lengths - window_reads(cache, resid_lens, lengths).to(q.device))[:, None, None]
            heads = torch.arange(num_kv_heads, device=q.device)[None, :, None]
            recent = cache.residual[rows.to(q.device).long()[:, None, None], heads, safe % cache.window]
            x = torch.where(newest[..., None], recent.to(x.dtype), x)
        operands.append(x.to(q.dtype))
    keys, values = operands
    grouped_q = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    if stats is not None and read.estimate is not None:
        raise NotImplementedError("decode statistics of a read plan with an estimate are not computed yet")
    o = _attend(grouped_q, keys, values, stored, scale, read.estimate)
    if stats is not None:
        decode_stats.check_args(q, k_cache, stats.out, stats.reduce, stats.fn)
        decode_stats.stats_over_slots(q, keys, slots, stored, scale, stats.out, stats.reduce, stats.fn)
    return o.reshape(batch, num_q_heads, -1)


def _gathers_last(read: ReadPlan, max_context_len: int | None, block_tables: torch.Tensor, k_cache: Source) -> bool:
    """Is a bounded newest range worth gathering (`_last_listed`): when the bound is under half the
    width a masked read would cover (a gather costs more per slot than a contiguous read)."""
    if read.last_bound is None:
        return False
    width = max_context_len if max_context_len is not None else block_tables.shape[1] * k_cache.shape[2]
    return 2 * (read.last_bound + read.tokens.shape[2]) < width


def _last_listed(read: ReadPlan, context_lens: torch.Tensor) -> ReadPlan:
    """A token plan whose `last` is bounded (`last_bound`) as a plain token plan: the newest
    `last_bound` slots appended, each outside its row's newest `last[b]` as -1, and a listed slot
    inside that range dropped from the list (it is read once, through the range)."""
    tokens = read.tokens.long()
    lengths = context_lens.to(tokens.device).long()[:, None, None]
    first_newest = lengths - read.last.to(tokens.device).long()[:, None, None]
    tokens = torch.where(tokens >= first_newest, -1, tokens)
    newest = lengths - read.last_bound + torch.arange(read.last_bound, device=tokens.device)[None, None, :]
    newest = torch.where(newest >= first_newest, newest, -1).expand(*tokens.shape[:2], read.last_bound)
    return ReadPlan(tokens=torch.cat([tokens, newest], dim=2).to(torch.int32), estimate=read.estimate)


def _decode_by_token_mask(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, kv_starts, read,
                          residual, stats):
    """paged_decode of a token plan with a per-row range of newest slots (`read.last`): the rows'
    keys as `_decode_padded` lays them out, attended with the mask of the listed tokens and the
    range (no host value read). The range's length varies by row, so the listed slots are a mask
    over the row's width rather than a gather of a fixed count."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    tokens = read.tokens
    if tokens.shape[:2] != (batch, num_kv_heads):
        raise ValueError(f"the read plan is for [{tokens.shape[0]}, {tokens.shape[1]}] rows x KV heads, the step has "
                         f"[{batch}, {num_kv_heads}]")
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * page_size
    num_pages = min(-(-max(int(max_context_len), 1) // page_size), block_tables.shape[1])
    length = num_pages * page_size
    page_ids = block_tables[:, :num_pages]
    keys = with_residual(gather_source(k_cache, page_ids, length), k_cache, *residual, context_lens)  # [B, Hkv, L, D]
    values = with_residual(gather_source(v_cache, page_ids, length), v_cache, *residual, context_lens)
    lengths = context_lens.to(q.device).long()[:, None, None]
    listed = (tokens >= 0) & (tokens < length)
    mask = torch.zeros((batch, num_kv_heads, length + 1), dtype=torch.bool, device=q.device)
    mask.scatter_(2, torch.where(listed, tokens.long(), length), True)  # unlisted entries land in the extra column
    slots = torch.arange(length, device=q.device)[None, None, :]
    mask = (mask[..., :length] | (slots >= lengths - read.last.to(q.device).long()[:, None, None])) & (slots < lengths)
    if kv_starts is not None:
        mask &= slots >= kv_starts.to(q.device).long()[:, :, None]
    grouped_q = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    if stats is not None and read.estimate is not None:
        raise NotImplementedError("decode statistics of a read plan with an estimate are not computed yet")
    o = _attend(grouped_q, keys.to(q.dtype), values.to(q.dtype), mask, scale, read.estimate)
    if stats is not None:
        decode_stats.check_args(q, k_cache, stats.out, stats.reduce, stats.fn)
        decode_stats.stats_over_slots(q, keys.to(q.dtype), slots.expand(batch, num_kv_heads, length), mask, scale,
                                      stats.out, stats.reduce, stats.fn)
    return o.reshape(batch, num_q_heads, -1)


def _attend(grouped_q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
            estimate: Estimate | None) -> torch.Tensor:
    """Attention of grouped queries [B, Hkv, G, D] over keys/values [B, Hkv, n, D] where `mask` [B,
    Hkv, n] holds, plus an estimate's pseudo-keys as extra softmax entries (logit q.k * scale +
    log-weight; docs/design.md, "Cluster indices"). A head with nothing to attend to gives zeros."""
    if estimate is None:
        o = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask[:, :, None, :], scale=scale)
        return torch.where(mask.any(-1)[:, :, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
    estimate = estimate.gathered()
    weights = estimate.log_weights.to(grouped_q.device).float()
    live = weights > float("-inf")
    means = torch.where(live[..., None], estimate.values.float() / weights.exp().clamp(min=1e-30)[..., None], 0.0)
    keys = torch.cat([keys, estimate.keys.to(keys.dtype)], dim=2)
    values = torch.cat([values, means.to(values.dtype)], dim=2)
    bias = torch.cat([torch.where(mask, 0.0, float("-inf")), weights], dim=2)  # [B, Hkv, n + E]
    some = bias.amax(-1) > float("-inf")
    bias = torch.where(some[..., None], bias, 0.0)  # a head with nothing: no NaN from an all -inf row
    o = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=bias[:, :, None, :].to(grouped_q.dtype),
                                       scale=scale)
    return torch.where(some[:, :, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))


def causal_offset_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: the i-th new query sits at position kv_len - q_len + i."""
    positions = torch.arange(kv_len - q_len, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] <= positions[:, None]


# The fused attention kernels also return each query's log-sum-exp, which lets a chunk over a
# cached prefix run as two mask-free calls (`_attend_over_prefix`). Private aten ops: the CPU's flash
# kernel; on CUDA cuDNN's (head dim <= 128; the fastest on Hopper: docs/benchmarks.md), which takes a
# GQA layer's key heads as they are, or flash's (<= 256) over key heads repeated to the query heads (a
# copy). Without them (another build), or where none applies (values narrower than keys, float32 on
# CUDA), the chunk takes one call with its causal mask.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CUDA_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
_CUDNN = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
log = logging.getLogger(__name__)
_CUDNN_GQA = True  # until this torch's cuDNN op refuses fewer key heads than query heads


def _flash_with_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool, scale: float):
    """(out [1, Hq, n, D], log-sum-exp [1, Hq, n]) of one mask-free fused call, or None where no kernel
    applies."""
    if values.shape[-1] != q.shape[-1]:
        return None
    if q.device.type == "cpu" and _CPU_FLASH is not None:  # (takes GQA)
        out, lse = _CPU_FLASH(q, keys, values, 0.0, causal, scale=scale)
        return out, lse
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 256:
        return None
    global _CUDNN_GQA
    if _CUDNN is not None and q.shape[-1] <= 128 and (_CUDNN_GQA or q.shape[1] == keys.shape[1]):
        try:  # cuDNN takes fewer key/value heads than query heads as they are: no repeated copy
            out, lse = _CUDNN(q, keys, values, None, True, 0.0, causal, False, scale=scale)[:2]
            return out, lse.reshape(q.shape[:3])
        except RuntimeError as err:  # a torch whose cuDNN op wants equal heads: repeat them from now on
            if q.shape[1] == keys.shape[1] or isinstance(err, torch.OutOfMemoryError):
                raise
            _CUDNN_GQA = False
            log.debug("cuDNN attention refused %d query heads over %d key heads (%s): repeating them",
                      q.shape[1], keys.shape[1], err)
    if q.shape[1] != keys.shape[1]:
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    if _CUDNN is not None and q.shape[-1] <= 128:
        out, lse = _CUDNN(q, keys, values, None, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse.reshape(q.shape[:3])
    if _CUDA_FLASH is not None:
        out, lse = _CUDA_FLASH(q, keys, values, 0.0, causal, False, scale=scale)[:2]
        return out, lse.reshape(q.shape[:3])
    return None


def _attend_over_prefix(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a chunk's queries q [1, Hq, n, D] over keys/values [1, Hkv, m, D] whose last
    n are the chunk's own (query i sees keys 0..m - n + i); into `out` [n, Hq, D] where given.

    A boolean mask keeps SDPA from skipping the future half of the chunk and costs a select per
    score, so where the flash kernel is at hand the prefix (every query sees every key) and the
    chunk (plainly causal) are two mask-free calls, merged by their log-sum-exps.
    """
    n, m = q.shape[2], keys.shape[2]
    gqa = q.shape[1] != keys.shape[1]
    prefix = m - n
    whole = _flash_with_lse(q, keys[:, :, :prefix], values[:, :, :prefix], False, scale)
    if whole is None:  # (MLA's narrower values, float32 on CUDA)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_offset_mask(n, m, q.device),
                                           scale=scale, enable_gqa=gqa)
        return o if out is None else _into(out, o)
    o_prefix, lse_prefix = whole
    o_chunk, lse_chunk = _flash_with_lse(q, keys[:, :, prefix:], values[:, :, prefix:], True, scale)
    if q.is_cuda:  # one launch, no float32 copies (merge_triton.py)
        from kvc.runtime.primitives import merge_triton  # imports triton: only a CUDA prefill asks

        return merge_triton.merge(o_prefix, lse_prefix, o_chunk, lse_chunk, out)
    # softmax over both parts = each part's softmax weighted by its share of the total mass
    w_prefix = torch.sigmoid(lse_prefix.float() - lse_chunk.float()).unsqueeze(-1)  # [1, Hq, n, 1]
    o = torch.lerp(o_chunk.float(), o_prefix.float(), w_prefix).to(q.dtype)
    return o if out is None else _into(out, o)


def _into(out: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """o [1, Hq, n, D] copied into out [n, Hq, D]; out seen as o is."""
    out.copy_(o[0].transpose(0, 1))
    return out.transpose(0, 1)[None]


def _attend_in_blocks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      block: int) -> torch.Tensor:
    """`attend_chunk` (no starts) in query blocks of `block` tokens: each block over the keys before it with
    no mask and over its own causally, merged (`_attend_over_prefix`); the first block of a fresh chunk plainly
    causal. The same scores as one causal call, in calls that skip the masked half exactly: a long causal call
    runs below its kernel's unmasked rate (docs/design.md, "Prefill attention"). [1, Hq, n, Dv], a view of a
    token-major [n, Hq, Dv] tensor."""
    n, m = q.shape[2], keys.shape[2]
    out = q.new_empty(n, q.shape[1], values.shape[-1])
    for start in range(0, n, block):
        end = min(n, start + block)
        seen = m - n + end
        if seen == end - start:
            o = F.scaled_dot_product_attention(q[:, :, start:end], keys[:, :, :seen], values[:, :, :seen],
                                               is_causal=True, scale=scale, enable_gqa=q.shape[1] != keys.shape[1])
            _into(out[start:end], o)
        else:
            _attend_over_prefix(q[:, :, start:end], keys[:, :, :seen], values[:, :, :seen], scale, out[start:end])
    return out.transpose(0, 1)[None]


def paged_prefill(
    q: torch.Tensor,
    k_cache: Source,
    v_cache: Source,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    kv_starts: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    resid_lens: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for prefill chunks, q [Tq, Hq, D] in varlen layout (see cu_seqlens_q).

    Sequence b's chunk holds the last q_len of its context_lens[b] tokens, whose K/V are already
    in the cache; query at position p sees keys 0..p (from kv_starts[b, h] on for KV head h when
    `kv_starts [B, Hkv]` is given). One SDPA per sequence (the lengths go to the host once).

    SDPA gets 4-D inputs ([1, heads, tokens, D]): only those reach the CPU flash kernel (3-D ones
    fall back to the math path, several times slower, that materialises every score). A fresh
    chunk (no cached prefix, every start 0) runs `is_causal`, the call Hugging Face makes; a chunk
    over a cached prefix goes through `_attend_over_prefix`; per-head starts use a mask. A row of
    starts that is all 0 takes the path of no starts, so zero starts stay bit-identical to none.

    Quantized operands (`QuantizedPages`) are decoded per row; `rows`/`resid_lens` read the newest
    slots from their residual windows, as in `paged_decode`. `k_new`/`v_new` [Tq, Hkv, D] (the
    chunk's own keys and values, as computed): an operand with a residual window or `prefill_exact`
    reads the chunk's slots from them, so a chunk attends to itself in the model's precision (KIVI's
    and TurboQuant's prefill attend in full precision) and to earlier tokens as they are stored.
    Other operands read the chunk as stored (vLLM's FP8 prefill).
    """
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[1]
    page_size = k_cache.shape[2]
    if (k_new is None or v_new is None) and any(reads_chunk_exact(c, resid_lens) for c in (k_cache, v_cache)):
        raise ValueError("paged_prefill: sources that read a chunk as computed (a residual window, `prefill_exact`) "
                         "read the chunk's own slots from k_new and v_new")
    if out is None:
        out = q.new_zeros(*q.shape[:2], v_cache.shape[-1])
    starts = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()
    head_starts = None if kv_starts is None else kv_starts.tolist()
    for b, kv_len in enumerate(lengths):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_pages = -(-kv_len // page_size)
        keys, values = (_row_operand(cache, block_tables[b, :num_pages], kv_len, b, context_lens, (rows, resid_lens),
                                     q.dtype, q_len) for cache in (k_cache, v_cache))  # [1, Hkv, L, D]
        for x, cache, fresh in ((keys, k_cache, k_new), (values, v_cache, v_new)):
            if fresh is not None and reads_chunk_exact(cache, resid_lens):
                x[0, :, kv_len - q_len:] = fresh[start:end].transpose(0, 1).to(x.dtype)
        queries = q[start:end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        first = None  # each query head from its kv head's start, where a start is not 0
        if head_starts is not None and any(head_starts[b]):
            first = kv_starts[b].repeat_interleave(num_q_heads // num_kv_heads)
        out[start:end] = attend_chunk(queries, keys, values, scale, first)[0].transpose(0, 1)
    return out


def attend_chunk(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                 first: torch.Tensor | None = None, block: int = 0) -> torch.Tensor:
    """Causal attention of a chunk's queries q [1, Hq, n, D] over keys [1, Hkv, m, D] and values
    [1, Hkv, m, Dv] whose last n are the chunk's own (query i sees keys 0..m - n + i; from `first[h]`
    on for query head h where given): `is_causal` for a fresh chunk, `_attend_over_prefix` over a
    cached prefix, a mask with starts; a chunk longer than `block` (> 0) in query blocks of it
    (`_attend_in_blocks`). [1, Hq, n, Dv]."""
    n, m = q.shape[2], keys.shape[2]
    gqa = q.shape[1] != keys.shape[1]
    if 0 < block < n and first is None:
        return _attend_in_blocks(q, keys, values, scale, block)
    if first is not None:  # [Hq, n, m]
        visible = torch.arange(m, device=q.device)[None, None, :] >= first[:, None, None]
        mask = causal_offset_mask(n, m, q.device)[None] & visible
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None], scale=scale, enable_gqa=gqa)
    if n == m:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
    return _attend_over_prefix(q, keys, values, scale)
