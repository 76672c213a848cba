"""MLA's prefill chunks in the decompressed form (docs/design.md, "MLA").

The latent cache stores a token's [c, k_rope] (R + P channels, one KV head). Decode attends the
absorbed queries over it directly (paged_decode). A prefill chunk may instead up-project its
context's latents into per-head keys [W_UK c, k_rope] and values W_UV c (`LatentQueries`) and attend
its decompressed queries [q_nope, q_rope] over them: the same logits, at (nope + rope) + value
channels a query-key pair instead of (R + P) + R (256 + 256 against 576 + 512 at GLM-4.7-Flash's
shape), for one up-projection of each context token per chunk. Which form a prefill takes is the
engine's `mla_prefill` (`--mla-prefill`); bench/latent_decode_bench.py times both.

The chunk reads its context as stored (an FP8 latent decoded), as the absorbed prefill does, its own
slots as computed where the spec says (`exact_chunk`). Attention per sequence is `torch_ops.attend_chunk`
(SDPA: flash or cuDNN on the GPU, a prefix and the chunk as two mask-free calls merged by their
log-sum-exps).
"""

from __future__ import annotations

import torch

from kvc.runtime.attention.sources import Source
from kvc.runtime.attention.torch_ops import attend_chunk, gather_source, reads_chunk_exact
from kvc.runtime.models.base import LatentQueries


def decompressed_prefill(latent: LatentQueries, k_cache: Source, block_tables: torch.Tensor,
                         cu_seqlens_q: torch.Tensor | list[int], context_lens: torch.Tensor | list[int], scale: float,
                         out: torch.Tensor, kv_starts: torch.Tensor | None = None,
                         k_new: torch.Tensor | None = None) -> torch.Tensor:
    """Values [Tq, heads, value_dim] into `out` of the prefill chunks whose decompressed queries are
    `latent`'s rows (varlen, `cu_seqlens_q`; sequence b's chunk is the last of its context_lens[b]
    tokens, already stored in `k_cache` over `block_tables[b]`; host lists spare a device sync);
    `kv_starts [B, 1]`: each sequence's first visible slot; `k_new [Tq, 1, R + P]`: the chunks' latents
    as computed."""
    page_size = k_cache.shape[2]
    exact = reads_chunk_exact(k_cache, None)
    if exact and k_new is None:
        raise ValueError("decompressed_prefill: a latent cache that reads a chunk as computed needs k_new")
    starts = cu_seqlens_q if isinstance(cu_seqlens_q, list) else cu_seqlens_q.tolist()
    lengths = context_lens if isinstance(context_lens, list) else context_lens.tolist()
    firsts = None if kv_starts is None else kv_starts[:, 0].tolist()
    for b, kv_len in enumerate(lengths):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        pages = block_tables[b, :-(-kv_len // page_size)]
        stored = gather_source(k_cache, pages, kv_len)[0].to(out.dtype)  # [L, R + P] (one latent head)
        if exact:
            stored[kv_len - q_len:] = k_new[start:end, 0].to(stored.dtype)
        keys, values = latent.keys_values(stored)  # [L, H, nope + rope], [L, H, v]
        queries = latent.queries(start, end).to(out.dtype)
        first = None
        if firsts is not None and firsts[b]:
            first = torch.full((queries.shape[1],), firsts[b], device=queries.device)
        o = attend_chunk(queries.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                         scale, first)
        out[start:end] = o[0].transpose(0, 1)
    return out
