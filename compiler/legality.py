"""Legality pass: which hook may run which IR operation, re-checked on the IR before codegen.

Pipeline position: after `ir.build`, before `fusion`. The checker (`kvc.dsl`) already rejects a
`keep` where the engine cannot evict and `attn` where no attention exists; this pass re-states
those rules against the IR the code generator will actually see (so a future IR rewrite cannot
smuggle an illegal op through) and adds the lowering limits of this compiler version: what the
engine contract cannot run yet. It returns problems; `check` raises the first as `NotLowerable`.
"""

from __future__ import annotations

from kvc.compiler.ir import (Accumulate, Assign, Choose, Estimate, Input, Keep, MethodIR, NotLowerable, Read,
                             SpanReduce, Window)
from kvc.compiler.lower_torch import names_in

# hook -> (may keep, hook inputs it has)
HOOK_RULES: dict[str, tuple[bool, frozenset[str]]] = {
    "prefill_chunk": (True, frozenset({"q", "k", "v", "attn"})),
    "prefill_end": (True, frozenset({"q", "k", "v"})),
    "decode_after_attention": (True, frozenset({"q", "k", "v", "attn"})),
    "step_end": (True, frozenset({"q", "k", "v"})),
    "turn_end": (True, frozenset({"k", "v"})),
    # a replayed chunk's queries and their attention over the context (runtime/context_replay.py); the keep
    # after the whole pass reads the method's state, once for all layers
    "replay_chunk": (False, frozenset({"q", "attn"})),
    "replay_end": (True, frozenset()),
    # reads the step's queries, the page summaries and the stored keys (the step's own among them)
    "decode_before_attention": (False, frozenset({"q", "k"})),
}
ROLE_KEEP_HOOKS = ("prefill_chunk", "step_end")  # where a per-head `keep ... for ROLE` runs (its plans)
GRANULARITIES = ("kv_head", "layer", "head_adaptive", "global", "spans")
SPAN_HOOKS = ("step_end",)  # text partitions: the engine hands a step_end the spans of every stored token
GLOBAL_HOOKS = ("replay_end",)  # a top across layers runs where every layer's scores are at hand
READ_GRANULARITIES = ("kv_head", "layer")
# a read plan's shape is static (decode stays in CUDA graphs) and one `where` covers the whole batch:
# its counts and condition may not read what differs between the rows of a decode batch
ROW_SYMBOLS = {"context", "prompt", "step"}


def _nodes(value):
    """Every value of a tensor expression, depth first (operands through `src`, `q`, `k` and `args`)."""
    stack = [value]
    while stack:
        v = stack.pop()
        yield v
        for field in ("src", "q", "k"):
            if hasattr(v, field):
                stack.append(getattr(v, field))
        stack.extend(getattr(v, "args", ()))


def _inputs(value) -> list[Input]:
    return [v for v in _nodes(value) if isinstance(v, Input)]


def _reads_spans(value) -> bool:
    return any(isinstance(v, SpanReduce) for v in _nodes(value))


def _windows_static(value) -> list[str]:
    """`q[last n]` outside a chunk needs an n the engine can fix up front (no context symbols)."""
    bad = []
    for v in _nodes(value):
        if isinstance(v, Window) and isinstance(v.src, Input) and v.src.name == "q":
            names = {str(s) for s in getattr(v.count, "free_symbols", ())}
            if names & {"context", "prompt", "step"}:
                bad.append(f"q[{v.side} n] needs an n that does not depend on {', '.join(sorted(names))}")
    return bad


def problems(method: MethodIR) -> list[str]:
    out: list[str] = []
    for hook in method.hooks:
        rule = HOOK_RULES.get(hook.name)
        if rule is None:
            out.append(f"hook `{hook.name}` is not lowered yet")
            continue
        may_keep, inputs = rule
        out.extend(_read_problems(method, hook))
        for stmt in hook.stmts:
            value = stmt.value if isinstance(stmt, (Assign, Accumulate)) else None
            if isinstance(stmt, Keep):
                if not may_keep:
                    out.append(f"`keep` is not allowed in {hook.name}")
                if stmt.role is not None and stmt.select.top is not None:
                    out.append("`keep top(...) for ROLE` is not lowered yet (only `first n + last m for ROLE`)")
                if stmt.role is not None and hook.name not in ROLE_KEEP_HOOKS:
                    out.append(f"`keep ... for ROLE` in {hook.name} is not lowered yet")
                top = stmt.select.top
                if top is not None:
                    value = top.score
                    if top.granularity not in GRANULARITIES:
                        out.append(f"{top.granularity} selections are not lowered yet")
                    elif top.granularity == "spans" and hook.name not in SPAN_HOOKS:
                        out.append(f"a top over spans is lowered in {', '.join(SPAN_HOOKS)} only, not in {hook.name}")
                    elif top.granularity == "global" and hook.name not in GLOBAL_HOOKS:
                        out.append(f"a top across layers is lowered in {', '.join(GLOBAL_HOOKS)} only, not in "
                                   f"{hook.name}")
            if isinstance(stmt, (Read, Estimate, Choose)) and stmt.select.top is not None:
                value = stmt.select.top.score
            if value is None:
                continue
            if _reads_spans(value) and hook.name not in SPAN_HOOKS:
                out.append(f"spans of a text partition are lowered in {', '.join(SPAN_HOOKS)} only, not in {hook.name}")
            for inp in _inputs(value):
                if inp.kind == "hook" and inp.name not in inputs:
                    out.append(f"`{inp.name}` is not available in {hook.name}")
            out.extend(_windows_static(value))
    return out


def _read_problems(method: MethodIR, hook) -> list[str]:
    """What a hook's `read` needs: decode_before_attention, one read, page counts and a `where` that
    the whole batch shares, a ranked top per KV head or per layer, no `first n` over pages. A token read of a
    shared selection (and a hook that chooses one) may count by row (`last (context - prompt)`):
    its plan's shape is the selection's, and the per-row range is a [row] tensor; its `where` may not.
    A read over the clusters of a `kmeans` partition may count by row and take a `first n` (its
    ranges read parameters only: lower_torch checks them)."""
    reads = hook.reads
    out = []
    if hook.chooses:
        if hook.name != "decode_before_attention":
            out.append(f"a shared selection is chosen in decode_before_attention only, not in {hook.name}")
        rows = names_in(hook.where) & ROW_SYMBOLS if hook.where is not None else set()
        if rows:
            out.append(f"a `where` of a hook that chooses may not depend on {', '.join(sorted(rows))} (the whole "
                       "decode batch runs it)")
    if not reads:
        return out
    if hook.name != "decode_before_attention":
        out.append(f"`read` is not allowed in {hook.name} (only in decode_before_attention)")
    if len(reads) > 1:
        out.append(f"{hook.name}: more than one `read` in a hook is not lowered yet")
    select = reads[0].select
    clusters = reads[0].item in method.partitions  # a read over a cluster index (lower_torch checks its ranges)
    if select.first is not None and not clusters and reads[0].item != "key":
        out.append("`read ... + first n` is not lowered yet over pages (it is over tokens and over the clusters of "
                   "a `kmeans` partition)")
    if select.top is not None and select.top.granularity not in READ_GRANULARITIES:
        out.append(f"{select.top.granularity} reads are not lowered yet (per kv_head or one set per layer)")
    counts = [select.last, None if select.top is None else select.top.count, hook.where]
    if reads[0].item == "key" or clusters:  # a token read, a read over clusters: only its `where` is the batch's
        counts = [hook.where]
    for expr in counts:
        rows = names_in(expr) & ROW_SYMBOLS if expr is not None else set()
        if rows:
            out.append(f"a read's counts and `where` may not depend on {', '.join(sorted(rows))} yet (a read plan's "
                       "shape is fixed for the whole decode batch)")
    return out


def check(method: MethodIR) -> None:
    found = problems(method)
    if found:
        raise NotLowerable(found[0])
