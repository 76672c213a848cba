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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvc.compiler.lower_torch import pyexpr
from kvc.compiler.ir import Accumulate, Attention, Input, Keep, MethodIR, Pool, Reduce, Value, Window


@dataclass(frozen=True)
class KernelSpec:
    family: str  # template family, e.g. 'attention_columns'
    name: str  # python entry point in triton_kernels.py
    hook: str
    flags: tuple[tuple[str, object], ...]  # constant flags, sorted by name
    doc: str

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
    if isinstance(v, Reduce) and v.axes == ("group",) and v.fn == "mean":
        flags["HEAD_REDUCE"] = "group"
        v = v.src
    elif isinstance(v, Reduce) and set(v.axes) == {"head", "query"} and v.fn == "mean":
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
    flags["SLICED_KEYS"] = isinstance(v, Window) and v.axis == "key" and v.side == "first"
    if flags["SLICED_KEYS"]:
        v = v.src
    if not (isinstance(v, Attention) and v.softmax and isinstance(v.q, Window) and v.q.side == "last"):
        return None
    flags["WINDOW_EXPR"] = pyexpr(v.q.count)
    flags.setdefault("KERNEL_EXPR", "1")
    return flags


def _column_sum(value: Value) -> bool:
    """Match sum(mean(attn, over group), over query) (or the two reductions swapped)."""
    v = value
    axes = []
    while isinstance(v, Reduce) and v.fn in ("sum", "mean"):
        axes.append((v.fn, v.axes))
        v = v.src
    return isinstance(v, Input) and v.name == "attn" and sorted(axes) == [("mean", ("group",)), ("sum", ("query",))]


def plan(method: MethodIR) -> FusionPlan:
    out = FusionPlan()
    for hook in method.hooks:
        for stmt in hook.stmts:  # names are already substituted: a keep's score is one whole tree
            if isinstance(stmt, Keep) and stmt.select.top is not None and hook.name == "prefill_end":
                flags = _window_score(stmt.select.top.score)
                if flags is not None:
                    name = "last_query_score" if flags["HEAD_REDUCE"] == "all" else "window_score"
                    doc = ("TOVA-style: the last query's attention, averaged over every head" if name ==
                           "last_query_score" else "observation-window scores, pooled, averaged over the GQA group")
                    flags["ACCUMULATE"] = False
                    out.kernels.append(KernelSpec("attention_columns", name, hook.name,
                                                  tuple(sorted(flags.items())), doc))
            if isinstance(stmt, Accumulate) and hook.name == "prefill_chunk" and _column_sum(stmt.value):
                flags = {"HEAD_REDUCE": "group", "POOL": "none", "QUERY_REDUCE": "sum", "SLICED_KEYS": False,
                         "ACCUMULATE": True, "KERNEL_EXPR": "1", "WINDOW_EXPR": "None", "STATE": stmt.state,
                         "WHOLE_HOOK": len(hook.stmts) == 1}
                out.kernels.append(KernelSpec(
                    "attention_columns", "column_sum", hook.name, tuple(sorted(flags.items())),
                    f"H2O-style: adds a prefill chunk's attention column sums into `{stmt.state}`"))
    return out
