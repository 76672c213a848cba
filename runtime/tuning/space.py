"""The config space `kvc tune` searches per kernel family, and the shape buckets it tunes at.

`--effort full` takes the whole product of each knob's values; `quick` a small neighbourhood of
the heuristic. The heuristic's own config is always the first candidate, so the best found is
never slower than the untuned launch (both are measured in the same process, the same way).
Candidates a kernel cannot run (too much shared memory, a failed compile) are skipped by the
tuner with a note.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvc.runtime.tuning import buckets
from kvc.runtime.tuning.shapes import ModelShape

EFFORTS = ("quick", "full")


def _product(heuristic: dict, values: dict[str, list[int]]) -> list[dict]:
    """The heuristic first, then every combination of `values` (other knobs as the heuristic's)."""
    names = list(values)
    out = [dict(heuristic)]
    for combo in itertools.product(*(sorted(set(values[n])) for n in names)):
        cand = {**heuristic, **dict(zip(names, combo))}
        if cand not in out:
            out.append(cand)
    return out


def _around(value: int, factors=(0.5, 1, 2), low: int = 1, high: int = 1 << 20) -> list[int]:
    return sorted({min(high, max(low, int(value * f))) for f in factors})


def decode(heuristic: dict, effort: str, max_splits: int) -> list[dict]:
    splits = heuristic["num_splits"]
    if effort == "quick":
        values = {"num_splits": _around(splits, (0.5, 1, 2), 1, max_splits), "block_n": [heuristic["block_n"], 32],
                  "num_warps": [4, 8], "num_stages": [heuristic["num_stages"]]}
    else:
        values = {"num_splits": _around(splits, (0.25, 0.5, 1, 2, 4), 1, max_splits), "block_n": [16, 32, 64, 128],
                  "num_warps": [2, 4, 8], "num_stages": [1, 2, 3, 4]}
    return _product(heuristic, values)


def prefill(heuristic: dict, effort: str) -> list[dict]:
    if effort == "quick":
        values = {"block_m": [64, 128], "block_n": [64, 128], "num_warps": [4, 8],
                  "num_stages": [heuristic["num_stages"]]}
    else:
        values = {"block_m": [32, 64, 128, 256], "block_n": [32, 64, 128], "num_warps": [4, 8],
                  "num_stages": [1, 2, 3, 4]}
    return _product(heuristic, values)


def store_kv(heuristic: dict, effort: str) -> list[dict]:
    return _product(heuristic, {"num_warps": [1, 4] if effort == "quick" else [1, 2, 4, 8]})


def moe(heuristic: dict, effort: str) -> list[dict]:
    if effort == "quick":
        values = {"block_m": _around(heuristic["block_m"], (0.5, 1, 2), 16, 128), "block_n": [heuristic["block_n"], 64],
                  "block_k": [heuristic["block_k"]], "num_warps": [4, 8], "num_stages": [heuristic["num_stages"]]}
    else:
        values = {"block_m": [16, 32, 64, 128], "block_n": [32, 64, 128], "block_k": [64, 128],
                  "group_m": [1, 8], "num_warps": [4, 8], "num_stages": [2, 3, 4], "tma": [False, True]}
    return _product(heuristic, values)


def compaction(heuristic: dict, effort: str, head_dim: int) -> list[dict]:
    widths = [d for d in (16, 32, 64, 128, 256) if d <= buckets.next_pow2(head_dim)] or [buckets.next_pow2(head_dim)]
    if effort == "quick":
        values = {"block_t": [64, 128, 256], "block_d": [heuristic["block_d"]], "num_warps": [2, 4]}
    else:
        values = {"block_t": [32, 64, 128, 256, 512], "block_d": widths, "num_warps": [1, 2, 4, 8]}
    return _product(heuristic, values)


def votes(heuristic: dict, effort: str) -> list[dict]:
    if effort == "quick":
        values = {"block_q": _around(heuristic["block_q"], (0.5, 1, 2), 16, 128), "block_k": [32, 64, 128],
                  "num_warps": [4, 8]}
    else:
        values = {"block_q": [16, 32, 64, 128], "block_k": [16, 32, 64, 128, 256], "num_warps": [2, 4, 8]}
    return _product(heuristic, values)


@dataclass(frozen=True)
class Limits:
    """How far the buckets go (the engine's own limits; smaller for a short run)."""

    max_batch: int = 256  # EngineConfig.max_num_seqs' default
    max_chunk: int = 2048  # EngineConfig.max_num_batched_tokens' default: the largest prefill chunk
    max_context: int | None = None  # default: the model's max_position_embeddings


def decode_buckets(shape: ModelShape, effort: str, limits: Limits) -> list[tuple[int, int]]:
    """(batch, context) pairs: graph batch buckets x power-of-two context bounds, the last of which
    is the one a graph-captured decode passes (max_model_len rounded up)."""
    top = buckets.context_bucket(limits.max_context or shape.max_len)
    batches = [b for b in buckets.BATCH_BUCKETS if b <= limits.max_batch] or [limits.max_batch]
    contexts = [c for c in (1 << p for p in range(8, 22)) if 1024 <= c <= top] or [top]
    if effort == "quick":
        batches = sorted({batches[0], *[b for b in batches if b in (8, 32, 128)], batches[-1]})
        contexts = sorted({contexts[0], *[c for c in contexts if c in (8192, 32768)], contexts[-1]})
    return [(b, c) for b in batches for c in contexts]


def chunk_buckets(effort: str, limits: Limits) -> list[int]:
    top = buckets.tokens_bucket(limits.max_chunk)
    chunks = [c for c in (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384) if c <= top] or [top]
    return sorted({chunks[0], chunks[-1], *[c for c in chunks if c == 512]}) if effort == "quick" else chunks


def token_buckets(effort: str, limits: Limits) -> list[int]:
    """Tokens of a step: decode batches and prefill chunks (MoE, store_kv)."""
    batches = [b for b in buckets.BATCH_BUCKETS if b <= limits.max_batch]
    chunks = [c for c in chunk_buckets("full", limits) if c > (batches[-1] if batches else 0)]
    tokens = sorted({*batches, *chunks})
    if effort == "quick":
        tokens = sorted({tokens[0], *[t for t in tokens if t in (8, 64, 256)], tokens[-1]})
    return tokens


def compaction_buckets(effort: str, limits: Limits) -> list[tuple[int, int]]:
    """(plans, kept): sequences compacted in one layer's launch x tokens each keeps."""
    plans = [p for p in (1, 4, 16, 64) if p <= max(1, limits.max_batch)]
    kept = [k for k in (256, 1024, 2048, 8192) if k <= buckets.tokens_bucket(limits.max_context or 8192)] or [256]
    if effort == "quick":
        plans, kept = sorted({plans[0], plans[-1]}), sorted({kept[0], kept[-1]})
    return [(p, k) for p in plans for k in kept]


def votes_buckets(effort: str, limits: Limits, max_len: int) -> list[tuple[int, int]]:
    """(queries, keys) of `column_votes`: an observation window (SnapKV's 32, or 64) or a prefill
    chunk's queries (H2O's column sums) x power-of-two key counts up to the context bound (the
    model's `max_len` unless limited)."""
    top = buckets.context_bucket(limits.max_context or max_len)
    windows = [16, 32, 64]
    chunks = [c for c in chunk_buckets(effort, limits) if c > windows[-1]]
    keys = [c for c in (1 << p for p in range(10, 22)) if c <= top] or [top]
    if effort == "quick":
        windows, chunks = [32], chunks[-1:]
        keys = sorted({keys[0], *[c for c in keys if c == 32768], keys[-1]})
    return [(q, k) for q in windows for k in keys] + [(c, k) for c in chunks for k in keys if k >= c]
