"""Per-head keeps of a compiled method: `keep first a + last b for ROLE` (DuoAttention's streaming heads).

docs/design.md, "Per-head keeps (roles)", is the design. A method declares input tensors loaded from
files (`input gate: [layer, kv_head] from "FILE"`; runtime/models/method_inputs.py finds them) and
roles, bool masks over (layer, kv_head) computed from inputs and parameters by the generated
`roles(inputs, params)` once the engine binds the model. A keep `for ROLE` in prefill_chunk or
step_end gives a `KeepPlan` in which the role's heads keep the ranges of their own stored tokens and
every other head keeps all of its tokens. On a model layer's shared pages these are per-head
variable counts, stored right-aligned with per-head start slots (the Ada-KV layout); a method whose
every keep is such a keep stores each KV head as a cache layer of its own (runtime/kv/layout.py), so
a cache layer is one head, and a streaming head's pages are freed. Nothing here knows a method by
name: inputs, roles and keeps come from the manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from kvc.runtime.compiled.folder import GeneratedCode
from kvc.runtime.compiled.inputs import digest, load_declared
from kvc.runtime.kv.plans import keep_plan_if_due
from kvc.runtime.method_api import KeepPlan, LayerCacheView

ROLE_HOOKS = ("prefill_chunk", "step_end")


class RoleKeeps:
    """A method's inputs, role masks and its `keep ... for ROLE` hooks (None from `of` without any)."""

    def __init__(self, name: str, code: GeneratedCode, params: dict[str, Any]) -> None:
        self.name, self.code, self.params = name, code, params
        self.declared: dict[str, dict] = dict(getattr(code.lowering, "INPUTS", {}))
        self.roles_fn: Callable = code.required("roles")
        self.keeps = {hook: facts["role"] for hook, facts in code.facts.items()
                      if facts.get("keeps") and facts.get("role") and hook in ROLE_HOOKS}
        self.selects = {hook: code.required(f"{hook}_select") for hook in self.keeps}
        self.given: dict[str, torch.Tensor] = {}  # inputs set before bind (tests, the calibrator)
        self.masks: dict[str, list[list[bool]]] | None = None  # role -> [layer][kv_head]
        self._layer_masks: dict[str, list[list[bool]]] | None = None  # role -> [cache layer][its KV heads]
        self.digest = ""
        self._static: dict[tuple[str, int], int | None] = {}  # (hook, layer) -> static_count

    @classmethod
    def of(cls, name: str, code: GeneratedCode, params: dict[str, Any]) -> RoleKeeps | None:
        if not any(facts.get("role") for facts in code.facts.values()):
            return None
        return cls(name, code, params)

    def bind(self, num_layers: int, num_kv_heads: int, model_dir: Path | None, per_head: bool = False) -> None:
        """Loads every input (given ones first, else the model directory or the shipped defaults),
        checks its shape against the model and computes the role masks; `per_head`: the hooks'
        layers are cache layers of one KV head (model layer l's head h is l * num_kv_heads + h)."""
        sizes = {"layer": num_layers, "kv_head": num_kv_heads}
        inputs = {name: load_declared(self.name, name, decl, model_dir, tuple(sizes.get(d, -1) for d in decl["dims"]),
                                      self.given)
                  for name, decl in sorted(self.declared.items()) if set(decl["dims"]) <= set(sizes)}
        masks = self.roles_fn(inputs, self.params)
        self.masks = {role: mask.expand(num_layers, num_kv_heads).tolist() for role, mask in masks.items()}
        self._layer_masks = ({role: [[head] for heads in mask for head in heads] for role, mask in self.masks.items()}
                             if per_head else self.masks)
        self.digest = digest(inputs)

    def heads(self, hook: str, layer: int) -> list[bool]:
        """Which KV heads of (cache) layer `layer` the keep of `hook` applies to."""
        if self._layer_masks is None:
            raise RuntimeError(f"method {self.name!r}: roles are computed when the engine binds the model")
        return self._layer_masks[self.keeps[hook]][layer]

    def kept(self, hook: str, layer: int, sym: dict, starts: list[int] | None) -> list[torch.Tensor]:
        """The generated selection of `hook` over the layer's stored tokens (CPU index tensors)."""
        return self.selects[hook](torch.empty(0), sym, self.params, self.heads(hook, layer), starts)

    def count(self, hook: str, layer: int, sym: dict) -> int:
        """Tokens the keep of `hook` leaves in `layer`'s most-keeping head, every head starting at
        slot 0 (a cache layer of one KV head: that head's count); min(n, a + b) for a static count."""
        cap = self.static_count(hook, layer)
        if cap is not None:
            return min(int(sym["context"]), cap)
        return self._count(hook, layer, sym)

    def _count(self, hook: str, layer: int, sym: dict) -> int:
        return max(int(t.numel()) for t in self.kept(hook, layer, sym, None))

    def static_count(self, hook: str, layer: int) -> int | None:
        """The most tokens the keep of `hook` leaves in `layer`'s most-keeping head when that does
        not depend on the row (`first a + last b`: a + b; a row storing n keeps min(n, a + b)),
        else None. Found once per (hook, layer): the count at two long lengths, equal."""
        key = (hook, layer)
        if key not in self._static:
            layers, kv_heads = len(self._layer_masks[self.keeps[hook]]), len(self.heads(hook, layer))
            counts = {self._count(hook, layer, {"context": n, "prompt": n, "step": 0, "layer": layer, "layers": layers,
                                               "heads": None, "kv_heads": kv_heads, "head_dim": None})
                      for n in (1 << 20, 1 << 21)}
            self._static[key] = counts.pop() if len(counts) == 1 else None
        return self._static[key]

    def plan(self, hook: str, layer: int, sym: dict, cache: LayerCacheView, tail: int,
             interval: int = 1) -> KeepPlan | None:
        """The keep plan of `hook` for one sequence's layer, or None when no head would drop
        `interval` tokens (no head of the role, or every one within its ranges). Per-head counts
        stay a CPU tensor (host facts: the engine reads no device value)."""
        kept = self.kept(hook, layer, sym, cache.starts)
        return keep_plan_if_due(kept, cache.length, cache.starts, interval, cache.device, tail)
