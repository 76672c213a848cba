"""A named-axis reference evaluator for .kvm tensor expressions, written from docs/language.md and
independently of the compiler: the oracle of tests/compiler/test_axes.py.

A value is a float64 numpy array with one axis name per dimension (`Named`), plus the cache
positions of its `key` entries. Operands of an elementwise operation are brought onto the union
of their axes by name with `np.einsum` (a transpose) and size-1 axes; a `kv_head` axis meeting a
`head` axis is repeated over each KV head's group of query heads (query head h reads KV head
h // group). Reductions, norms, pooling and ranges find their axis by name. Nothing here imports
kvc: the lowering is checked against this, not against itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ORDER = ("head", "kv_head", "query", "key", "channel")  # any fixed order would do: results are compared by name
LETTERS = dict(zip(ORDER, "hkqtc"))


@dataclass(frozen=True)
class Named:
    array: np.ndarray
    axes: tuple[str, ...]
    key_positions: np.ndarray | None = None  # cache position of each entry of the key axis

    def __post_init__(self) -> None:
        assert self.array.ndim == len(self.axes), (self.array.shape, self.axes)


def named(array, axes: tuple[str, ...]) -> Named:
    array = np.asarray(array, dtype=np.float64)
    positions = np.arange(array.shape[axes.index("key")]) if "key" in axes else None
    return Named(array, axes, positions)


def number(value: float) -> Named:
    return Named(np.asarray(float(value)), ())


def _canonical(axes) -> tuple[str, ...]:
    return tuple(a for a in ORDER if a in set(axes))


def lay_out(x: Named, axes: tuple[str, ...], group: int) -> np.ndarray:
    """x's array over `axes` (a superset of its own, `kv_head` possibly as `head`)."""
    array, names = x.array, list(x.axes)
    if "kv_head" in names and "head" in axes and "kv_head" not in axes:
        i = names.index("kv_head")
        array = np.repeat(array, group, axis=i)
        names[i] = "head"
    present = [a for a in axes if a in names]
    spec = "".join(LETTERS[a] for a in names) + "->" + "".join(LETTERS[a] for a in present)
    array = np.einsum(spec, array)
    return array.reshape([array.shape[present.index(a)] if a in names else 1 for a in axes])


def elementwise(fn, x: Named, y: Named, group: int) -> Named:
    names = set(x.axes) | set(y.axes)
    if "head" in names:
        names.discard("kv_head")
    axes = _canonical(names)
    if x.key_positions is not None and y.key_positions is not None:
        assert np.array_equal(x.key_positions, y.key_positions), "operands hold different keys"
    positions = x.key_positions if x.key_positions is not None else y.key_positions
    return Named(fn(lay_out(x, axes, group), lay_out(y, axes, group)), axes, positions)


def unary(fn, x: Named) -> Named:
    return Named(fn(x.array), x.axes, x.key_positions)


REDUCERS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


def reduce(x: Named, fn: str, over: tuple[str, ...], group: int) -> Named:
    array, axes, positions = x.array, list(x.axes), x.key_positions
    for axis in over:
        if axis == "group":  # fold each KV head's query heads: head h -> KV head h // group
            i = axes.index("head")
            shape = array.shape
            array = REDUCERS[fn](array.reshape(shape[:i] + (shape[i] // group, group) + shape[i + 1:]), axis=i + 1)
            axes[i] = "kv_head"
        else:
            i = axes.index(axis)
            array = REDUCERS[fn](array, axis=i)
            del axes[i]
            if axis == "key":
                positions = None
    return Named(array, tuple(axes), positions)


def norm(x: Named, over: tuple[str, ...]) -> Named:
    squares = reduce(unary(np.square, x), "sum", over, 1)
    return unary(np.sqrt, squares)


def clamp(n: float, available: int) -> int:
    return max(0, min(math.floor(n), available))


class EmptyRange(ValueError):
    """A range with no entries: reductions over it are undefined, so callers skip such inputs."""


def take(x: Named, axis: str, side: str, n: float) -> Named:
    """x[first n along axis] / x[last n along axis]."""
    i = x.axes.index(axis)
    size = x.array.shape[i]
    n = clamp(n, size)
    if n == 0:
        raise EmptyRange(f"{side} {n} of {size} along {axis}")
    lo = 0 if side == "first" else size - n
    index = [slice(None)] * x.array.ndim
    index[i] = slice(lo, lo + n)
    positions = x.key_positions[lo:lo + n] if axis == "key" else x.key_positions
    return Named(x.array[tuple(index)], x.axes, positions)


def pool(x: Named, mode: str, kernel: int, axis: str) -> Named:
    """Stride-1 centred window of odd `kernel`; zero padding counts in avg, never wins in max."""
    i = x.axes.index(axis)
    moved = np.moveaxis(x.array, i, -1)
    radius = kernel // 2
    pad = [(0, 0)] * (moved.ndim - 1) + [(radius, radius)]
    padded = np.pad(moved, pad, constant_values=0.0 if mode == "avg" else -np.inf)
    size = moved.shape[-1]
    windows = np.stack([padded[..., j:j + size] for j in range(kernel)], axis=-1)
    pooled = windows.mean(axis=-1) if mode == "avg" else windows.max(axis=-1)
    return Named(np.moveaxis(pooled, -1, i), x.axes, x.key_positions)


def attention(q: Named, k: Named, group: int) -> Named:
    """Causal softmax(q k / sqrt(d)) over [head, query, key]; the queries are the newest positions."""
    assert q.axes == ("head", "query", "channel") and k.axes == ("kv_head", "key", "channel")
    heads, queries, dim = q.array.shape
    length = k.array.shape[1]
    out = np.empty((heads, queries, length))
    for h in range(heads):
        logits = q.array[h] @ k.array[h // group].T / math.sqrt(dim)
        for i in range(queries):
            row = np.where(np.arange(length) <= length - queries + i, logits[i], -np.inf)
            row = np.exp(row - row.max())
            out[h, i] = row / row.sum()
    return Named(out, ("head", "query", "key"), np.arange(length))


def ranking_scores(score: Named, kv_heads: int, length: int) -> np.ndarray:
    """[kv_head, key] over every cached key: the score at its keys' positions, -inf elsewhere; a
    score without a kv_head axis is the same for every KV head."""
    assert set(score.axes) <= {"kv_head", "key"} and "key" in score.axes
    array = lay_out(score, ("kv_head", "key"), 1)
    out = np.full((kv_heads, length), -np.inf)
    out[:, score.key_positions] = array
    return out
