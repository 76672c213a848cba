"""The primitives every generated torch lowering (`kernels_generated/<method>/torch_lowering.py`)
calls: windows, causal attention scores, reductions, GQA folding, pooling, state growth and the
selection rule of `keep`. One copy here instead of one per generated file; their semantics are
pinned in docs/language.md ("Semantics the compiler implements"). Every tensor they create lives on
the device of their inputs, so a lowering runs on the CPU or the GPU alike."""

import contextlib
import contextvars
import math
from collections.abc import Sequence

import torch

NEG_INF = float("-inf")


def floor(x):
    return torch.floor(x) if isinstance(x, torch.Tensor) else math.floor(x)


def ceil(x):
    return torch.ceil(x) if isinstance(x, torch.Tensor) else math.ceil(x)


def symbols(q, k, *, layer=0, num_layers=1, prompt=None, step=0):
    """The symbols of one layer of one sequence, from its queries and keys (every lowering's `symbols`)."""
    return {"context": k.shape[1], "prompt": k.shape[1] if prompt is None else prompt, "step": step,
            "layer": layer, "layers": num_layers, "heads": q.shape[0], "kv_heads": k.shape[0],
            "head_dim": k.shape[-1]}


def clamp_count(n, available):
    """A count of tokens: floored, clamped to [0, available] (docs/language.md, Budgets)."""
    return max(0, min(int(floor(n)), int(available)))


def per_row(value, rows: int, device) -> torch.Tensor:
    """A value for each of `rows` rows, [rows] float64 on `device`: a tensor (one value, or one a row)
    as it is, a Python number filled on the device (no host-to-device copy: a CUDA graph captures it)."""
    if isinstance(value, torch.Tensor):
        value = value.to(device=device, dtype=torch.float64)
        return value.expand(rows) if value.dim() == 0 else value
    return torch.full((rows,), float(value), device=device, dtype=torch.float64)


def window(x, dim, side, n):
    n = clamp_count(n, x.shape[dim])
    return x.narrow(dim, 0 if side == "first" else x.shape[dim] - n, n)


def align(x, dims, to, heads=None):
    """`x`, a tensor over the named axes `dims`, laid out over the axes `to`: its axes permuted into
    `to`'s order, a size-1 axis for each axis of `to` it lacks, and its `kv_head` axis repeated into
    `head` where `to` has `head` (query head h reads KV head h // (heads // kv_heads)). Operands
    combine by axis name this way, never by position (docs/language.md, Types, units and axes)."""
    dims = list(dims)
    if "kv_head" in dims and "head" in to and "kv_head" not in to:
        axis = dims.index("kv_head")
        x = x.repeat_interleave(heads // x.shape[axis], dim=axis)
        dims[axis] = "head"
    extra = [d for d in dims if d not in to]
    if extra:
        raise ValueError(f"cannot lay out axes {dims} over {list(to)}: {extra} would be lost")
    x = x.permute([dims.index(d) for d in to if d in dims])
    return x[tuple(slice(None) if d in dims else None for d in to)]


def contract(x, xdims, y, ydims, to):
    """`sum(x * y)` over the axes that `to` lacks, laid out over `to`, as one einsum: the broadcast
    product is never in memory. Axes match by name as in `align`; a `kv_head` axis meeting a `head`
    axis is read as its query group (query head h reads KV head h // (heads // kv_heads)), without
    repeating it. Computed in the operands' promoted dtype."""
    xdims, ydims, to = list(xdims), list(ydims), list(to)
    dtype = torch.result_type(x, y)
    x, y = x.to(dtype), y.to(dtype)
    out_dims = to
    if ("kv_head" in xdims and "head" in ydims) or ("kv_head" in ydims and "head" in xdims):
        if "head" not in to:
            raise ValueError(f"contract: KV heads meet query heads, but the result {to} keeps no query head")
        kv = x.shape[xdims.index("kv_head")] if "kv_head" in xdims else y.shape[ydims.index("kv_head")]
        if "head" in xdims:
            x, xdims = _head_groups(x, xdims, kv)
        else:
            y, ydims = _head_groups(y, ydims, kv)
        at = to.index("head")
        out_dims = to[:at] + ["kv_head", "group"] + to[at + 1:]
    letters: dict[str, str] = {}

    def spelled(dims):
        return "".join(letters.setdefault(d, chr(ord("a") + len(letters))) for d in dims)

    present = xdims + ydims
    out = torch.einsum(f"{spelled(xdims)},{spelled(ydims)}->{spelled([d for d in out_dims if d in present])}", x, y)
    if out_dims is not to:
        at = [d for d in out_dims if d in present].index("kv_head")
        out = out.flatten(at, at + 1)
    return out[tuple(slice(None) if d in present or d == "head" and out_dims is not to else None for d in to)]


def _head_groups(t, dims, kv_heads):
    """t's `head` axis as (kv_head, group): query head h is (h // group, h % group)."""
    at = dims.index("head")
    return t.unflatten(at, (kv_heads, t.shape[at] // kv_heads)), dims[:at] + ["kv_head", "group"] + dims[at + 1:]


def range_start(length, ranges):
    """Where a range of an axis of `length` entries starts: `ranges` are the (side, count) taken,
    outermost first (`x[first a][last b]`), each count clamped to what exists."""
    start = 0
    for side, n in ranges:
        n = clamp_count(n, length)
        start, length = (start if side == "first" else start + length - n), n
    return start


def attention(q, k, softmax=True, starts=None):
    """Causal q k^T / sqrt(d) of q [head, query, channel] (the last positions) over k [kv_head, key, channel].
    `starts` (host ints per KV head, a layer compacted with per-head counts): KV head h's keys are slots
    [starts[h], key); the slots below are no keys of it (-inf, 0 after the softmax)."""
    heads, queries, _ = q.shape
    length = k.shape[1]
    logits = grouped_logits(q, k)
    query_pos = torch.arange(length - queries, length, device=q.device)[:, None]
    logits.masked_fill_(torch.arange(length, device=q.device)[None, :] > query_pos, NEG_INF)
    if starts is not None and any(starts):
        first = torch.as_tensor(list(starts), dtype=torch.long, device=q.device)
        below = torch.arange(length, device=q.device)[None, :] < first[:, None]  # [kv_head, key]
        logits.masked_fill_(below.repeat_interleave(heads // k.shape[0], dim=0)[:, None, :], NEG_INF)
    return logits.softmax(dim=-1) if softmax else logits


def grouped_logits(q, k):
    """q k^T / sqrt(d), float32 [head, query, key], of q [head, query, channel] over k [kv_head, key, channel]
    (query head h reads KV head h // group): each KV head's query group is one matrix against its keys, so
    the keys are never repeated per query head."""
    heads, queries, head_dim = q.shape
    kv_heads, length = k.shape[0], k.shape[1]
    grouped = q.float().reshape(kv_heads, heads // kv_heads * queries, head_dim)
    return (grouped @ k.float().transpose(1, 2)).div_(math.sqrt(head_dim)).view(heads, queries, length)


def reduce(x, fn, dims):
    if fn == "sum":
        return x.sum(dim=dims)
    if fn == "mean":
        return x.mean(dim=dims)
    if any(x.shape[d] == 0 for d in dims):  # over no entries (an empty range): the identity, -inf / +inf
        shape = [size for d, size in enumerate(x.shape) if d not in {d % x.dim() for d in dims}]
        return x.new_full(shape, NEG_INF if fn == "max" else -NEG_INF)
    return x.amax(dim=dims) if fn == "max" else x.amin(dim=dims)


# the tensor-parallel group whose ranks each hold some of the model's query heads, while an engine of
# several ranks runs a step (`ranks_scope`; runtime/distributed/); None: one rank holds every head
_RANKS: contextvars.ContextVar = contextvars.ContextVar("kvc_ranks", default=None)


@contextlib.contextmanager
def ranks_scope(ranks):
    """Inside: `reduce_heads` combines the ranks' partial reductions over `ranks` (a `TPGroup`; None: no-op)."""
    token = _RANKS.set(ranks)
    try:
        yield
    finally:
        _RANKS.reset(token)


def reduce_heads(x, fn, dims):
    """`reduce` over axes that include the query heads (the compiler emits it there, compiler/lower_torch.py).
    Under tensor parallelism each rank holds an equal share of the heads: its partial sums are added and
    its maxima / minima combined over the ranks, a mean divided by every rank's count, so every rank
    gets the value one rank holding every head computes."""
    ranks = _RANKS.get()
    if ranks is None:
        return reduce(x, fn, dims)
    if fn in ("sum", "mean"):
        out = reduce(x, "sum", dims).contiguous()
        ranks.all_reduce(out)
        if fn == "mean":
            out = out / (math.prod(x.shape[d] for d in dims) * ranks.size)
        return out
    return ranks.all_reduce(reduce(x, fn, dims).contiguous(), fn)


def quantile(x, p, dims):
    """`quantile(x, p, over dims)`: per remaining index, the k-th smallest of the n entries over
    `dims`, k = floor(p * n + 1/2) (p * n rounded half up), -inf when k is 0. So `x <= quantile(x, p,
    ...)` holds for exactly k entries when they are distinct (ties at the threshold all hold):
    DuoAttention's `streaming = gate <= quantile(gate, sparsity, ...)` makes round(sparsity * n)
    heads stream, none at sparsity 0 (numpy's interpolated quantile would make one)."""
    dims = tuple(d % x.dim() for d in dims)
    rest = [d for d in range(x.dim()) if d not in dims]
    flat = x.permute(rest + list(dims)).reshape(*[x.shape[d] for d in rest], -1).float()
    n = flat.shape[-1]
    k = max(0, min(n, math.floor(p * n + 0.5)))
    if k == 0:
        return flat.new_full(flat.shape[:-1], NEG_INF)
    return flat.sort(dim=-1).values[..., k - 1]


def group(x, fn, dim, kv_heads):
    """Fold query heads into their KV head (head h reads KV head h // (heads // kv_heads)). Under tensor
    parallelism with KV heads replicated over ranks (`ranks_scope`), a rank holds part of each of its KV
    heads' query group: the replicas' partial folds are combined (a decode kernel's statistics, already
    folded over the rank's heads, combine the same way: a mean of equal shares is the mean)."""
    shape = tuple(x.shape)
    grouped = x.reshape(shape[:dim] + (kv_heads, shape[dim] // kv_heads) + shape[dim + 1:])
    ranks = _RANKS.get()
    if ranks is None or getattr(ranks, "replicas", 1) == 1:
        return reduce(grouped, fn, (dim + 1,))
    if fn not in ("sum", "mean", "max", "min"):
        raise ValueError(f"group: a {fn!r} over a query group split over ranks")
    op = "sum" if fn == "mean" else fn
    out = ranks.across_replicas(reduce(grouped, op, (dim + 1,)).contiguous(), op, dim)
    return out / (grouped.shape[dim + 1] * ranks.replicas) if fn == "mean" else out


def pool(x, mode, kernel, dim):
    """Stride-1 centred pooling; zero padding counts in avg, never wins in max."""
    kernel = int(kernel)
    if kernel == 1 or x.shape[dim] == 0:  # nothing to pool (a prompt no longer than the window)
        return x
    moved = x.movedim(dim, -1)
    radius = kernel // 2
    pad = 0.0 if mode == "avg" else NEG_INF
    windows = torch.nn.functional.pad(moved, (radius, radius), value=pad).unfold(-1, kernel, 1)
    pooled = windows.sum(dim=-1) / kernel if mode == "avg" else windows.amax(dim=-1)
    return pooled.movedim(-1, dim)


def softmax(x, dim):
    """Softmax along `dim` (float32); -inf entries get 0."""
    return torch.softmax(x.float(), dim=dim)


def redundancy(x, threshold, dim, channel):
    """R-KV's redundancy (Cai et al. 2025, arXiv 2505.24133) of each item along `dim` of `x` (vectors along
    `channel`, which the result drops): the items' cosine similarities S (a vector's norm + 1e-8 under it), the
    diagonal 0; in each row i the newest j with S[i, j] > threshold is not counted (S[i, j] = 0; with none, j = 0:
    the reference's argmax over an all-zero index row); each column's mean over the rows, softmaxed along `dim`."""
    dim, channel = dim % x.dim(), channel % x.dim()
    v = x.float().movedim((dim, channel), (-2, -1))
    unit = v / (v.norm(dim=-1, keepdim=True) + 1e-8)
    sim = unit @ unit.transpose(-1, -2)
    n = sim.shape[-1]
    sim = sim.masked_fill(torch.eye(n, dtype=torch.bool, device=sim.device), 0.0)
    positions = torch.arange(n, device=sim.device)
    newest = torch.where(sim > threshold, positions, torch.zeros_like(positions)).amax(dim=-1, keepdim=True)
    sim = sim.scatter(-1, newest, 0.0)
    out = sim.mean(dim=-2).softmax(dim=-1)  # [..., item]
    keep = [d for d in range(x.dim()) if d != channel]  # the result's axes in x's order
    return out.movedim(-1, keep.index(dim))


def span_reduce(x, spans, fn, dim):
    """`fn(x, within P)` over the spans of a text partition: x [kv_head, ..., key, ...] with its key axis at
    `dim`, `spans [kv_head, key]` int64 each stored slot's span (-1: a slot the head does not store). The
    key axis becomes the spans 0..S-1 (S: the most any head has); NaN for a span a head stores no slot of."""
    if fn not in ("sum", "mean", "max", "min"):
        raise ValueError(f"span_reduce: unknown reduction {fn!r}")
    v = x.float().movedim(dim, 1)  # [H, n, *rest]
    heads, n, rest = v.shape[0], v.shape[1], v.shape[2:]
    flat = v.reshape(heads, n, -1)
    count = int(spans.max()) + 1 if spans.numel() else 0
    inside = spans >= 0
    index = spans.clamp(min=0)[:, :, None].expand_as(flat)
    sizes = torch.zeros(heads, count, device=x.device).scatter_add_(1, spans.clamp(min=0), inside.float())
    if fn in ("sum", "mean"):
        out = torch.zeros(heads, count, flat.shape[2], device=x.device)
        out.scatter_add_(1, index, torch.where(inside[:, :, None], flat, 0.0))
        if fn == "mean":
            out = out / sizes.clamp(min=1)[:, :, None]
    else:
        fill = NEG_INF if fn == "max" else -NEG_INF
        out = torch.full((heads, count, flat.shape[2]), fill, device=x.device)
        out.scatter_reduce_(1, index, torch.where(inside[:, :, None], flat, fill), "amax" if fn == "max" else "amin")
    out = out.masked_fill((sizes == 0)[:, :, None], float("nan"))
    return out.reshape(heads, count, *rest).movedim(1, dim)


def duplicated(x, threshold, dim, channel):
    """`duplicated(x, threshold, along P)`: 1 where a later item along `dim` has a vector (along `channel`,
    which the result drops) of cosine similarity above `threshold` with this item's (a vector's norm + 1e-8
    under it), else 0; an item with NaN entries (a span a head stores none of) is nobody's duplicate."""
    dim, channel = dim % x.dim(), channel % x.dim()
    v = x.float().movedim((dim, channel), (-2, -1))
    unit = v / (v.norm(dim=-1, keepdim=True) + 1e-8)
    sim = unit @ unit.transpose(-1, -2)
    n = sim.shape[-1]
    later = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(diagonal=1)  # [i, j]: j after i
    out = ((sim > threshold) & later).any(dim=-1).float()  # NaN compares false
    keep = [d for d in range(x.dim()) if d != channel]
    return out.movedim(-1, keep.index(dim))


def grow(state, value, dim=-1):
    """A state with a key axis (`dim`) grows with the cache: new keys start at 0."""
    missing = value.shape[dim] - state.shape[dim]
    if missing <= 0:
        return state
    dim = dim % state.dim()
    return torch.nn.functional.pad(state, (0, 0) * (state.dim() - 1 - dim) + (0, missing))


def full_scores(score, per_head, kv_heads, context, start=0):
    """[kv_head, key] float32 over every cached key: a score over the keys [start, start + n) is
    placed at their positions, -inf elsewhere; a per-layer score is shared."""
    score = score.float()
    if not per_head:
        score = score.reshape(1, -1).expand(kv_heads, -1)
    return torch.nn.functional.pad(score, (start, context - start - score.shape[-1]), value=NEG_INF)


def no_scores(inputs, kv_heads, context):
    """The scores of a keep without a `top` (ranges only): zeros [kv_heads, context] on the inputs' device,
    read from `inputs.device` where the engine's lazy inputs have it (no copy of the cache made to learn it)."""
    device = getattr(inputs, "device", None)
    return torch.zeros(kv_heads, context, device=inputs["k"].device if device is None else device)


def ranked(scores, excluded):
    """Indices along the last dim, best first; ties to the older token; excluded ones last."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    out = excluded.expand_as(scores).gather(-1, order).to(torch.int8)
    return order.gather(-1, torch.sort(out, dim=-1, stable=True).indices)


class KeptRows(Sequence):
    """A selection's kept indices per KV head where every head keeps the same count: the sequence of rows the
    contract gives, over the [kv_heads, kept] tensor (`stack`) they are views of. A caller that wants them
    stacked (a decode batch's rows stacked as heads) takes the tensor as is; a row is a view made when asked
    for (unbinding a thousand stacked rows in each of 48 layers costs about 100 ms of host a step)."""

    def __init__(self, stack: torch.Tensor) -> None:
        self.stack = stack

    def __len__(self) -> int:
        return self.stack.shape[0]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self.stack[index].unbind(0))
        return self.stack[index]

    def __iter__(self):
        return iter(self.stack.unbind(0))


def select(scores, length, kv_heads, *, first, last, count, at_least, granularity, heads=None, starts=None,
           spans=None):
    """Kept key indices per KV head: the ranges, plus the top-ranked other tokens.

    Runs where `scores` live (CPU, GPU, or `meta` for shapes only) without reading a value back
    when every head keeps the same count: that count is a function of `length` and the counts
    alone, so the engine learns kept lengths on the host (a `meta` run) without a device sync.
    `heads` (a keep `for ROLE`: bool per KV head, host values) limits the keep to those heads,
    the others keeping every stored token; see `select_heads`. `starts` (host ints per KV head):
    head h stores its tokens in slots [starts[h], length) (a layer compacted with per-head
    counts), see `select_adaptive`. `spans` (granularity "spans"): whole spans of a text partition,
    see `select_spans`."""
    if granularity == "spans":
        return select_spans(scores, length, kv_heads, spans, first=first, last=last, count=count, starts=starts)
    if heads is not None:
        return select_heads(length, kv_heads, heads, starts, first=first, last=last, device=scores.device)
    if granularity == "global":
        return select_global(scores, length, first=first, last=last, count=count)
    if granularity == "head_adaptive":
        return select_adaptive(scores, length, kv_heads, first=first, last=last, count=count, at_least=at_least,
                               starts=starts)
    if starts is not None and any(starts):
        raise NotImplementedError(f"a {granularity} keep over a layer stored with per-head starts")
    device = scores.device
    n_first = clamp_count(first, length) if first is not None else 0
    n_last = clamp_count(last, length) if last is not None else 0
    if n_first + n_last >= length:  # the ranges cover every token
        return KeptRows(torch.arange(length, device=device).expand(kv_heads, length).contiguous())
    n = clamp_count(count, length - n_first - n_last) if granularity in ("kv_head", "layer") else 0
    # the ranges' slots and the n best others (a stable sort of the others alone: ranked's order, ties to the
    # older token), ascending: a sort of the n, not of every slot, and no masks (each one a launch per layer)
    parts = [torch.arange(n_first, device=device).expand(kv_heads, n_first)]
    if n:
        others = scores[:, n_first:length - n_last]
        best = torch.sort(others, dim=-1, descending=True, stable=True).indices[:, :n]
        parts.append(best.sort(dim=-1).values + n_first)
    parts.append(torch.arange(length - n_last, length, device=device).expand(kv_heads, n_last))
    return KeptRows(torch.cat(parts, dim=1))


def head_ranges(length, kv_heads, starts, first, last) -> tuple[list[int], list[int], list[int]]:
    """Per KV head of a layer whose head h stores slots [starts[h], length) (0 without starts): how many
    tokens it holds, and its `first` and `last` ranges counted from its own start (host ints)."""
    own = [length - (0 if starts is None else int(starts[h])) for h in range(kv_heads)]
    n_first = [clamp_count(first, n) if first is not None else 0 for n in own]
    n_last = [clamp_count(last, n - f) if last is not None else 0 for n, f in zip(own, n_first)]
    return own, n_first, n_last


def range_masks(length, own, n_first, n_last, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(start [kv_head, 1], forced [kv_head, length]) of `head_ranges`: each head's first slot, and the slots its
    ranges keep."""
    slot = torch.arange(length, device=device)[None, :]
    start = torch.as_tensor([length - n for n in own], device=device)[:, None]
    forced = ((slot >= start) & (slot < start + torch.as_tensor(n_first, device=device)[:, None])) \
        | (slot >= length - torch.as_tensor(n_last, device=device)[:, None])
    return start, forced


def select_spans(scores, length, kv_heads, spans, *, first, last, count, starts=None):
    """Whole spans of a text partition per KV head: `scores [kv_head, S]` rank the spans, `spans
    [kv_head, key]` give each stored slot's (-1: none). Head h's own tokens are slots [starts[h], length)
    (0 without starts) and its ranges (`first`, `last`) count from its own start; its other tokens are
    kept a whole span at a time: spans best first (ties: the older span; NaN, a span with no such
    token, last) while their tokens fit in `count` (clamped to the head's other tokens), the first that
    does not fit and every span after it dropped. The counts differ per head; on `meta` (shapes only,
    `spans` None) every head reports the most one can keep (its ranges plus `count`)."""
    device = scores.device
    own, n_first, n_last = head_ranges(length, kv_heads, starts, first, last)
    totals = [clamp_count(count, n - f - t) for n, f, t in zip(own, n_first, n_last)]
    if device.type == "meta" or spans is None:
        most = max(f + t + c for f, t, c in zip(n_first, n_last, totals))
        return [torch.empty(most, dtype=torch.long, device=device) for _ in range(kv_heads)]
    slot = torch.arange(length, device=device)[None, :]
    start, forced = range_masks(length, own, n_first, n_last, device)
    spans = spans.to(device=device, dtype=torch.long)
    eligible = (slot >= start) & ~forced & (spans >= 0)
    index = spans.clamp(min=0)
    sizes = torch.zeros(scores.shape, device=device).scatter_add_(1, index, eligible.float())
    order = torch.sort(scores.float().nan_to_num(nan=NEG_INF), dim=1, descending=True, stable=True).indices
    fits = sizes.gather(1, order).cumsum(dim=1) <= torch.as_tensor(totals, device=device)[:, None]
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=device).scatter_(1, order, fits)
    kept = forced | (eligible & chosen.gather(1, index))
    return [row.nonzero().flatten() for row in kept]


def select_adaptive(scores, length, kv_heads, *, first, last, count, at_least, starts=None):
    """A head-adaptive keep over heads that store different tokens: head h's own tokens are slots
    [starts[h], length) (0 without starts), its ranges (`first`, `last`) count from its own start,
    each head keeps at least `at_least` of its own other tokens (all where it has fewer), and the rest
    of `count` goes to the best-ranked remaining tokens of any head (ties: the lower head, then the
    older token). On `meta` (shapes only) every head reports the most one head can keep: the bound
    the engine reserves slots for (the counts themselves depend on the scores)."""
    device = scores.device
    own, n_first, n_last = head_ranges(length, kv_heads, starts, first, last)
    candidates = [n - f - t for n, f, t in zip(own, n_first, n_last)]
    floor_each = [clamp_count(at_least, c) if at_least is not None else 0 for c in candidates]
    total = clamp_count(count, sum(candidates))
    if device.type == "meta":
        rest = max(0, total - sum(floor_each))
        most = max(f + t + fl + min(c - fl, rest) for f, t, c, fl in zip(n_first, n_last, candidates, floor_each))
        return [torch.empty(most, dtype=torch.long, device=device) for _ in range(kv_heads)]
    start, forced = range_masks(length, own, n_first, n_last, device)
    excluded = forced | (torch.arange(length, device=device)[None, :] < start)  # [kv_head, key]: not a candidate
    order = ranked(scores.float(), excluded)
    chosen = torch.zeros(kv_heads, length, dtype=torch.bool, device=device)
    for h, n in enumerate(floor_each):
        chosen[h, order[h, :n]] = True
    rest = max(0, total - sum(floor_each))
    flat = ranked(scores.float().reshape(-1), (excluded | chosen).reshape(-1))[:rest]
    chosen.view(-1)[flat] = True
    kept = forced | chosen
    return [kept[h].nonzero().flatten() for h in range(kv_heads)]


def select_global(scores, length, *, first, last, count):
    """A top across layers and KV heads (`top(s, n, across layer, kv_head)`) over scores [layer, kv_head,
    key]: every (layer, head) keeps its ranges, and `count` more go to the best-ranked other tokens of any
    (ties: the lower layer, then head, then the older token). Kept indices [layer][kv_head], ascending."""
    layers, kv_heads = scores.shape[0], scores.shape[1]
    device = scores.device
    n_first = clamp_count(first, length) if first is not None else 0
    n_last = clamp_count(last, length - n_first) if last is not None else 0
    forced = torch.zeros(length, dtype=torch.bool, device=device)
    forced[:n_first] = True
    forced[length - n_last:] = True
    candidates = length - n_first - n_last
    total = clamp_count(count, layers * kv_heads * candidates)
    flat = ranked(scores.float().reshape(-1), forced.repeat(layers * kv_heads))[:total]
    chosen = torch.zeros(layers * kv_heads * length, dtype=torch.bool, device=device)
    chosen[flat] = True
    kept = chosen.view(layers, kv_heads, length) | forced
    return [[kept[layer, h].nonzero().flatten() for h in range(kv_heads)] for layer in range(layers)]


def replay_attention(q, sink, chunk, own):
    """A replayed chunk's attention (a `replay ... over first s` pass): queries q [head, query, channel] over
    the sink keys [kv_head, s, channel], the chunk's keys [kv_head, c, channel] and the replayed tokens' own
    keys [kv_head, query, channel] (causal among themselves), normalised over all of them -> the
    probabilities on the chunk's keys, [head, query, c] float32."""
    queries = q.shape[1]
    logits = grouped_logits(q, torch.cat([sink, chunk, own], dim=1))  # [head, query, s + c + query]
    own_pos = torch.arange(queries, device=q.device)
    future = own_pos[None, :] > own_pos[:, None]  # [query, own key]
    logits[:, :, sink.shape[1] + chunk.shape[1]:].masked_fill_(future, NEG_INF)
    return torch.softmax(logits, dim=-1)[:, :, sink.shape[1]:sink.shape[1] + chunk.shape[1]]


def all_tokens(length, kv_heads, starts=None, device=None):
    """Every stored token of each KV head (a keep whose `where` does not hold): slots [starts[h], length)."""
    return [torch.arange(0 if starts is None else int(starts[h]), length, device=device) for h in range(kv_heads)]


def select_heads(length, kv_heads, heads, starts=None, *, first, last, device=None):
    """A range keep `first a + last b for ROLE`, per KV head: head h stores its tokens in slots
    [starts[h], length) (0 without per-head starts); a head of the role keeps the first a and the
    last b of its own tokens, any other head keeps all of them. Ascending slot indices per head;
    counts follow from the host facts alone (lengths, starts, the role's mask)."""
    kept = []
    for h in range(kv_heads):
        start = 0 if starts is None else int(starts[h])
        own = length - start
        if not bool(heads[h]):
            kept.append(torch.arange(start, length, device=device))
            continue
        n_first = clamp_count(first, own) if first is not None else 0
        n_last = clamp_count(last, own) if last is not None else 0
        if n_first + n_last >= own:
            kept.append(torch.arange(start, length, device=device))
            continue
        kept.append(torch.cat([torch.arange(start, start + n_first, device=device),
                               torch.arange(length - n_last, length, device=device)]))
    return kept


def read_pages(scores, lengths, page, *, count, last):
    """A read plan's pages [row, kv_head, n] int32 (indices into each row's page table, -1: none) from
    page scores [row, kv_head, pages] and the rows' stored tokens `lengths` [row] (the step's own
    included): the `ceil(last / page)` newest stored pages always, and the `floor(count / page)` best
    ranked of the row's other stored pages (docs/design.md, "Plans": how a `read` lowers). Counts and
    the score's width fix n, so the plan's shape is static (CUDA-graph capturable, no host read);
    a row with fewer stored pages lists -1 for the rest. Ties rank as `torch.topk` leaves them."""
    width = scores.shape[-1]
    n_last = max(0, min(ceil(last / page), width))
    n_top = max(0, min(floor(count / page), width - n_last))
    stored = (lengths.long() + (page - 1)) // page  # [row]
    first_newest = stored - n_last  # [row]: the always-read pages start here
    column = torch.arange(width, device=scores.device)
    candidate = column[None, :] < first_newest[:, None]  # [row, pages]: stored, not among the newest
    ranked = scores.float().masked_fill(~candidate[:, None, :], NEG_INF)
    # unsorted: a plan's order does not matter to attention, and sorting cost a kernel per layer
    best, top = ranked.topk(n_top, dim=-1, sorted=False)  # [row, kv_head, n_top]
    top = torch.where(best > NEG_INF, top, -1)
    tail = first_newest[:, None] + torch.arange(n_last, device=scores.device)  # [row, n_last]
    tail = torch.where(tail >= 0, tail, -1)[:, None, :].expand(-1, scores.shape[1], -1)
    return torch.cat([top, tail], dim=-1).to(torch.int32)


# ---- a decode batch's hooks (`row` axis first; `context`, `prompt`, `step` are float64 [row]) ----


def decode_logits(q, k, context, softmax=True):
    """q k^T / sqrt(d) of each row's step query q [row, head, (query = 1,) channel] over its keys k
    [row, kv_head, key, channel] -> [row, head, (query,) key] float32; keys at or past the row's
    `context` are -inf (0 after the softmax)."""
    rows, heads, head_dim = q.shape[0], q.shape[1], q.shape[-1]
    kv_heads = k.shape[1]
    queries = q.float() if q.dim() == 4 else q.float()[:, :, None, :]  # [row, head, query, channel]
    # a KV head's query group as one matrix against its keys: no copy of the keys per query head
    grouped = queries.reshape(rows, kv_heads, -1, head_dim)  # [row, kv_head, group x query, channel]
    logits = (grouped @ k.float().transpose(-1, -2)).div_(math.sqrt(head_dim))
    logits = logits.view(rows, heads, queries.shape[2], k.shape[2])  # [row, head, query, key]
    past = torch.arange(k.shape[2], device=q.device)[None, :] >= per_row(context, rows, q.device)[:, None]
    logits.masked_fill_(past[:, None, None, :], NEG_INF)
    logits = logits.softmax(dim=-1) if softmax else logits
    return logits if q.dim() == 4 else logits[:, :, 0]


def row_range(x, dim, side, n, context):
    """`x[first n]` / `x[last n]` along `dim` of a decode batch's [row, ...] score, row b's own n and
    context: the keys outside the range are -inf (what `top` never ranks), so shapes stay static."""
    device = x.device
    n = per_row(n, x.shape[0], device).floor()
    context = per_row(context, x.shape[0], device)
    pos = torch.arange(x.shape[dim], device=device, dtype=torch.float64)
    inside = pos[None, :] < n[:, None] if side == "first" else pos[None, :] >= (context - n)[:, None]
    shape = [1] * x.dim()
    shape[0], shape[dim] = x.shape[0], x.shape[dim]
    return x.masked_fill(~inside.reshape(shape), NEG_INF)


def choose_tokens(scores, count, bound):
    """A shared selection over a decode batch: scores [row, key] (-inf: not rankable) -> the keys each
    row chooses [row, n] int32, its `floor(count[row])` best (ties as `torch.topk` leaves them), -1
    past them. n = floor(`bound`), the count at the widest row the batch's key axis holds, so the
    shape is static (CUDA-graph capturable, no host read)."""
    n = clamp_count(bound, scores.shape[-1])
    best, top = scores.float().topk(n, dim=-1)  # sorted: the first count[row] are the row's choice
    count = per_row(count, scores.shape[0], scores.device).floor()  # one count for every row (a parameter), or a row's
    rank = torch.arange(n, device=scores.device)
    keep = (rank[None, :] < count[:, None]) & (best > NEG_INF)
    return torch.where(keep, top, -1).to(torch.int32)


def read_tokens(chosen, last, kv_heads, first, context):
    """A token read plan from a shared selection `chosen` [row, n] (every KV head reads it) plus each
    row's `last[row]` newest stored tokens and the `first` tokens (a parameter: a static width):
    (tokens [row, kv_head, n + first] int32, last [row] int32). A chosen token that the first or the
    last cover (by the rows' `context` [row]) is listed once (-1 in the choice)."""
    device = chosen.device
    last = per_row(last, chosen.shape[0], device).floor().clamp(min=0)  # a parameter, or a count a row
    first = int(first)
    newest = per_row(context, chosen.shape[0], device)[:, None] - last[:, None]  # [row, 1]
    covered = (chosen >= newest) | ((chosen >= 0) & (chosen < first))
    chosen = torch.where(covered, torch.full_like(chosen, -1), chosen)
    if first:
        head = torch.arange(first, device=device, dtype=chosen.dtype)[None, :].expand(chosen.shape[0], -1)
        chosen = torch.cat([chosen, torch.where(head >= newest, torch.full_like(head, -1), head)], dim=-1)
    tokens = chosen[:, None, :].expand(-1, kv_heads, -1) if chosen.dim() == 2 else chosen
    return tokens.contiguous(), last.to(torch.int32)
