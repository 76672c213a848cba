"""Budget pass: how many tokens a method keeps, and how many KV bytes a request holds.

Pipeline position: a pass over `MethodIR` (after `ir.build`, before `codegen`). It derives, in
sympy, from the `keep` that runs at prefill end:

- `kept`: tokens kept per KV head in one layer after prefill end, a function of `context` (the
  prompt), `layer`, `layers`, `kv_heads` and the parameters. Counts are floored and clamped as
  the language says (docs/language.md, Budgets); a head-adaptive budget is averaged over heads.
- `held`: an upper bound on the tokens the most-keeping KV head of a layer keeps, which is the
  layer's physical length (the engine stores per-head variable counts right-aligned in shared
  slots, docs/design.md). Equal to `kept` unless the selection is head-adaptive: there one head
  may take the whole layer's budget but the safeguard (`at_least`) of every other head.
- `kv_bytes`: KV bytes of a request after prefill end (the slots it holds: `held`), summed over
  layers, given the model shape (`layers`, `kv_heads`, `head_dim`, `dtype_bytes`): `token_bytes`
  a slot per KV head in `layer`, from the KV spec (K and V in the model dtype by default; codes,
  scales and page scales for a quantized spec, dense in the layers a `where` leaves out:
  `with_token_bytes`). Per-sequence windows are not counted.
- `peak_prefill_bytes`: the whole prompt is resident until prefill ends.
- `steady_bytes`: after `generated` decode tokens: methods that evict while decoding stay at
  their budget (evaluated at the grown context), the others grow by one token per step; a decode
  keep that a parameter switches (`where every > 0 and step % every == 0`) decides which, by it.

`emit_python` prints these as plain Python functions (the generated hook module's `budget`);
`lambdify` gives the same functions in-process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy as sp
from sympy.printing.pycode import PythonCodePrinter

from kvc.compiler.ir import Keep, MethodIR, Select

CONTEXT, LAYER, LAYERS, KV_HEADS, PROMPT = sp.symbols("context layer layers kv_heads prompt")
HEAD_DIM, DTYPE_BYTES, GENERATED = sp.symbols("head_dim dtype_bytes generated")
SHAPE_SYMBOLS = ("context", "layer", "layers", "kv_heads", "heads", "head_dim", "prompt")
DECODE_HOOKS = ("decode_after_attention", "step_end")


@dataclass(frozen=True)
class Budgets:
    kept: object  # sympy: tokens per KV head in one layer after prefill end (head-adaptive: average)
    evicts_while_decoding: bool
    params: tuple[str, ...]  # parameters the formulas use, sorted
    held: object = None  # sympy: bound on the most-keeping head's tokens (the layer's slots); None: kept
    token_bytes: object = 2 * HEAD_DIM * DTYPE_BYTES  # sympy: bytes a stored slot costs per KV head and layer
    # sympy condition on parameters under which the decode-time keeps run (each keep's `where` guard, `every >
    # 0`); None: they always run (or there are none)
    decode_switch: object = None

    def __post_init__(self) -> None:
        if self.held is None:
            object.__setattr__(self, "held", self.kept)

    def with_token_bytes(self, token_bytes) -> Budgets:
        """These budgets over a KV spec whose slot costs `token_bytes` (compiler/kv_spec.py
        `token_bytes`); the parameters it reads join `params`."""
        names = sorted(set(self.params) | {str(s) for s in sp.sympify(token_bytes).free_symbols}
                       - {"head_dim", "dtype_bytes", "layer", "kv_heads"})
        return replace(self, token_bytes=token_bytes, params=tuple(names))

    @property
    def kv_bytes(self):
        per_layer = KV_HEADS * self.token_bytes * self.held
        return sp.Sum(per_layer, (LAYER, 0, LAYERS - 1))

    @property
    def peak_prefill_bytes(self):
        if LAYER in sp.sympify(self.token_bytes).free_symbols:  # layers stored in several formats
            return sp.Sum(KV_HEADS * self.token_bytes * CONTEXT, (LAYER, 0, LAYERS - 1))
        return LAYERS * KV_HEADS * self.token_bytes * CONTEXT

    def formulas(self) -> dict[str, str]:
        return {"kept_tokens_per_layer": sp.sstr(self.kept), "held_tokens_per_layer": sp.sstr(self.held),
                "kv_bytes": sp.sstr(self.kv_bytes), "peak_prefill_bytes": sp.sstr(self.peak_prefill_bytes)}


def _count(expr) -> object:
    return sp.Max(0, sp.floor(expr))


def kept_by(select: Select):
    """Tokens per KV head a selection keeps, as sympy over `context` and the parameters."""
    ranges = sum((_count(c) for c in (select.first, select.last) if c is not None), sp.Integer(0))
    chosen = sp.Integer(0)
    if select.top is not None:
        chosen = _count(select.top.count)
        if select.top.granularity == "head_adaptive":
            chosen = chosen / KV_HEADS
        elif select.top.granularity == "global":
            chosen = chosen / (KV_HEADS * LAYERS)
    return sp.Min(CONTEXT, ranges + chosen)


def held_by(select: Select):
    """Tokens the most-keeping KV head of a layer may keep (an upper bound, as sympy).

    Head-adaptive: every head first takes its safeguard `a` = at_least, then the layer's other
    picks may all go to one head, which then holds max(a, count - (kv_heads - 1) * a) besides
    the ranges. Global (one top-k across layers): one head may take the whole count."""
    top = select.top
    if top is None or top.granularity not in ("head_adaptive", "global"):
        return kept_by(select)
    ranges = sum((_count(c) for c in (select.first, select.last) if c is not None), sp.Integer(0))
    count = _count(top.count)
    if top.granularity == "head_adaptive" and top.at_least is not None:
        floor_each = _count(top.at_least)
        count = sp.Max(floor_each, count - (KV_HEADS - 1) * floor_each)
    return sp.Min(CONTEXT, ranges + count)


def derive(method: MethodIR) -> Budgets:
    """The budget formulas of a method (every token for `full` and methods without a keep)."""
    keeps: list[Keep] = []
    end = method.hook("prefill_end") or method.hook("replay_end")  # the keep after the prompt is stored
    if end is not None:
        keeps = end.keeps
    kept = CONTEXT if not keeps else kept_by(keeps[-1].select)
    held = CONTEXT if not keeps else held_by(keeps[-1].select)
    kept, held = kept.subs(PROMPT, CONTEXT), held.subs(PROMPT, CONTEXT)
    decode_keeps = [h for h in method.hooks if h.name in DECODE_HOOKS and h.keeps]
    guards = [h.period[1] if h.period is not None else [] for h in decode_keeps]
    switch = sp.Or(*[sp.And(*g) for g in guards]) if decode_keeps and all(guards) else None
    symbols = kept.free_symbols | held.free_symbols | (switch.free_symbols if switch is not None else set())
    names = sorted(str(s) for s in symbols if str(s) not in SHAPE_SYMBOLS)
    return Budgets(kept, bool(decode_keeps), tuple(names), held, decode_switch=switch)


class _Printer(PythonCodePrinter):
    """Python code of a budget formula; `in_layers(layer, P)` (compiler/kv_spec.py) calls the generated
    module's function of that name."""

    def _print_Function(self, expr) -> str:  # sympy prints an undefined function's call here
        if expr.func.__name__ == "in_layers":
            return f"in_layers({', '.join(self._print(a) for a in expr.args)})"
        return super()._print_Function(expr)


def _pycode(expr) -> str:
    return _Printer({"fully_qualified_modules": True}).doprint(expr).replace("math.floor", "_floor")


def emit_python(budgets: Budgets) -> str:
    """Python source of `kept_tokens`, `held_tokens`, `kv_bytes`, `peak_prefill_bytes`,
    `steady_bytes`."""
    def unpack(expr) -> str:
        used = {str(s) for s in expr.free_symbols}
        return "".join(f'    {p} = params["{p}"]\n' for p in budgets.params if p in used)

    kept_src, held_src, slot_src = _pycode(budgets.kept), _pycode(budgets.held), _pycode(budgets.token_bytes)
    grow = "0" if budgets.evicts_while_decoding else "generated"
    at = "prompt + generated" if budgets.evicts_while_decoding else "prompt"
    switch = ""
    if budgets.decode_switch is not None:  # a decode keep a parameter switches: grow where it is off
        switch = (f"{unpack(budgets.decode_switch)}    decoding = {_pycode(budgets.decode_switch)}\n"
                  "    at, grow = (prompt + generated, 0) if decoding else (prompt, generated)\n")
        at, grow = "at", "grow"
    return (
        "def _floor(x):\n"
        "    return math.floor(x)\n\n\n"
        "def in_layers(layer, layers):\n"
        '    """1 where `layer` is in the list parameter `layers` (a store\'s `where layer in P`), else 0."""\n'
        "    return int(layer in layers)\n\n\n"
        "def kept_tokens(context, layer, layers, kv_heads, params):\n"
        '    """Tokens kept per KV head of `layer` after prefill end of a `context`-token prompt."""\n'
        f"{unpack(budgets.kept)}"
        f"    return int({kept_src})\n\n\n"
        "def held_tokens(context, layer, layers, kv_heads, params):\n"
        '    """At most this many tokens kept by the most-keeping KV head of `layer`: the slots the layer holds."""\n'
        f"{unpack(budgets.held)}"
        f"    return int({held_src})\n\n\n"
        "def slot_bytes(layer, *, kv_heads, head_dim, dtype_bytes, params):\n"
        '    """Bytes a stored slot costs per KV head in `layer` (the KV spec\'s per-token and per-page tensors)."""\n'
        f"{unpack(budgets.token_bytes)}"
        f"    return {slot_src}\n\n\n"
        "def kv_bytes(context, *, layers, kv_heads, head_dim, dtype_bytes, params):\n"
        '    """KV bytes of one request after prefill end (the slots it holds), summed over layers."""\n'
        "    shape = dict(kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, params=params)\n"
        "    return kv_heads * sum(held_tokens(context, layer, layers, kv_heads, params) * slot_bytes(layer, **shape)\n"
        "                          for layer in range(layers))\n\n\n"
        "def peak_prefill_bytes(context, *, layers, kv_heads, head_dim, dtype_bytes, params):\n"
        '    """KV bytes while the prompt is prefilled (all of it resident until prefill end)."""\n'
        "    shape = dict(kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, params=params)\n"
        "    return kv_heads * context * sum(slot_bytes(layer, **shape) for layer in range(layers))\n\n\n"
        "def steady_bytes(prompt, generated, *, layers, kv_heads, head_dim, dtype_bytes, params):\n"
        '    """KV bytes after `generated` decode steps."""\n'
        "    shape = dict(kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, params=params)\n"
        f"{switch}"
        f"    return kv_heads * sum((held_tokens({at}, layer, layers, kv_heads, params) + {grow})\n"
        "                          * slot_bytes(layer, **shape) for layer in range(layers))\n"
    )


def lambdify(budgets: Budgets):
    """`kept_tokens(context, layer, layers, kv_heads, params)` as an in-process function."""
    namespace: dict[str, object] = {}
    exec("import math\n" + emit_python(budgets), namespace)  # the same source the hook module gets
    return namespace["kept_tokens"]
