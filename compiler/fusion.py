"""Fusion pass: which parts of a method's hooks become one fused Triton kernel.

Pipeline position: after `legality`, before `codegen`. It pattern-matches score expressions of
the IR against the kernel families in `compiler/templates/` and returns a `FusionPlan`: for each
fused kernel, its family, the hook and value it computes, and the constant flags the template is
rendered with. Everything not matched runs as plain torch ops (the torch lowering computes every
value anyway; a fused kernel is an equivalent fast path, tested against it).

Family `attention_columns` — column reductions of causal attention, without writing the
[query, key] probability matrix: a row pass computes each query's softmax max and normaliser,
a column pass recomputes QK^T tile by tile and reduces the probabilities over queries, then
pools along keys (pooling shifts recomputed in registers) and averages the GQA group (or all
heads). It covers:
- observation-window scores (SnapKV, PyramidKV, Ada-KV): `mean(pool(sum|mean(attention(q[last w],
  k)[first (context - w) along key], over query), ...), over group)`;
- the last query's scores (TOVA): `mean(attention(q[last 1], k), over head, query)`;
- attention column sums of a prefill chunk (H2O): `seen += sum(mean(attn, over group), over query)`.

A match is exact, axes included: the hook's own `q` (its last `w` queries) and `k`, `attn` over
[head, query, key], keys sliced only as `[first (context - w) along key]`, pooling along `key`,
the result over [kv_head, key] (or [key]). The wrapper's own steps (pooling, the group or head
mean, the -inf padding of the window's keys) act on those axes by position, which the match pins;
anything else declines, and the torch lowering (axis-aligned by name) computes it.

Family `page_scores` — a sparse read's page scores straight from the paged summaries (Quest's
bound): `reduce(reduce(f(q, summaries...), over channel), over group)` over [kv_head, item], with
`f` any elementwise expression of the step's query and the page summaries (and numbers). The
kernel reads each row's summaries through its page table (no gather copy, no [head, page, channel]
intermediate) and writes [row, kv_head, item] float32; `f` is rendered into the kernel as Triton.
Where `f` is Quest's bound `max(q * hi, q * lo)` summed over channels, with `hi` the max and `lo`
the min summary of one source over one partition (so hi >= lo), it equals `max(q, 0) . hi +
min(q, 0) . lo`: flag `BOUND = (hi, lo)`, two matrix products over the whole GQA group on tensor
cores instead of elementwise work per query head; where `f` is `q * s`, summed over channels, it is one
product (`PRODUCT = s`). Over the clusters of a `kmeans` partition (RetroInfer's centroids; flag `ROWS`,
entry point `cluster_scores`) the kernel reads the summaries from each decode row's sequence row of the
index instead of through a page table (no gather copy of the rows' summaries).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import sympy as sp

from kvc.compiler.lower_torch import pyexpr
from kvc.dsl import ast
from kvc.compiler.ir import (Accumulate, Attention, Elementwise, Input, Keep, MethodIR, Pool, Read, Reduce, Scalar,
                             Value, Window)

KEYS = ("kv_head", "key", "channel")


@dataclass(frozen=True)
class KernelSpec:
    family: str  # template family, e.g. 'attention_columns'
    name: str  # python entry point in triton_kernels.py
    hook: str
    flags: tuple[tuple[str, object], ...]  # constant flags, sorted by name
    doc: str
    also: tuple[str, ...] = ()  # other hooks whose keep scores the same tree (step_end's decode budget)

    @property
    def flag(self) -> dict[str, object]:
        return dict(self.flags)


@dataclass
class FusionPlan:
    kernels: list[KernelSpec] = field(default_factory=list)


def _window_score(value: Value) -> dict | None:
    """Match reduce-group(pool?(reduce-query(attention(q[last w], k)[first ... along key])))."""
    flags: dict[str, object] = {}
    v = value
    if isinstance(v, Reduce) and v.axes == ("group",) and v.fn == "mean" and v.dims == ("kv_head", "key"):
        flags["HEAD_REDUCE"] = "group"
        v = v.src
    elif isinstance(v, Reduce) and set(v.axes) == {"head", "query"} and v.fn == "mean" and v.dims == ("key",):
        flags["HEAD_REDUCE"] = "all"
        flags["QUERY_REDUCE"] = "mean"
        flags["POOL"] = "none"
        flags["KERNEL_EXPR"] = "1"
        v = v.src
    else:
        return None
    if "POOL" not in flags:
        if isinstance(v, Pool) and v.axis == "key":
            flags["POOL"] = v.mode
            flags["KERNEL_EXPR"] = pyexpr(v.kernel)
            v = v.src
        else:
            flags["POOL"] = "none"
        if not (isinstance(v, Reduce) and v.axes == ("query",) and v.fn in ("sum", "mean")):
            return None
        flags["QUERY_REDUCE"] = v.fn
        v = v.src
    sliced = v if isinstance(v, Window) else None
    if sliced is not None:
        v = v.src
    if not _window_attention(v):
        return None
    if sliced is not None:  # only `[first (context - w) along key]`: the keys before the window
        if not (sliced.axis == "key" and sliced.side == "first"
                and sp.simplify(sp.sympify(sliced.count) - (sp.Symbol("context") - sp.sympify(v.q.count))) == 0):
            return None
    flags["SLICED_KEYS"] = sliced is not None
    flags["WINDOW_EXPR"] = pyexpr(v.q.count)
    flags.setdefault("KERNEL_EXPR", "1")
    return flags


def _window_attention(v: Value) -> bool:
    """`attention(q[last w], k)` of the hook's own q and k, over [head, query, key]: what the kernel
    computes (any other operand, range or axis layout is left to the torch lowering)."""
    return (isinstance(v, Attention) and v.softmax and v.dims == ("head", "query", "key")
            and isinstance(v.q, Window) and v.q.side == "last" and v.q.axis == "query"
            and _hook_input(v.q.src, "q", ("head", "query", "channel")) and _hook_input(v.k, "k", KEYS))


def _hook_input(v: Value, name: str, dims: tuple[str, ...]) -> bool:
    return isinstance(v, Input) and v.kind == "hook" and v.name == name and v.dims == dims


def _column_sum(value: Value) -> bool:
    """Match sum(mean(attn, over group), over query) (or the two reductions swapped)."""
    v = value
    axes = []
    while isinstance(v, Reduce) and v.fn in ("sum", "mean"):
        axes.append((v.fn, v.axes))
        v = v.src
    return _hook_input(v, "attn", ("head", "query", "key")) and sorted(axes) == [("mean", ("group",)),
                                                                                ("sum", ("query",))]


# elementwise ops of the IR -> Triton (f-strings over the operands' Triton expressions)
_TRITON_OPS = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
               "max": "tl.maximum({0}, {1})", "min": "tl.minimum({0}, {1})", "neg": "(-{0})", "abs": "tl.abs({0})",
               "exp": "tl.exp({0})", "log": "tl.log({0})", "sqrt": "tl.sqrt({0})"}
CHANNEL_FNS = ("sum", "mean", "max", "min")
GROUP_FNS = ("sum", "mean", "max", "min")


def _page_expr(v: Value, item: str, summaries: list[str]) -> str | None:
    """`v` (over [head, item, channel] or a part of it) as a Triton expression of `qv` ([1, BLOCK_D],
    the head's query) and `s_<summary>` ([BLOCK_P, BLOCK_D]); None where it is anything else."""
    if isinstance(v, Input) and v.kind == "hook" and v.name == "q" and v.dims == ("head", "channel"):
        return "qv"
    if isinstance(v, Input) and v.kind == "summary" and v.dims == ("kv_head", item, "channel"):
        if v.name not in summaries:
            summaries.append(v.name)
        return f"s_{v.name}"
    if isinstance(v, Scalar) and sp.sympify(v.expr).is_number:
        return repr(float(sp.sympify(v.expr)))
    if isinstance(v, Elementwise) and v.fn in _TRITON_OPS:
        args = [_page_expr(a, item, summaries) for a in v.args]
        return None if any(a is None for a in args) else _TRITON_OPS[v.fn].format(*args)
    return None


def _summary_fns(method: MethodIR) -> dict[str, tuple[str, str, str]]:
    """name -> (reducer, source, partition) of each `summary name = fn(source, within partition)`."""
    out = {}
    for decl in getattr(getattr(method.checked, "method", None), "items", ()):
        e = getattr(decl, "value", None)
        if not (isinstance(decl, ast.Summary) and isinstance(e, ast.Call) and len(e.args) == 1
                and isinstance(e.args[0], ast.Name)):
            continue
        within = e.clause("within")
        if within is not None and len(within.dims) == 1:
            out[decl.name.name] = (e.func.name, e.args[0].id, within.dims[0].name)
    return out


def _bound(v: Value, item: str, fns: dict[str, tuple[str, str, str]]) -> tuple[str, str] | None:
    """`max(q * hi, q * lo)` (either order) with `hi` a max and `lo` a min summary of one source over
    one partition: (hi, lo); None for anything else."""
    if not (isinstance(v, Elementwise) and v.fn == "max" and len(v.args) == 2):
        return None
    names = [_product(a, item) for a in v.args]
    if None in names:
        return None
    decls = [fns.get(n) for n in names]
    if None in decls or decls[0][1:] != decls[1][1:] or {decls[0][0], decls[1][0]} != {"max", "min"}:
        return None
    return (names[0], names[1]) if decls[0][0] == "max" else (names[1], names[0])


def _page_score(read: Read, fns: dict[str, tuple[str, str, str]], partitioned: bool) -> dict | None:
    """Match a read's `reduce(reduce(f(q, summaries), over channel), over group)` over [kv_head, item]
    (`partitioned`: the items are a `kmeans` partition's clusters, whose summaries live in each sequence's row)."""
    v, item = read.select.top.score, read.item
    if not (isinstance(v, Reduce) and v.axes == ("group",) and v.fn in GROUP_FNS and v.dims == ("kv_head", item)):
        return None
    group_fn, v = v.fn, v.src
    if not (isinstance(v, Reduce) and v.axes == ("channel",) and v.fn in CHANNEL_FNS and v.dims == ("head", item)):
        return None
    channel_fn, v = v.fn, v.src
    summaries: list[str] = []
    expr = _page_expr(v, item, summaries)
    if expr is None or not summaries:
        return None
    bound = _bound(v, item, fns) if channel_fn == "sum" else None
    product = _product(v, item) if channel_fn == "sum" and bound is None else None
    return {"CHANNEL_REDUCE": channel_fn, "GROUP_REDUCE": group_fn, "EXPR": expr, "SUMMARIES": tuple(summaries),
            "BOUND": bound or (), "PRODUCT": product or "", "ROWS": partitioned}


def _product(v: Value, item: str) -> str | None:
    """`q * s` (either order) with `s` a summary over [kv_head, item, channel]: s; None for anything else."""
    if not (isinstance(v, Elementwise) and v.fn == "mul" and len(v.args) == 2):
        return None
    qs = [x for x in v.args if isinstance(x, Input) and x.kind == "hook" and x.name == "q"
          and x.dims == ("head", "channel")]
    ss = [x for x in v.args if isinstance(x, Input) and x.kind == "summary"
          and x.dims == ("kv_head", item, "channel")]
    return ss[0].name if len(qs) == 1 and len(ss) == 1 else None


def _add_keep_score(out: FusionPlan, hook: str, flags: dict) -> None:
    """A keep's score as one `attention_columns` kernel: prefill_end's, and step_end's (a decode budget: the
    rows' query windows over their stored keys), one kernel where both score the same tree."""
    name = "last_query_score" if flags["HEAD_REDUCE"] == "all" else "window_score"
    doc = ("TOVA-style: the last query's attention, averaged over every head" if name == "last_query_score"
           else "observation-window scores, pooled, averaged over the GQA group")
    flags = tuple(sorted({**flags, "ACCUMULATE": False}.items()))
    for i, kernel in enumerate(out.kernels):
        if kernel.family == "attention_columns" and kernel.flags == flags and kernel.name == name:
            out.kernels[i] = dataclasses.replace(kernel, also=(*kernel.also, hook))
            return
    if any(kernel.name == name for kernel in out.kernels):
        name = f"{hook}_{name}"
    out.kernels.append(KernelSpec("attention_columns", name, hook, flags, doc))


def plan(method: MethodIR) -> FusionPlan:
    out = FusionPlan()
    for hook in method.hooks:
        for stmt in hook.stmts:  # names are already substituted: a keep's score is one whole tree
            if isinstance(stmt, Keep) and stmt.select.top is not None and hook.name in ("prefill_end", "step_end"):
                flags = _window_score(stmt.select.top.score)
                if flags is not None:
                    _add_keep_score(out, hook.name, flags)
            if (isinstance(stmt, Accumulate) and hook.name == "prefill_chunk" and stmt.dims == ("kv_head", "key")
                    and _column_sum(stmt.value)):
                flags = {"HEAD_REDUCE": "group", "POOL": "none", "QUERY_REDUCE": "sum", "SLICED_KEYS": False,
                         "ACCUMULATE": True, "KERNEL_EXPR": "1", "WINDOW_EXPR": "None", "STATE": stmt.state,
                         "WHOLE_HOOK": len(hook.stmts) == 1}
                out.kernels.append(KernelSpec(
                    "attention_columns", "column_sum", hook.name, tuple(sorted(flags.items())),
                    f"H2O-style: adds a prefill chunk's attention column sums into `{stmt.state}`"))
            if isinstance(stmt, Read) and stmt.select.top is not None and hook.name == "decode_before_attention":
                clusters = stmt.item in method.partitions
                flags = _page_score(stmt, _summary_fns(method), clusters)
                if flags is not None:
                    out.kernels.append(
                        KernelSpec("page_scores", "cluster_scores", hook.name, tuple(sorted(flags.items())),
                                   "a cluster read's scores from the rows' cluster summaries") if clusters else
                        KernelSpec("page_scores", "page_scores", hook.name, tuple(sorted(flags.items())),
                                   "a sparse read's page scores from the paged summaries"))
    return out
