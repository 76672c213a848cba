"""Random paged-KV cases and a dense attention reference, shared by the attention kernel tests.

The reference is written from the definition (softmax(q k^T * scale) v over each query's visible
keys, float64, GQA by repeating kv heads) and never looks at pages: the cases keep each
sequence's K/V dense next to the paged copy.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    k_cache: torch.Tensor  # [num_pages, Hkv, page_size, D]
    v_cache: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, dense [L_b, Hkv, D]
    values: list[torch.Tensor]
    block_tables: torch.Tensor  # [B, max_pages] int32, shuffled page ids, padding 0
    context_lens: torch.Tensor  # [B] int32
    page_size: int

    def slots(self, b: int, positions: range) -> list[int]:
        table = self.block_tables[b].tolist()
        return [table[p // self.page_size] * self.page_size + p % self.page_size for p in positions]


def make_case(
    lengths: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    *,
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_pages: int = 3,
    stale: float | None = None,
) -> PagedCase:
    """Sequences of `lengths` tokens on randomly permuted pages of a cache with spare pages.

    Slots no sequence owns hold random values, or `stale` (e.g. NaN) to prove a kernel never
    reads them.
    """
    pages_per_seq = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per_seq) + spare_pages
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    if stale is not None:
        k_cache.fill_(stale)
        v_cache.fill_(stale)
    order = torch.randperm(num_pages, generator=gen).tolist()
    width = max(pages_per_seq + [1]) + 1  # one padding column, as a real batch may have
    block_tables = torch.zeros((len(lengths), width), dtype=torch.int32)
    keys, values = [], []
    for b, n in enumerate(lengths):
        k = torch.randn((n, num_kv_heads, head_dim), generator=gen)
        v = torch.randn((n, num_kv_heads, head_dim), generator=gen)
        pages = [order.pop() for _ in range(pages_per_seq[b])]
        block_tables[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for j, page in enumerate(pages):
            chunk = slice(j * page_size, min((j + 1) * page_size, n))
            used = chunk.stop - chunk.start
            k_cache[page, :, :used] = k[chunk].transpose(0, 1)
            v_cache[page, :, :used] = v[chunk].transpose(0, 1)
        keys.append(k.to(dtype).to(device))
        values.append(v.to(dtype).to(device))
    return PagedCase(
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        keys=keys,
        values=values,
        block_tables=block_tables.to(device),
        context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        page_size=page_size,
    )


def reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, positions: list[int]
) -> torch.Tensor:
    """q [n, Hq, D] against dense keys/values [L, Hkv, D]; query i sees keys 0..positions[i]."""
    n, num_q_heads, _ = q.shape
    group = num_q_heads // keys.shape[1]
    if n == 0 or keys.shape[0] == 0:  # no queries, or an empty (padding) decode row
        return q.new_zeros(q.shape, dtype=torch.float64)
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= torch.tensor(positions, device=q.device)[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)


def reference_decode(case: PagedCase, q: torch.Tensor, scale: float) -> torch.Tensor:
    out = []
    for b, n in enumerate(case.context_lens.tolist()):
        out.append(reference_attention(q[b : b + 1], case.keys[b], case.values[b], scale, [n - 1]))
    return torch.cat(out)


def reference_prefill(case: PagedCase, q: torch.Tensor, cu_seqlens: list[int], scale: float) -> torch.Tensor:
    out = []
    for b, n in enumerate(case.context_lens.tolist()):
        q_len = cu_seqlens[b + 1] - cu_seqlens[b]
        positions = list(range(n - q_len, n))
        out.append(reference_attention(q[cu_seqlens[b] : cu_seqlens[b + 1]], case.keys[b], case.values[b],
                                       scale, positions))
    return torch.cat(out)


def triton_device_and_ops(variant: str = "plain"):
    """(device, the generated attention kernels of `variant`): the GPU when there is one, else
    Triton's interpreter on the CPU.

    TRITON_INTERPRET must be set before triton (whose own library functions are jit-decorated
    at import) and our kernels are imported. If something imported triton earlier without it,
    its Python modules and the loaded kernel modules are dropped and imported again (the compiled
    `triton._C` stays).
    """
    from kvc.runtime.attention import triton_ops

    if torch.cuda.is_available():
        return torch.device("cuda"), triton_ops.load(variant)
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language.standard

    if type(triton.language.standard.sum).__name__ != "InterpretedFunction":
        stale = [name for name in sys.modules
                 if (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")]
        stale += [name for name in sys.modules if name.startswith(triton_ops.MODULE_PREFIX)]
        for name in stale:
            sys.modules.pop(name, None)
    return torch.device("cpu"), triton_ops.load(variant)


# ---- per-head start slots (per-head variable counts, right-aligned; runtime/attention/metadata.py)


def random_starts(case: PagedCase, num_kv_heads: int, gen: torch.Generator, keep_last: list[int] | None = None,
                  ) -> torch.Tensor:
    """[B, Hkv] int32 start slots: for sequence b, each in [0, context - keep_last[b]] (default 1:
    at least the newest token stays visible); one head of each sequence keeps 0, as the most-keeping
    head of a compacted layer does."""
    lengths = case.context_lens.tolist()
    keep_last = keep_last or [1] * len(lengths)
    starts = torch.zeros((len(lengths), num_kv_heads), dtype=torch.int32)
    for b, n in enumerate(lengths):
        high = max(n - keep_last[b], 0)
        starts[b] = torch.randint(0, high + 1, (num_kv_heads,), generator=gen, dtype=torch.int32)
        starts[b, int(torch.randint(0, num_kv_heads, (1,), generator=gen))] = 0
    return starts.to(case.context_lens.device)


def poison_before_starts(case: PagedCase, starts: torch.Tensor, value: float = float("nan")) -> None:
    """Writes `value` into every slot a KV head does not use (before its start), in place, so a
    kernel reading one fails."""
    table = case.block_tables.tolist()
    for b, row in enumerate(starts.tolist()):
        for h, start in enumerate(row):
            for pos in range(start):
                page, offset = table[b][pos // case.page_size], pos % case.page_size
                case.k_cache[page, h, offset] = value
                case.v_cache[page, h, offset] = value


def reference_with_starts(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                          positions: list[int], starts: list[int]) -> torch.Tensor:
    """`reference_attention`, KV head h reading keys starts[h]..positions[i] only."""
    group = q.shape[1] // keys.shape[1]
    out = q.new_zeros(q.shape, dtype=torch.float64)
    for h, start in enumerate(starts):
        heads = slice(h * group, (h + 1) * group)
        shifted = [p - start for p in positions]
        out[:, heads] = reference_attention(q[:, heads], keys[start:, h : h + 1], values[start:, h : h + 1], scale,
                                            shifted)
    return out
