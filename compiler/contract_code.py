"""Contract code: the plain functions of a generated hooks.py that give the engine a method's numbers.

Pipeline position: `codegen` calls it after `fusion` and `lower_torch`, and renders the source into
templates/hooks.py.jinja beside the budget functions (`budgets.emit_python`) and `kv_spec`
(`kv_spec.emit_python`). The engine calls these functions and evaluates no text at run time; the
manifest keeps the same expressions as text for readers (the kernels' `WINDOW_EXPR`, the hook fact
`last`):

- `query_window(params)`: how many trailing prompt queries `prefill_end` reads, the largest `q[last n]`
  of its fused kernels (0: none; None: every query), which the engine keeps per sequence and layer
  while the prompt is prefilled (runtime/methods_compiled.py `_query_window`);
- `decode_query_window(params)`: how many of the newest queries `step_end` reads, the largest `q[last n]` of
  its body (0: none), which the engine keeps per sequence and layer while decoding (runtime/kv/query_window.py);
- `KEEP_PERIODS`: for each keeping hook whose `where` is `step % n == 0` (n of the parameters), n: the engine's
  decode bound of such a keep (runtime/compiled/step_end.py `decode_bound`). A `where` may add conditions on
  parameters alone (`every > 0 and step % every == 0`): where they fail the period is 0, the keep never runs
  (the engine serves the method as if it had none: a decode-time budget that is a method parameter), and
  `decode_query_window` is 0 too;
- `<hook>_tail(sym, params)` for each keeping hook with a `+ last N`, collected in `KEEP_TAILS`: that
  N from the hook's symbols and the parameters, unclamped (`CompiledMethod.kept_tail` clamps it);
- `replay(params)`: a `replay` declaration's prompts and counts (chunk, overlap, sink: parameters only),
  None without one (runtime/context_replay.py builds the pass from it).
"""

from __future__ import annotations

import ast as pyast
import dataclasses

import sympy as sp

from kvc.compiler.fusion import FusionPlan
from kvc.compiler.ir import Input, MethodIR, NotLowerable, Window
from kvc.compiler.lower_torch import SYMBOLS

_HELPERS = {"_floor": sp.floor, "_ceil": sp.ceiling}  # the names `lower_torch.pyexpr` prints


def _py(expr) -> str:
    return sp.pycode(sp.sympify(expr), fully_qualified_modules=True)


def _unpack(expr, params: list[str], what: str, allowed: tuple[str, ...] = SYMBOLS) -> list[str]:
    lines = []
    for name in sorted(str(s) for s in sp.sympify(expr).free_symbols):
        if name in allowed:
            lines.append(f'    {name} = sym["{name}"]')
        elif name in params:
            lines.append(f'    {name} = params["{name}"]')
        else:
            may = "parameters and the hook's symbols" if allowed else "parameters (the engine sizes it once)"
            raise NotLowerable(f"{what} reads '{name}'; it may depend on {may} only")
    return lines


def _window(text: str):
    """A kernel's WINDOW_EXPR (printed by `lower_torch.pyexpr`) back as sympy; None for every query."""
    if text == "None":
        return None
    names = {n.id for n in pyast.walk(pyast.parse(text, mode="eval")) if isinstance(n, pyast.Name)}
    local = {n: sp.Symbol(n) for n in names - set(_HELPERS)}
    return sp.sympify(text, locals={**local, **_HELPERS})


def query_window_source(plan: FusionPlan, params: list[str]) -> str:
    windows = [_window(str(k.flag.get("WINDOW_EXPR", "None"))) for k in plan.kernels if k.hook == "prefill_end"]
    doc = ('    """How many trailing prompt queries prefill_end reads: the largest `q[last n]` of its fused kernels\n'
           '    (0: none; None: every query)."""')
    head = ["def query_window(params):", doc]
    if any(w is None for w in windows):
        return "\n".join(head + ["    return None"]) + "\n"
    unpack: list[str] = []
    for w in windows:
        unpack += [line for line in _unpack(w, params, "a query window `q[last n]`", allowed=())
                   if line not in unpack]
    if all(w.is_Integer for w in windows):
        return "\n".join(head + [f"    return {max([0] + [int(w) for w in windows])}"]) + "\n"
    value = ", ".join(["0"] + [f"int({_py(w)})" for w in windows])
    return "\n".join(head + unpack + [f"    return max({value})"]) + "\n"


def _queries(node, windows: list, bare: list, windowed: bool = False) -> None:
    """Under `node` (IR values and statements, walked by their fields): the count n of every `q[last n]` into
    `windows`, every read of `q` that no such window takes into `bare`."""
    if isinstance(node, Input) and node.name == "q" and not windowed:
        bare.append(node)
    if isinstance(node, Window) and isinstance(node.src, Input) and node.src.name == "q" and node.axis == "query":
        if node.side != "last":
            raise NotLowerable("a decode hook reads the newest queries only (`q[last n]`)")
        windows.append(node.count)
        windowed = True
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            _queries(getattr(node, f.name), windows, bare, windowed)
    elif isinstance(node, (tuple, list)):
        for item in node:
            _queries(item, windows, bare, windowed)


def _guard_lines(guards: list, params: list[str], what: str) -> list[str]:
    """`if not (...): return 0` for a keep's parameter conditions (none: no lines); NotLowerable if they read
    anything but parameters."""
    if not guards:
        return []
    for g in guards:
        _unpack(g, params, what, allowed=())
    conds = [_py(g) for g in guards]  # sympy prints a relation in parentheses
    test = conds[0] if len(conds) == 1 else f"({' and '.join(conds)})"
    return [f"    if not {test}:", "        return 0"]


def decode_query_window_source(method: MethodIR, params: list[str]) -> str:
    hook = method.hook("step_end")
    windows: list = []
    bare: list = []
    if hook is not None:
        _queries(hook.stmts, windows, bare)
    found = hook.period if hook is not None else None
    guards = found[1] if found and windows else []
    try:
        guard = _guard_lines(guards, params, "step_end's switch")
    except NotLowerable:  # a switch reading model symbols: the windows are always kept
        guards, guard = [], []
    if bare:
        raise NotLowerable("step_end reads the queries as `q[last n]` only (the newest decode queries)")
    counts = list(dict.fromkeys(windows))  # a value two statements share is walked twice
    doc = ('    """How many of the newest queries step_end reads: the largest `q[last n]` of its body (0: none),\n'
           '    kept per sequence and layer while decoding."""')
    head = ["def decode_query_window(params):", doc]
    unpack: list[str] = []
    for expr in counts + guards:
        unpack += [line for line in _unpack(expr, params, "step_end's `q[last n]`", allowed=()) if line not in unpack]
    if all(sp.sympify(n).is_Integer for n in counts):
        return "\n".join(head + unpack + guard + [f"    return {max([0] + [int(n) for n in counts])}"]) + "\n"
    value = ", ".join(["0"] + [f"int({_py(n)})" for n in counts])
    return "\n".join(head + unpack + guard + [f"    return max({value})"]) + "\n"


def keep_periods_source(method: MethodIR, params: list[str]) -> str:
    functions, entries = [], []
    for hook in method.hooks:
        found = hook.period if hook.keeps else None
        if found is None:
            continue
        period, guards = found
        try:
            what = f"the period of {hook.name}'s keep"
            guard = _guard_lines(guards, params, what)
            unpack: list[str] = []
            for expr in [period, *guards]:
                unpack += [line for line in _unpack(expr, params, what, allowed=()) if line not in unpack]
        except NotLowerable:  # a period of model symbols: no decode bound (the engine counts every token)
            continue
        doc = (f'    """The steps between `on {hook.name}`\'s keeps ({method.path}:{hook.line}: '
               '`where step % n == 0`; 0: it never runs)."""')
        functions.append("\n".join([f"def {hook.name}_period(params):", doc] + unpack + guard
                                    + [f"    return {_py(period)}"]))
        entries.append(f'"{hook.name}": {hook.name}_period')
    table = "KEEP_PERIODS = {" + ", ".join(entries) + "}  # keeping hook with `where step % n == 0` -> n"
    return "\n\n\n".join(functions + [table]) + "\n"


def replay_source(method: MethodIR, params: list[str]) -> str:
    replay = method.replay
    head = ["def replay(params):",
            '    """The `replay` pass: its prompts and token counts under these parameters (None: none)."""']
    if replay is None:
        return "\n".join(head + ["    return None"]) + "\n"
    counts = {"chunk": replay.chunk, "overlap": replay.overlap, "sink": replay.sink}
    unpack: list[str] = []
    for name, expr in counts.items():
        unpack += [line for line in _unpack(expr, params, f"the replay {name}", allowed=()) if line not in unpack]
    fields = [f'"prompt": {replay.prompt!r}', f'"then": {replay.then!r}'] + [
        f'"{name}": max(0, math.floor({_py(expr)}))' for name, expr in counts.items()]
    return "\n".join(head + unpack + ["    return {" + ", ".join(fields) + "}"]) + "\n"


def keep_tails_source(method: MethodIR, params: list[str]) -> str:
    functions, entries = [], []
    for hook in method.hooks:
        keeps = hook.keeps
        if not keeps or keeps[-1].select.last is None:
            continue
        last = keeps[-1].select.last
        doc = (f'    """The `+ last N` of `on {hook.name}`\'s keep ({method.path}:{hook.line}): the newest stored '
               'tokens it always keeps."""')
        unpack = _unpack(last, params, f"the `+ last` of {hook.name}'s keep")
        functions.append("\n".join([f"def {hook.name}_tail(sym, params):", doc] + unpack + [f"    return {_py(last)}"]))
        entries.append(f'"{hook.name}": {hook.name}_tail')
    table = "KEEP_TAILS = {" + ", ".join(entries) + "}  # keeping hook -> its `+ last N` (none: 0)"
    return "\n\n\n".join(functions + [table]) + "\n"
