"""Decode attention statistics: the softmax probabilities of a decode step's queries over each
sequence's paged keys, reduced the way a method reads them (H2O's column sums, TOVA's last row).

The contract (`metadata.DecodeStats`): a compiled method whose decode hook reads `attn` gets it
reduced as its manifest says (`manifest["attention"]["decode_stats"]`, from
`compiler/hook_facts.py`):

- `reduce="group"`: [B, Hkv, W], each KV head's query heads folded (`fn` mean or sum);
- `reduce="head"`:  [B, 1, W], every query head of the layer folded;
- `reduce="none"`:  [B, Hq, W], per query head.

`out` is a preallocated float32 buffer of width W >= every row's context length; entries past a
row's length, and before a KV head's start slot (`kv_starts`), are 0; a decode restricted by a read
plan (runtime/kv/plans.py) covers the slots it read, every other entry 0. Nothing is read back to the
host, so the call is CUDA-graph safe. On the GPU the decode attention kernels emit these
statistics themselves (attention variant `decode_stats`, kernels_generated/_attention/); here is
the plain torch version: the torch backend's path (`torch_ops.paged_decode(..., stats=)`) and the
oracle of those kernels.
"""

from __future__ import annotations

import torch

REDUCTIONS = ("group", "head", "none")


def rows(reduce: str, num_heads: int, num_kv_heads: int) -> int:
    """Rows of the output per sequence."""
    return {"group": num_kv_heads, "head": 1, "none": num_heads}[reduce]


def check_args(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor, reduce: str, fn: str | None) -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if reduce != "none" and fn not in ("mean", "sum"):
        raise ValueError(f"fn must be 'mean' or 'sum' for reduce={reduce!r}, got {fn!r}")
    num_seqs, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[1]
    want = (num_seqs, rows(reduce, num_heads, num_kv_heads))
    if num_heads % num_kv_heads or out.dtype != torch.float32 or out.dim() != 3 or tuple(out.shape[:2]) != want:
        raise ValueError(f"out must be float32 [{want[0]}, {want[1]}, width], got {out.dtype} {tuple(out.shape)}")


def decode_stats_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    reduce: str,
    fn: str | None = "mean",
    kv_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (one query per sequence) over the keys of each row's pages
    (`block_tables [B, P]`, `context_lens [B]`; KV head h from slot `kv_starts[b, h]` on when given)
    -> `out` [B, R, W] float32 (see the module docstring)."""
    check_args(q, k_cache, out, reduce, fn)
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_cache.shape
    width = out.shape[-1]
    pages = min(-(-width // page_size), block_tables.shape[1])
    tables = block_tables[:, :pages].long()
    keys = k_cache[tables].permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, pages * page_size, head_dim)
    return stats_from_keys(q, keys, context_lens, scale, out, reduce, fn, kv_starts)


def stats_from_keys(
    q: torch.Tensor,
    keys: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    reduce: str,
    fn: str | None = "mean",
    kv_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_stats_torch` over keys already gathered (and decoded): `keys [B, Hkv, n, D]`, slot t
    of row b at `keys[b, :, t]` (n may fall short of or pass the width W; missing slots are 0)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    width = out.shape[-1]
    keys = torch.nn.functional.pad(keys[:, :, :width], (0, 0, 0, max(0, width - keys.shape[2])))
    group = num_heads // num_kv_heads
    logits = torch.einsum("bhgd,bhwd->bhgw", q.float().reshape(num_seqs, num_kv_heads, group, head_dim),
                          keys.float()) * scale
    slots = torch.arange(width, device=q.device)
    visible = (slots[None, :] < context_lens.to(q.device).long()[:, None])[:, None, None, :]  # [B, 1, 1, W]
    if kv_starts is not None:  # [B, Hkv, 1, W]: each KV head from its own start
        visible = visible & (slots[None, None, None, :] >= kv_starts.to(q.device).long()[:, :, None, None])
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.nan_to_num(logits.softmax(dim=-1), nan=0.0)  # an empty row: all -inf -> 0
    out.copy_(_fold(probs, reduce, fn))
    return out


def _fold(probs: torch.Tensor, reduce: str, fn: str | None) -> torch.Tensor:
    """probs [B, Hkv, group, n] -> [B, R, n] as `reduce`/`fn` ask."""
    num_seqs, num_kv_heads, group, n = probs.shape
    if reduce == "group":
        return probs.mean(dim=2) if fn == "mean" else probs.sum(dim=2)
    flat = probs.reshape(num_seqs, num_kv_heads * group, n)
    if reduce == "head":
        return flat.mean(dim=1, keepdim=True) if fn == "mean" else flat.sum(dim=1, keepdim=True)
    return flat


def stats_over_slots(
    q: torch.Tensor,
    keys: torch.Tensor,
    slots: torch.Tensor,
    read: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    reduce: str,
    fn: str | None = "mean",
) -> torch.Tensor:
    """Statistics of a decode that read only some slots (a read plan): KV head h of row b attended
    to `keys [B, Hkv, n, D]` at slots `slots [B, Hkv, n]` where `read [B, Hkv, n]`; every other
    entry of `out` is 0. Slots a row reads are distinct (the plan's contract)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, n = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    logits = torch.einsum("bhgd,bhnd->bhgn", q.float().reshape(num_seqs, num_kv_heads, group, head_dim),
                          keys.float()) * scale
    logits = logits.masked_fill(~read[:, :, None, :], float("-inf"))
    probs = torch.nan_to_num(logits.softmax(dim=-1), nan=0.0)  # [B, Hkv, group, n]
    index = torch.where(read, slots, 0).clamp(0, max(out.shape[-1] - 1, 0))  # unread entries carry 0
    if reduce == "group":
        folded = _fold(probs, reduce, fn)
    elif reduce == "head":  # every head's entries land in the one row
        weight = probs / num_heads if fn == "mean" else probs
        folded, index = weight.reshape(num_seqs, 1, num_heads * n), index.repeat_interleave(group, 1).reshape(
            num_seqs, 1, num_heads * n)
    else:
        folded, index = probs.reshape(num_seqs, num_heads, n), index.repeat_interleave(group, 1)
    out.zero_()
    if n and out.shape[-1]:
        out.scatter_add_(2, index, folded)
    return out
