"""Checking of hooks: which hook may read what, which verbs it may use, and its statements.

Pipeline position: `kvc.dsl.checker` calls `check_hook` for every `on NAME:` block after the
declarations are known. The hook table (`kvc.dsl.builtins.HOOKS`) says what each lifecycle point
provides: queries, keys/values, attention, the step counter, and the verbs `keep` / `read` /
`estimate` it may use.
"""

from __future__ import annotations

from dataclasses import replace

from kvc.dsl import ast
from kvc.dsl.builtins import HOOK_VALUES, HOOKS, SYMBOLS
from kvc.dsl.check_exprs import KIND_WORDS, Ctx, ExprChecker
from kvc.dsl.types import BOOL, UNKNOWN, Scalar, Selection, Tensor, Type

VERB_HOOKS = {verb: [h.name for h in HOOKS.values() if verb in h.verbs] for verb in ("keep", "read", "estimate")}


def hook_ctx(spec, counts: list) -> Ctx:
    symbols = {"context", "prompt", "layers", "heads", "kv_heads", "head_dim"}
    if spec.scope == "layer":
        symbols.add("layer")
    if spec.step:
        symbols.add("step")
    return Ctx(f"in {spec.name}", frozenset({"param", "let", "state", "shared", "input", "summary", "role"}),
               frozenset(symbols), spec, {}, counts=counts, calls=frozenset({"value", "scalar", "select"}))


def check_hook(xc: ExprChecker, hook: ast.Hook, counts: list, has_replay: bool) -> None:
    spec = HOOKS.get(hook.name.name)
    if spec is None:
        xc.error(hook.name, f"unknown hook '{hook.name.name}'", xc.suggest(hook.name.name, HOOKS)
                 or f"hooks are: {', '.join(HOOKS)}")
        return
    if spec.replay and not has_replay:
        xc.error(hook.name, f"{spec.name} needs a `replay` declaration",
                 'e.g. replay "Repeat the previous context:" in chunks of 2048')
    ctx = hook_ctx(spec, counts)
    if hook.where is not None:
        wctx = replace(ctx, kinds=frozenset({"param", "let"}), calls=frozenset({"scalar", "value"}),
                       where=f"in a `where` of {spec.name}")
        t = xc.check(hook.where, wctx)
        if t is not UNKNOWN and t != BOOL:
            xc.error(hook.where, f"`where` needs a condition (a bool), not {t}")
    for stmt in hook.body:
        check_stmt(xc, stmt, ctx)


def check_stmt(xc: ExprChecker, stmt: ast.Stmt, ctx: Ctx) -> None:
    spec = ctx.hook
    if isinstance(stmt, (ast.Keep, ast.Read, ast.Estimate)):
        verb = type(stmt).__name__.lower()
        if verb not in spec.verbs:
            allowed = VERB_HOOKS[verb]
            xc.error(stmt, f"`{verb}` cannot be used in {spec.name}", f"`{verb}` belongs in {' or '.join(allowed)}"
                     if allowed else None)
        t = xc.check(stmt.selection, ctx)
        check_selection(xc, stmt, t, ctx, verb)
        if isinstance(stmt, ast.Keep) and stmt.role is not None:
            check_role_use(xc, stmt.role)
        if isinstance(stmt, ast.Estimate):
            item = t.item if isinstance(t, Selection) else None
            for arg, what in ((stmt.keys, "keys"), (stmt.values, "values")):
                at = xc.check(arg, ctx)
                if isinstance(at, Tensor) and (item not in at.dims or "channel" not in at.dims):
                    xc.error(arg, f"the {what} of an estimate are one vector per {item or 'item'}, got {at}")
        return
    target = stmt.target
    name = target.name.name
    value_t = xc.check(stmt.value, ctx)
    if name in ctx.locals:
        if isinstance(stmt, ast.Accumulate):
            xc.error(target.name, f"'{name}' is a value of this hook, not a state",
                     f"declare `state {name}: [...]` to accumulate across steps")
        else:
            xc.error(target.name, f"'{name}' is already defined at line {ctx.locals[name][1].line}",
                     "a hook value is defined once; pick another name")
        return
    b = xc.bindings.get(name)
    if b is not None and b.kind in ("state", "shared"):
        target_t = xc.view(b, ctx)
        if target.index is not None:
            it = xc.check(target.index, ctx)
            if it is not UNKNOWN and not (isinstance(it, Scalar) and it.kind == "int"):
                xc.error(target.index, f"an index must be a whole number (a layer), not {it}")
            if isinstance(target_t, Tensor) and "layer" in target_t.dims:
                target_t = target_t.reshaped(d for d in target_t.dims if d != "layer")
            elif isinstance(target_t, Selection) and "layer" in target_t.per:
                target_t = replace(target_t, per=tuple(d for d in target_t.per if d != "layer"))
            else:
                xc.error(target, f"'{name}' has no layer axis to index")
                return
        elif isinstance(target_t, Tensor) and "layer" in target_t.dims and spec.scope == "layer":
            xc.error(target, f"'{name}' has a layer axis; in {spec.name} write {name}[layer]")
            return
        if value_t is UNKNOWN:
            return
        if isinstance(stmt, ast.Accumulate):
            if not isinstance(target_t, Tensor):
                xc.error(target, f"only tensor states accumulate with +=, and '{name}' is {target_t}")
            elif isinstance(value_t, Tensor):
                if set(value_t.dims) != set(target_t.dims):
                    xc.error(stmt.value, f"cannot add {value_t} into '{name}': {target_t}",
                             _reduce_hint(value_t, target_t))
                elif value_t.ranges:
                    axis = value_t.ranges[0][0]
                    xc.error(stmt.value, f"cannot add {value_t} into '{name}': {target_t} holds every entry of "
                                         f"the {axis} axis, this only a range of them")
            elif not (isinstance(value_t, Scalar) and value_t.numeric):
                xc.error(stmt.value, f"cannot add {value_t} into '{name}': {target_t}")
            return
        if not _assignable(value_t, target_t):
            xc.error(stmt.value, f"'{name}' is {target_t}, but this is {value_t}", _reduce_hint(value_t, target_t))
        return
    if b is not None:
        xc.error(target.name, f"cannot assign to the {KIND_WORDS[b.kind]} '{name}'",
                 "only states change; hook values need a new name")
        return
    if name in HOOK_VALUES or name in SYMBOLS or name in xc.axes:
        xc.error(target.name, f"'{name}' is built in; pick another name")
        return
    if isinstance(stmt, ast.Accumulate):
        xc.error(target.name, f"'{name}' is not a state", f"declare `state {name}: [...]` to accumulate across steps")
        return
    if target.index is not None:
        xc.error(target.index, "only states with a layer axis are indexed")
        return
    ctx.locals[name] = (value_t, target.name.pos)


def _assignable(value: Type, target: Type) -> bool:
    if isinstance(value, Tensor) and isinstance(target, Tensor):
        return set(value.dims) == set(target.dims) and not value.ranges
    if isinstance(value, Selection) and isinstance(target, Selection):
        return value.item == target.item and set(value.per) <= set(target.per) and value.across == target.across
    if isinstance(value, Scalar) and isinstance(target, Tensor):
        return value.numeric
    return value == target


def _reduce_hint(value: Type, target: Type) -> str | None:
    if isinstance(value, Tensor) and isinstance(target, Tensor):
        extra = [d for d in value.dims if d not in target.dims]
        if "head" in extra and "kv_head" in target.dims:
            return "fold query heads first: mean(x, over group)"
        if extra:
            return f"reduce it first, e.g. sum(x, over {', '.join(extra)})"
    return None


def check_selection(xc: ExprChecker, stmt: ast.Stmt, t: Type, ctx: Ctx, verb: str) -> None:
    if t is UNKNOWN:
        return
    if not isinstance(t, Selection):
        xc.error(stmt.selection, f"`{verb}` needs a selection (top(...), first n, last n), not {t}")
        return
    if verb == "read":
        allowed = {"head", "kv_head"}
    elif ctx.hook.scope == "request":
        allowed = {"layer", "kv_head"}
    else:
        allowed = {"kv_head"}
    bad = [d for d in t.dims if d not in allowed]
    if bad:
        if bad[0] == "head":
            xc.error(stmt.selection, f"`{verb}` needs a selection per KV head (K/V are stored per KV head), "
                                     "got one per query head", "fold the score first: mean(score, over group)")
        else:
            xc.error(stmt.selection, f"`{verb}` cannot use a selection along {bad[0]} in {ctx.hook.name}")


def check_role_use(xc: ExprChecker, role: ast.Ident) -> None:
    b = xc.bindings.get(role.name)
    if b is None:
        if role.name not in xc.poisoned:
            xc.error(role, f"unknown role '{role.name}'",
                     xc.suggest(role.name, [n for n, x in xc.bindings.items() if x.kind == "role"]))
    elif b.kind != "role":
        xc.error(role, f"'{role.name}' is a {KIND_WORDS[b.kind]}, not a role",
                 "declare `role NAME = <mask over kv_head>`")
