"""Hook facts: what the engine must know about each lowered hook to call it, as manifest data.

Pipeline position: after `lower_torch` (it reads the emitted `HookCode`s), before `codegen`
writes `manifest.json["hooks"]`. For each hook: the inputs it reads (`q`, `k`, `v`, `attn`),
whether it keeps (then the lowering has `<hook>_scores` / `<hook>_select`), its `where`
condition (Python over the symbols and parameters, or null), and, when it reads `attn`, how:

- `{"reduce": "group", "fn": "mean"|"sum"}`: every use of `attn` is `fn(attn, over group)`;
- `{"reduce": "head", "fn": ...}`: every use is `fn(attn, over head)` (one row for the layer);
- `{"reduce": "none", "fn": null}`: per query head, unreduced.

`key_local`: every value the hook accumulates into its state, and its keep's ranking score, is
computed key by key (from `attn`, parameters, the model's shape symbols and `[kv_head, key]`
states, and every state of the method has that shape; through elementwise operations and
reductions over head axes only; no window, pooling, norm or attention over keys, no
per-sequence symbol such as `context`, `prompt` or `step`, no `where`). The engine may then run
the hook once over a whole decode batch with the rows' keys laid side by side, over per-token
state kept in paged planes beside K/V (CUDA-graph capturable: runtime/methods_compiled_decode.py);
the keep's counts still use the row's symbols, at step end.

A keeping hook also states `last`: the `+ last N` of its keep expression as Python over the
symbols and parameters (null when it has none). Those N newest stored tokens always survive the
keep, in order, so the chain cache knows how far back a session's stored tail is still verbatim
(runtime/chains.py: rolling back to a common prefix after a stop-string cut).

`reads`: the hook answers with a read plan (a `read` in decode_before_attention: the lowering has
`<hook>_scores`, `<hook>_read` and `<hook>`, over a whole decode batch; runtime/compiled/read.py).
`clusters`: the read ranks the clusters of a `kmeans` partition (`{"partition", "summaries",
"estimate"}`): the engine keeps each sequence's cluster index and hands the hook its summaries
(runtime/compiled/cluster_index.py); the lowering has `<hook>`, `<hook>_ranges` and
`<partition>_segment`.
`tokens`: the hook chooses or reads shared selections, token plans (the lowering has one `<hook>`
over a whole decode batch, with per-row symbols and the layers' shared selections). A hook written
with several `where`s is one entry: its inputs joined, `reads` if any part reads, `where` any part's.

A keeping hook states `head_counts`: whether its KV heads keep different counts (`top(..., across
kv_head)`; the engine stores the layer with per-head starts and hands the hook's symbols `starts`).
It states `rowwise_select` too: its selection keeps each KV head's tokens from that
head's score row and the symbols alone (granularity `none`, `kv_head` or `layer`, not
`head_adaptive`), and none of its counts, ranges or `where` reads `kv_heads`. The engine may then
stack the score rows of several sequences whose symbols are equal into one selection, `kv_heads`
set to the stacked row count (step end over a decode batch: runtime/compiled/step_end.py). Its
`keep_symbols` are the engine symbols (`context`, `prompt`, `step`, `layer`) that its counts, ranges
and `where` read: "equal" means equal in those (StreamingLLM's and TOVA's: `context` alone).

A hook that reads the spans of a text partition (`dim P = split(key, at = [...])`) states `spans`:
{P: the strings that end a span}. The engine hands it `sym[P]`, each stored slot's span ([kv_head,
key] int64, -1 for a slot a head does not store), from the tokens' text (runtime/text_spans.py).
A top over P keeps whole spans: its KV heads keep different counts (`head_counts`).

A step_end keep states `head_local`: its ranking score is computed KV head by KV head from the
hook's `q`, `k` and `v` (windows, attention within a KV head's query group, reductions over `group`,
`query` or `key`, pooling, softmax and redundancy along a sequence axis; nothing across heads, no
state, no scalar of `heads` or `kv_heads`), ranked per KV head. Its `score_symbols` are the engine
symbols the score reads. The engine may then stack the q/k of several rows that agree on those and
on `keep_symbols` as the heads of one call (SnapKV's and R-KV's decode budget over a decode batch).

Every hook states `ranks`: how it runs under tensor parallelism, where each rank holds some KV heads
and their query groups (docs/design.md, "Tensor parallelism"). "local": every value it computes is
per KV head (or per query head) from that head's own inputs, its counts read no head count, and its
KV heads keep equal counts: each rank runs it over its heads alone (SnapKV, H2O's sums over its
group, Quest's page bounds). "reduce": as local, but a sum, mean, max or min over the query heads
(TOVA's `mean(..., over head)`, OmniKV's `max(..., over head)`): the lowering emits `_reduce_heads`,
which combines the ranks' partial reductions, so every rank computes the same value. "gather": a
selection across KV heads (Ada-KV's `top(..., across kv_head)`): the engine gathers the ranks' score
rows, selects over every head and keeps its own heads' part, every rank storing the layer as wide as
the widest head. "global": anything else across heads (a norm, softmax or quantile over heads, a
reduction over KV heads, whole text spans, a top across layers, a count of heads): not split across
ranks (the engine refuses it under tensor parallelism).

The engine's decode attention (attention variant `decode_stats`, `compiler/attention.py`; torch:
`runtime/attention/decode_stats.py`) emits exactly that reduction of the softmax probabilities,
so a decode step never materialises [head, key] when the method only needs [kv_head, key] or
[key]. The hook then receives `attn` with the reduced axis already folded to size 1, which its
own reduction folds exactly.
"""

from __future__ import annotations

import dataclasses
import re

import sympy as sp

from kvc.compiler.ir import (Accumulate, Assign, Attention, Elementwise, HookIR, Input, Keep, MethodIR, Norm, Pool,
                             Quantile, Redundancy, Reduce, Scalar, Softmax, Value, Window)
from kvc.compiler.lower_torch import HookCode, names_in

_FOLDABLE = {("group",): "group", ("head",): "head"}
_SHAPE_SYMBOLS = {"layer", "layers", "heads", "kv_heads", "head_dim"}  # the same for every row of a batch
PLANE_DIMS = ("kv_head", "key")  # the state shape a paged plane holds
_ROWWISE_GRANULARITIES = {"none", "kv_head", "layer"}  # each KV head ranked and kept on its own row
# the operations a head-local score may use (each applies KV head by KV head unless its axes name a head)
_HEAD_LOCAL_OPS = (Window, Attention, Reduce, Pool, Elementwise, Norm, Quantile, Softmax, Redundancy)


def _children(value: Value):
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        items = item if isinstance(item, tuple) else (item,)
        yield from (x for x in items if isinstance(x, Value))


def _attn_parents(value: Value, parent: Value | None, out: list) -> None:
    if isinstance(value, Input) and value.name == "attn" and value.kind == "hook":
        out.append(parent)
        return
    for child in _children(value):
        _attn_parents(child, value, out)


def attention_reduction(hook: HookIR) -> dict | None:
    """How `hook` reads `attn` (see the module docstring); None when it does not."""
    parents: list = []
    for stmt in hook.stmts:  # Assigns are substituted into the statements that use them
        if isinstance(stmt, Accumulate):
            _attn_parents(stmt.value, None, parents)
        elif isinstance(stmt, Keep) and stmt.select.top is not None:
            _attn_parents(stmt.select.top.score, None, parents)
    if not parents:
        return None
    kinds = {(p.fn, p.axes) if isinstance(p, Reduce) else None for p in parents}
    if len(kinds) == 1:
        kind = kinds.pop()
        if kind is not None and kind[0] in ("mean", "sum") and kind[1] in _FOLDABLE:
            return {"reduce": _FOLDABLE[kind[1]], "fn": kind[0]}
    return {"reduce": "none", "fn": None}


def _key_local_value(value: Value, names: set[str], states: dict[str, tuple[str, ...]]) -> bool:
    if isinstance(value, Input):
        if value.kind == "state":
            return states.get(value.name) == PLANE_DIMS
        return value.name == "attn" and value.dims[-1:] == ("key",)
    if isinstance(value, Scalar):
        return names_in(value.expr) <= names
    if isinstance(value, Reduce):
        return "key" not in value.axes and _key_local_value(value.src, names, states)
    if isinstance(value, Elementwise):
        return all(_key_local_value(a, names, states) for a in value.args)
    return False  # windows, pooling, norms and attention look across keys


def key_local(method: MethodIR, hook: HookIR) -> bool:
    """Is `hook` computed key by key (see the module docstring)?"""
    if hook.where is not None or any(s.dims != PLANE_DIMS for s in method.states):
        return False  # every state of the method must fit a plane: the engine keeps them all there
    names = _SHAPE_SYMBOLS | {p.name for p in method.params}
    states = {s.name: s.dims for s in method.states}
    values = []
    for stmt in hook.stmts:
        if isinstance(stmt, Accumulate):
            if states.get(stmt.state) != PLANE_DIMS:
                return False
            values.append(stmt.value)
        elif isinstance(stmt, Keep) and stmt.select.top is not None:
            values.append(stmt.select.top.score)
    return bool(values) and all(_key_local_value(v, names, states) and v.dims[-1:] == ("key",) for v in values)


_HEAD_AXES = {"head", "kv_head"}


def _head_local_value(value: Value) -> bool:
    if isinstance(value, Input):
        return value.kind == "hook" and value.name in ("q", "k", "v")
    if isinstance(value, Scalar):
        return not names_in(value.expr) & {"heads", "kv_heads"}
    axes = getattr(value, "axes", None) or ((value.axis,) if hasattr(value, "axis") else ())
    if set(axes) & _HEAD_AXES or not isinstance(value, _HEAD_LOCAL_OPS):
        return False  # a reduction, norm or softmax across heads, or an operation not known here
    return all(_head_local_value(child) for child in _children(value))


_RANK_REDUCTIONS = ("sum", "mean", "max", "min")  # what `_reduce_heads` combines over ranks


def _rank_value(value: Value, states: dict[str, tuple[str, ...]], reduces: list) -> bool:
    """Is `value` computed head by head from each head's own inputs, but for reductions over the query
    heads that the ranks combine (appended to `reduces`)?"""
    if isinstance(value, Input):
        dims = states.get(value.name, value.dims) if value.kind == "state" else value.dims
        return bool(set(dims) & _HEAD_AXES)  # q/k/v/attn, a per-head state, summary or span index
    if isinstance(value, Scalar):
        return not names_in(value.expr) & {"heads", "kv_heads"}
    axes = getattr(value, "axes", None) or ((value.axis,) if hasattr(value, "axis") else ())
    if set(axes) & _HEAD_AXES:
        if not (isinstance(value, Reduce) and "kv_head" not in axes and value.fn in _RANK_REDUCTIONS):
            return False  # a norm, softmax or quantile across heads, or a reduction over KV heads
        reduces.append(value)
    return all(_rank_value(child, states, reduces) for child in _children(value))


def _statement_values(stmt) -> list:
    """The tensor values a statement computes (its counts and ranges are sympy, checked apart)."""
    if isinstance(stmt, (Accumulate, Assign)):
        return [stmt.value]
    select = getattr(stmt, "select", None)
    return [] if select is None or select.top is None else [select.top.score]


def ranks(method: MethodIR, hook: HookIR, code: HookCode) -> str:
    """"local", "reduce", "gather" or "global": how `hook` splits over tensor-parallel ranks (module docstring)."""
    states = {s.name: s.dims for s in method.states}
    values = [v for stmt in hook.stmts for v in _statement_values(stmt)]
    reduces: list = []
    if not all(_rank_value(v, states, reduces) for v in values):
        return "global"
    selects = [stmt.select for stmt in hook.stmts if getattr(stmt, "select", None) is not None]
    granularities = {"none" if s.top is None else s.top.granularity for s in selects}
    if granularities & {"spans", "global"}:
        return "global"  # whole text spans, or a top across layers
    if "head_adaptive" in granularities:
        return "gather" if not reduces else "global"
    counts = [hook.where]
    for stmt in hook.stmts:
        select = getattr(stmt, "select", None)
        if select is not None:
            counts += [select.first, select.last] + ([select.top.count, select.top.at_least] if select.top else [])
    names = {str(s) for e in counts if e is not None for s in sp.sympify(e).free_symbols}
    if names & {"heads", "kv_heads"}:
        return "global"
    return "reduce" if reduces else "local"


def _joined_ranks(a: str, b: str) -> str:
    """The `ranks` of a hook written in parts (several `where`s): the part that splits least."""
    if {a, b} == {"reduce", "gather"}:
        return "global"
    order = ("local", "reduce", "gather", "global")
    return max(a, b, key=order.index)


def head_local(hook: HookIR, code: HookCode) -> bool:
    """Is a step_end keep's ranking score computed KV head by KV head from the hook's q/k/v (module
    docstring)?"""
    if hook.name != "step_end" or not rowwise_select(code) or code.keep["granularity"] != "kv_head":
        return False
    scores = [stmt.select.top.score for stmt in hook.stmts if isinstance(stmt, Keep) and stmt.select.top is not None]
    return bool(scores) and all(v.dims == PLANE_DIMS and _head_local_value(v) for v in scores)


def score_symbols(hook: HookIR) -> list[str]:
    """The engine symbols that a keep's ranking score reads (a window's count, a pooling kernel, a scalar)."""
    names: set[str] = set()

    def visit(value: Value) -> None:
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if isinstance(item, sp.Basic):
                names.update(names_in(item))
        for child in _children(value):
            visit(child)

    for stmt in hook.stmts:
        if isinstance(stmt, Keep) and stmt.select.top is not None:
            visit(stmt.select.top.score)
    return [name for name in ENGINE_SYMBOLS if name in names]


def rowwise_select(code: HookCode) -> bool:
    """Whether a keeping hook's selection is per KV head row and blind to `kv_heads` (module docstring)."""
    keep = code.keep
    if keep is None or keep["granularity"] not in _ROWWISE_GRANULARITIES:
        return False
    exprs = [keep[name] for name in ("first", "last", "count", "at_least")] + [code.where or ""]
    return not any(re.search(r"\bkv_heads\b", expr) for expr in exprs)


def ring_form(hook: HookIR, code: HookCode) -> str | None:
    """Which decode ring a keep's shape allows (runtime/kv/ring.py, docs/design.md "Decode rings"): "window"
    for `first a + last b` (no ranking: the sinks stay, the newest token replaces the oldest recent one),
    "ranked" for `top(score, h) + last b` ranked per KV head or per layer with no `first` and no `at_least`
    (the slots that leave the recent window compete with the h ranked ones for theirs), None otherwise. The
    engine decides from the counts' values whether a ring applies. One keep a hook: a second would select
    from the first's result."""
    keep = code.keep
    if (keep is None or keep.get("within") or keep["at_least"] != "None"
            or sum(isinstance(stmt, Keep) for stmt in hook.stmts) != 1):
        return None
    if keep["count"] == "None":
        return "window"
    if keep["first"] == "None" and keep["granularity"] in ("kv_head", "layer"):
        return "ranked"
    return None


ENGINE_SYMBOLS = ("context", "prompt", "step", "layer")


def keep_symbols(hook: HookIR) -> list[str]:
    """The engine symbols that a hook's keep counts (`first`, `last`, `top`'s count and `at_least`) and
    its `where` read: rows of one layer that agree on them get the same selection from the same scores
    (the engine batches step-end selections by them, runtime/compiled/step_end.py)."""
    exprs = [hook.where]
    for keep in hook.keeps:
        sel = keep.select
        exprs += [sel.first, sel.last] + ([sel.top.count, sel.top.at_least] if sel.top is not None else [])
    names = {str(s) for e in exprs if e is not None for s in sp.sympify(e).free_symbols}
    return [name for name in ENGINE_SYMBOLS if name in names]


def describe(method: MethodIR, codes: list[HookCode]) -> dict[str, dict]:
    """manifest["hooks"]: per hook name, its inputs, keep, where, attention reduction, kept tail,
    whether it is key-local and whether its selection is row-wise."""
    out: dict[str, dict] = {}
    for hook, code in zip(method.hooks, codes):
        last = None if code.keep is None or code.keep["last"] == "None" else code.keep["last"]
        fact = {"inputs": sorted(code.inputs), "keeps": code.keep is not None, "where": code.where,
                "reads": code.read is not None, "tokens": code.rows and (code.read is None or "tokens" in code.read),
                "attention": attention_reduction(hook), "last": last, "key_local": key_local(method, hook),
                "rowwise_select": rowwise_select(code), "ranks": ranks(method, hook, code)}
        if code.read is not None and "clusters" in code.read:  # a read over a cluster index (cluster_index.py)
            partition = method.partitions[code.read["clusters"]]
            fact["clusters"] = {"partition": partition.name, "summaries": sorted(partition.summaries),
                                "estimate": code.read["estimate"] != "None"}
        if code.keep is not None:
            fact["keep_symbols"] = keep_symbols(hook)
            fact["head_local"] = head_local(hook, code)
            fact["score_symbols"] = score_symbols(hook)
            # kept counts differ per KV head (a `top(..., across kv_head)`): the layer is stored with per-head starts
            fact["head_counts"] = code.keep["granularity"] in ("head_adaptive", "spans")
            fact["ring"] = ring_form(hook, code)
        if code.spans:  # the text partitions whose spans it reads: name -> the strings that end a span
            fact["spans"] = {name: list(method.spans[name]) for name in sorted(code.spans)}
        if code.keep is not None and code.keep.get("role"):  # a per-head keep: only the role's heads evict
            fact["role"] = code.keep["role"]
        before = out.get(hook.name)
        if before is not None:  # the same hook under another `where` (codegen allows it for token hooks)
            wheres = [w for w in (before["where"], code.where) if w is not None]
            fact.update(inputs=sorted(set(before["inputs"]) | code.inputs), reads=before["reads"] or fact["reads"],
                        where=None if len(wheres) < 2 else " or ".join(f"({w})" for w in wheres),
                        ranks=_joined_ranks(before["ranks"], fact["ranks"]))
        out[hook.name] = fact
    return out
