"""Shape buckets and tunable knobs of each kernel family: one definition for the launch-time
lookup (the generated attention wrappers, moe_triton, compaction_triton) and for the tuner.

A bucket is a tuple of ints and a dtype name in a fixed field order (`Family.fields`), so the
lookup at launch is a tuple build and one dict probe. Sizes round up to the buckets the engine
really produces: decode batches to the CUDA-graph batch buckets of `runtime/decode_graphs.py`
(`DecodeGraphs`; a test keeps the two lists equal), context bounds and prefill chunks to powers
of two. A graph-captured decode step passes its context bucket (a power of two from
MIN_CONTEXT_BUCKET, or the longest context) as `max_context_len`, so its bucket, and therefore its
launch config, is fixed for the life of the graph.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

# The decode CUDA-graph batch buckets (runtime/decode_graphs.py `DecodeGraphs.buckets`, before the
# engine's max_num_seqs is appended); larger batches round to powers of two.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_CONTEXT_BUCKET = 256
MIN_TOKENS_BUCKET = 16


@dataclass(frozen=True)
class Family:
    """A kernel family: the fields of its bucket and the launch knobs a tuned config may set."""

    name: str
    fields: tuple[str, ...]
    knobs: tuple[str, ...]


FAMILIES = {
    f.name: f
    for f in (
        Family("decode", ("batch", "context", "q_heads", "kv_heads", "head_dim", "dtype"),
               ("num_splits", "block_n", "num_warps", "num_stages")),
        Family("prefill", ("tokens", "q_heads", "kv_heads", "head_dim", "dtype"),
               ("block_m", "block_n", "num_warps", "num_stages")),
        Family("store_kv", ("tokens", "kv_heads", "head_dim", "dtype"), ("num_warps",)),
        Family("moe", ("tokens", "experts", "top_k", "hidden", "inter", "dtype"),
               ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")),
        Family("compaction", ("plans", "kept", "kv_heads", "head_dim", "dtype"), ("block_t", "block_d", "num_warps")),
        Family("votes", ("queries", "keys", "heads", "kv_heads", "head_dim", "dtype"),
               ("block_q", "block_k", "num_warps")),
    )
}

# What a knob may be (a tuned file is data from disk: a bad value must not reach a launch).
_POW2 = {"block_n", "block_m", "block_k", "block_q", "block_t", "block_d", "num_warps"}
_RANGES = {"num_splits": (1, 1024), "num_stages": (1, 8), "group_m": (1, 64), "num_warps": (1, 32),
           "block_t": (1, 4096), "block_d": (1, 1024)}
_BLOCK_RANGE = (16, 1024)  # tl.dot tiles: at least 16 each way


def check_knob(name: str, value) -> str | None:
    """Why `value` is not a valid `name` knob (None when it is)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name} must be an integer, got {value!r}"
    low, high = _RANGES.get(name, _BLOCK_RANGE)
    if not low <= value <= high:
        return f"{name}={value} is outside [{low}, {high}]"
    if name in _POW2 and value & (value - 1):
        return f"{name}={value} is not a power of two"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def batch_bucket(n: int) -> int:
    """The decode graph bucket that holds a batch of n (a power of two past the last one)."""
    i = bisect.bisect_left(BATCH_BUCKETS, n)
    return BATCH_BUCKETS[i] if i < len(BATCH_BUCKETS) else next_pow2(n)


def tokens_bucket(n: int) -> int:
    return max(MIN_TOKENS_BUCKET, next_pow2(n))


def context_bucket(n: int) -> int:
    return max(MIN_CONTEXT_BUCKET, next_pow2(n))


def decode(batch: int, max_context_len: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
    return (batch_bucket(batch), context_bucket(max_context_len), q_heads, kv_heads, head_dim, dtype_name(dtype))


def prefill(max_query_len: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
    return (tokens_bucket(max_query_len), q_heads, kv_heads, head_dim, dtype_name(dtype))


def store_kv(tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
    return (batch_bucket(tokens), kv_heads, head_dim, dtype_name(dtype))


def moe(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype) -> tuple:
    return (batch_bucket(tokens), experts, top_k, hidden, inter, dtype_name(dtype))


def compaction(plans: int, kept: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
    return (next_pow2(plans), tokens_bucket(kept), kv_heads, head_dim, dtype_name(dtype))


def votes(queries: int, keys: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
    """`column_votes` (the window scores of SnapKV-like prefill ends, H2O's chunk column sums):
    queries scored, keys stored, head counts and size."""
    return (tokens_bucket(queries), context_bucket(keys), heads, kv_heads, head_dim, dtype_name(dtype))


def as_dict(family: str, bucket: tuple) -> dict:
    return dict(zip(FAMILIES[family].fields, bucket))


def from_dict(family: str, data: dict) -> tuple:
    """A bucket read from a cache file, in the family's field order (KeyError/ValueError if malformed)."""
    fields = FAMILIES[family].fields
    if set(data) != set(fields):
        raise ValueError(f"bucket fields {sorted(data)} are not {list(fields)}")
    return tuple(data[f] if f == "dtype" else int(data[f]) for f in fields)


def describe(family: str, bucket: tuple) -> str:
    return " ".join(f"{k}={v}" for k, v in as_dict(family, bucket).items())


_SHORT = {"batch": "B", "context": "ctx", "tokens": "T", "q_heads": "Hq", "kv_heads": "Hkv", "head_dim": "D",
          "experts": "E", "top_k": "k", "hidden": "H", "inter": "I", "plans": "plans", "kept": "kept",
          "queries": "Q", "keys": "keys", "heads": "Hq"}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def short(family: str, bucket: tuple) -> str:
    """A compact form for tables: `B=64 ctx=32768 Hq=32 Hkv=4 D=128 bf16`."""
    items = as_dict(family, bucket).items()
    return " ".join(_DTYPES.get(v, v) if k == "dtype" else f"{_SHORT[k]}={v}" for k, v in items)
