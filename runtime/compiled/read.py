"""A compiled method's `decode_before_attention` that reads: the generated hook over a whole decode
batch, answered as a `ReadPlan` (docs/design.md, "Plans": how a `read` lowers).

The manifest's hook fact `reads` says the hook has one; its lowering (`<hook>` in torch_lowering.py)
takes the step's queries, each page summary it names gathered by the rows' page tables (`[B, Hkv,
pages, D]`, page-table order, so a page's index in the plan is its column), and the rows' stored
lengths, and gives page indices `[B, Hkv, n]` (-1: none) or None (the layer reads every page).
Where the compiler fused the page scores (kernel family `page_scores`, compiler/fusion.py), a GPU
step scores the pages straight from the store through the page tables instead, and builds the plan
with the Triton top-k (runtime/primitives/triton_plans.py). Tensors of static shape only and no
host reads: the same call runs in eager steps and in captured decode graphs. Nothing here knows a method by name.

A hook of token plans (hook fact `tokens`: it chooses a shared selection, `chosen = top(...)`, or
reads one, `read chosen + last n`) gets the step's queries, the rows' stored keys `k [B, Hkv, W, D]`
(gathered through the page tables, the step's own key at its slot), the per-row symbols `context`,
`prompt` and `step` as float64 [B] tensors, and `shared`: the selections chosen by earlier layers
of the same step (a choice made at layer l is read by the layers after it; the next step's
forward chooses again before any layer reads). It answers None or `(tokens, last)`, a token
`ReadPlan` with each row's `last` newest tokens.

A hook that reads the clusters of a `kmeans` partition (hook fact `clusters`) gets the step's
queries and the rows' cluster indices (cluster_index.py: static per-row buffers, written between
steps) with the per-row symbols, and answers `(tokens, last, estimate, counts)`: a token `ReadPlan`
whose slots come first in each head's list (`counts` of them), its `Estimate` the estimated clusters'
pseudo-keys. Where the compiler fused the cluster scores (`cluster_scores`, family `page_scores`), a
GPU step scores the clusters from the index's rows and the read, the plan and the estimate index the
rows too: no copy of the rows' indices. Static shapes too: graphs capture it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvc.runtime.compiled.cluster_index import ClusterIndices
from kvc.runtime.compiled.folder import GeneratedCode
from kvc.runtime.errors import ConfigError
from kvc.runtime.method_api import DecodeView, Estimate, ReadPlan

READ_HOOK = "decode_before_attention"
ENGINE_INPUTS = {"q"}  # what the engine hands a read hook beside the summaries
TOKEN_INPUTS = {"q", "k"}  # a hook of token plans also gets the rows' stored keys


def _gpu_read_pages() -> Callable:
    from kvc.runtime.primitives.triton_plans import read_pages  # imports triton: only on a fused device

    return read_pages


class ReadHook:
    """The generated read of `code` (None-safe: `of` gives None for a method that does not read)."""

    def __init__(self, name: str, fn: Callable, inputs: list[str], summaries: set[str],
                 lowering: Any = None, fused: Callable[[], Callable | None] | None = None,
                 tokens: bool = False, clusters: dict | None = None, why: str | None = None) -> None:
        """`why`: what the compiler said of the method's KV spec (a summary it could not store, ...)."""
        self.name, self.fn, self.tokens = name, fn, tokens
        self.indices: ClusterIndices | None = None  # the sequences' cluster indices (a read over clusters)
        if clusters is not None:
            partition = clusters["partition"]
            self.indices = ClusterIndices(partition, _bound(lowering, f"{partition}_segment"), clusters["summaries"],
                                          _bound(lowering, f"{partition}_size"),
                                          _bound(lowering, f"{partition}_segment_length"),
                                          _bound(lowering, f"{READ_HOOK}_ranges"))
            summaries = summaries | set(clusters["summaries"])
        self.inputs = set(inputs)
        self.shared: dict[str, torch.Tensor] = {}  # the selections chosen so far in this step, by name
        self._symbols: tuple | None = None  # (layer, context_lens, prompt_lens, the per-row symbols): this step's
        self._fused = fused  # gives the fused page scores (imports triton; first used on a GPU step)
        self.runs = getattr(lowering, f"{READ_HOOK}_runs", None)
        self.read = getattr(lowering, f"{READ_HOOK}_read", None)
        self.summaries = [n for n in inputs if n in summaries]
        unknown = set(inputs) - (TOKEN_INPUTS if tokens else ENGINE_INPUTS) - set(self.summaries)
        if unknown:
            raise ConfigError(f"method {name!r}: decode_before_attention reading {', '.join(sorted(unknown))} is not "
                              "served yet (a page read gets q and the page summaries, a token read q and the stored "
                              "keys)" + (f"; the compiler's KV spec: {why}" if why else ""), param="method")

    @classmethod
    def of(cls, code: GeneratedCode) -> ReadHook | None:
        facts = code.facts.get(READ_HOOK)
        if facts is None or not (facts.get("reads") or facts.get("tokens")):
            return None
        kv_spec = code.manifest.get("kv_spec", {})
        summaries = {s["tensor"] for s in kv_spec.get("summaries", [])}
        fused = (lambda: code.fused(READ_HOOK)) if READ_HOOK in code.fused_names else None
        return cls(code.name, code.required(READ_HOOK), facts["inputs"], summaries, code.lowering, fused,
                   bool(facts.get("tokens")), facts.get("clusters"), kv_spec.get("reason"))

    def plan(self, layer: int, num_layers: int, view: DecodeView, params: dict[str, Any],
             fused_devices: tuple[str, ...] = ()) -> ReadPlan | None:
        sym = {"context": None, "prompt": None, "step": None, "layer": layer, "layers": num_layers,
               "heads": view.q.shape[1], "kv_heads": view.k.shape[1], "head_dim": view.q.shape[2]}
        if self.tokens or self.indices is not None:
            if self.runs is not None and not self.runs(sym, params):
                return None  # no rule runs in this layer: no keys gathered, no index built
            self._row_symbols(layer, view, sym)
            if self.tokens:
                return self._token_plan(view, sym, params)
            return self._cluster_plan(layer, view, sym, params, self._fused is not None
                                      and view.q.device.type in fused_devices)
        if self._fused is not None and view.q.device.type in fused_devices and self.runs is not None:
            if not self.runs(sym, params):
                return None
            summaries = {name: view.store[name] for name in self.summaries}
            scores = self._fused()(view.q, summaries, view.block_tables, view.context_lens, view.store.page_size)
            pages = self.read(scores, view.context_lens, sym, params, read_pages=_gpu_read_pages())
            return None if pages is None else ReadPlan(pages=pages)
        tables = view.block_tables.long()  # [B, W]
        inputs: dict[str, torch.Tensor] = {"q": view.q, "lengths": view.context_lens}
        for name in self.summaries:  # [pages + 1, Hkv, D] -> the rows' pages [B, Hkv, W, D]
            inputs[name] = view.store[name][tables].transpose(1, 2)
        pages = self.fn(inputs, {}, sym, params)
        return None if pages is None else ReadPlan(pages=pages)

    def _cluster_plan(self, layer: int, view: DecodeView, sym: dict[str, Any], params: dict[str, Any],
                      fused: bool) -> ReadPlan | None:
        """A read over the rows' cluster indices (module docstring); `fused`: the scores from the compiler's
        `cluster_scores` kernel and every kernel after it reading the index through the rows (no gather)."""
        inputs = self.indices.inputs(layer, view, params, gather=not fused)
        inputs["q"] = view.q
        if fused:
            summaries = {name: inputs[name] for name in self.indices.summaries}
            out = self.read(self._fused()(view.q, summaries, inputs["rows"]), inputs, sym, params)
        else:
            out = self.fn(inputs, {}, sym, params)
        if out is None:
            return None
        tokens, last_slots, estimate, counts = out
        bound = self.indices.last_bound(sym, params)
        if bound is not None and view.rows is not None and int(last_slots.max()) > bound:  # eager steps check it
            raise RuntimeError(f"method {self.name!r}: a row reads {int(last_slots.max())} newest slots past its "
                               f"cluster index, more than the bound {bound}")
        return ReadPlan(tokens=tokens, last=last_slots, estimate=None if estimate is None else Estimate(*estimate),
                        last_bound=bound, counts=counts)

    def _row_symbols(self, layer: int, view: DecodeView, sym: dict[str, Any]) -> None:
        """The per-row symbols `context`, `prompt` and `step` (float64 [B]) of a token or cluster read: computed
        once a step, by its first reading layer, and reused by the later layers of the step (the same length
        tensors, a higher layer), so a step does not convert them in every layer."""
        if view.prompt_lens is None:
            raise ConfigError(f"method {self.name!r}: its decode hook reads each row's prompt length, which this "
                              "step's metadata lacks", param="method")
        cached = self._symbols
        if not (cached is not None and cached[0] < layer and cached[1] is view.context_lens
                and cached[2] is view.prompt_lens):
            context = view.context_lens.to(torch.float64)
            prompt = view.prompt_lens.to(torch.float64)
            cached = (layer, view.context_lens, view.prompt_lens, {"context": context, "prompt": prompt,
                                                                    "step": context - prompt})
        self._symbols = (layer, *cached[1:])
        sym.update(cached[3])

    def _token_plan(self, view: DecodeView, sym: dict[str, Any], params: dict[str, Any]) -> ReadPlan | None:
        """A hook of token plans over the batch (module docstring)."""
        inputs = _TokenInputs(view)  # the stored keys are gathered only by a layer that reads them
        out = self.fn(inputs, self.shared, sym, params)
        if out is None:
            return None
        tokens, last = out
        return ReadPlan(tokens=tokens, last=last)


def _bound(lowering: Any, name: str) -> Callable:
    fn = getattr(lowering, name, None)
    if fn is None:
        raise ConfigError(f"the generated lowering lacks {name}; run `kvc compile`", param="method")
    return fn


class _TokenInputs(dict):
    """A token hook's inputs: `q` and `lengths`, and `k` (`_stored_keys`, a copy of every row's keys)
    gathered on first use: a layer that only reads a choice made earlier never pays for it."""

    def __init__(self, view: DecodeView) -> None:
        super().__init__(q=view.q, lengths=view.context_lens)
        self.view = view

    def __missing__(self, name: str) -> torch.Tensor:
        if name != "k":
            raise KeyError(name)
        self["k"] = keys = _stored_keys(self.view)
        return keys


def _stored_keys(view: DecodeView) -> torch.Tensor:
    """Each row's keys [B, Hkv, W, D] through its page table (W: the slots of the pages that
    `view.max_context_len` needs, else of the whole table), the step's own key (not stored yet:
    attention writes it) at its slot `context_lens - 1`."""
    try:
        cache = view.store.k_cache  # [pages + 1, Hkv, S, D]
    except TypeError as e:
        raise ConfigError(f"a decode hook that reads the stored keys needs them dense ({e})", param="method") from None
    tables = view.block_tables.long()  # [B, P]
    if view.max_context_len is not None:
        tables = tables[:, :max(1, -(-view.max_context_len // cache.shape[2]))]
    batch, pages = tables.shape
    keys = cache[tables].permute(0, 2, 1, 3, 4).reshape(batch, cache.shape[1], pages * cache.shape[2], cache.shape[3])
    slot = (view.context_lens.long() - 1).clamp(min=0)  # padding rows (length 0) write a slot nobody reads
    keys[torch.arange(batch, device=keys.device), :, slot] = view.k.to(keys.dtype)
    return keys
