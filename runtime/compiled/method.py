"""`CompiledMethod`: the one generic adapter that serves every compiled method through the
lifecycle contract (runtime/method_api.py; docs/design.md, "The lifecycle contract", "Compiled
methods" and "Decode-time eviction").

It composes the package's parts: the generated code (folder.py), the budget (budget.py), the
per-(sequence, layer) state (state.py), the decode facts and hook (decode.py), and takes the
prefill points (prefill.py) and step-end points (step_end.py) as its own methods. Nothing here
knows a method by name; a method with no hooks (`full`) gets an empty `hooks` set and keeps
every token (prefix caching stays on).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvc.runtime.compiled import folder as compiled_folder
from kvc.runtime.compiled.budget import CompiledBudget
from kvc.runtime.compiled.decode import DECODE_KEEP_HOOKS, DecodeHooks, decode_sym, read_decode_facts, without_idle_keep
from kvc.runtime.compiled.folder import ALL_QUERIES, GeneratedCode
from kvc.runtime.compiled.inputs import digest, load_declared
from kvc.runtime.compiled.prefill import PrefillHooks
from kvc.runtime.compiled.read import READ_HOOK, ReadHook
from kvc.runtime.compiled.replay import ReplayHooks
from kvc.runtime.compiled.roles import RoleKeeps
from kvc.runtime.compiled.state import SequenceStates
from kvc.runtime.compiled.step_end import StepEnd, group_mode
from kvc.runtime.errors import ConfigError
from kvc.runtime.kv import query_window
from kvc.runtime.kv.layout import CacheLayout
from kvc.runtime.kv.spec import Extent, KVSpec, StorageClasses
from kvc.runtime.kv.plans import HeadKeeps, KeepPlan
from kvc.runtime.method_api import DecodeView, Hook, MethodBase, PrefillView, ReadPlan, StepView


class CompiledMethod(PrefillHooks, StepEnd, MethodBase):
    """A `KVMethod` over one compiled folder and the method's checked parameters."""

    compacts = True
    fused_devices = ("cuda",)  # where the fused Triton kernels run (tests add "cpu" under TRITON_INTERPRET)
    QUERY_BLOCK_BYTES = 8 << 20  # the torch path's attention matrix per block of a chunk's queries
    use_state_planes = True  # keep key-local decode state in paged planes (False: per-row dicts, eager)

    def __init__(self, name: str, manifest: dict, params: dict[str, Any], folder: Path | None = None) -> None:
        self.name = name
        self.params = params
        self.folder = folder if folder is not None else compiled_folder.GENERATED / name
        self.code = code = GeneratedCode(name, self.folder, manifest)
        self.lowering, self.hooks_module, self.states = code.lowering, code.hooks, code.states
        self._source_sha256 = manifest.get("source_sha256", "")
        reads_only = set(code.facts) == {READ_HOOK}  # sparse attention alone: every token stays stored
        self.roles = RoleKeeps.of(name, code, params)  # per-head keeps `for ROLE` (roles.py), or None
        self.declared_inputs: dict[str, dict] = dict(manifest.get("inputs", {}))  # name -> dims, file
        self.given_inputs: dict[str, torch.Tensor] = {}  # LAYER inputs set before the engine binds (tests, tools)
        self.inputs_dir: Path | None = None
        self.layer_digest = ""
        # may prefill_chunk give keep plans (the prompt is cut while it is prefilled)?
        self.chunk_keeps = self.roles is not None and "prefill_chunk" in self.roles.keeps
        # every keep of the method is per KV head and independent across heads: each KV head is a
        # cache layer of its own, so a head that keeps less holds fewer pages (runtime/kv/layout.py)
        self.kv_head_layers = self.roles is not None and all(
            hook in self.roles.keeps for hook, facts in code.facts.items() if facts)
        decode_keeps = any(code.facts.get(hook, {}).get("keeps") for hook in DECODE_KEEP_HOOKS)
        self.replayer = ReplayHooks(code, params)  # a pass re-reading the prompt after prefill (replay.py)
        self.replay = self.replayer.spec
        # text partitions whose spans a hook reads (the compiler's `spans`; runtime/text_spans.py)
        self.text_partitions = {name: tuple(markers) for facts in code.facts.values() if facts
                                for name, markers in (facts.get("spans") or {}).items()}
        if (code.end_scores is None and any(code.facts.values()) and not reads_only and not self.chunk_keeps
                and not decode_keeps and self.replay is None):
            raise ConfigError(f"method {name!r} has chunk or decode hooks that keep nothing, and no prefill_end "
                              "selection: the engine serves compiled methods that compress at prefill end or "
                              "while decoding", param="method")
        self.reader = ReadHook.of(code)
        self.window = code.query_window(params)
        self.budget = CompiledBudget(code.held_tokens, params, 1, 1)
        self.attention = code.attention
        self.decoding = facts = without_idle_keep(read_decode_facts(code, self.use_state_planes), code, params)
        self.paged_state, self.state_planes, self.decode_graphs = facts.paged, facts.planes, facts.graphs
        # a read over cluster indices: written into the rows between steps (cluster_index.py)
        self.indices = None if self.reader is None else self.reader.indices
        if self.indices is not None and not reads_only:
            raise ConfigError(f"method {name!r}: a read over a k-means index is served only for methods that keep "
                              "every token (the index is built over the stored prompt)", param="method")
        self.max_context: int | None = None  # the longest context a sequence reaches (`bind`)
        # the model's query heads (`bind`, else the first prefill_end's queries): a decode query window's size,
        # the `heads` of a cluster index's symbols
        self.num_heads: int | None = None
        # the newest queries step_end reads (0: none)
        self.decode_window = code.decode_query_window(params) if facts.keep_hook == "step_end" else 0
        self.seqs = SequenceStates(name, code.states, facts.planes)
        self.decoder = DecodeHooks(name, params, facts, self.seqs, self.budget, code)
        self._select_fn, self._group_mode = facts.select, group_mode(facts, bool(code.states))
        if self._role_keep(facts.keep_hook or ""):
            self._group_mode = None  # per-head counts follow each row's starts: one plan per row
        # rows of several layers stack as one step end where the stacked keep reads nothing of the layer (its
        # counts, ranges, `where` and score: the compiler's `keep_symbols` and `score_symbols`)
        keep = facts.keep or {}
        reads = set(keep.get("keep_symbols", ["layer"])) | set(keep.get("score_symbols", ["layer"]))
        self.step_end_layers = self._group_mode == "inputs" and "layer" not in reads and self.indices is None
        self._count_memo: dict[tuple, int] = {}
        self._row_bytes = {}  # a stacked row's device bytes (runtime/compiled/stacked.py `map`)
        self._rings = {}  # decode_ring's answers (runtime/compiled/step_end.py), per eviction interval and prompt
        self._positions_recorded = None  # whether the KV spec records slot positions (step_end.py)
        self.hooks = self._hooks()
        # a method that never keeps (`full`, or one that only reads) stores every token: prefix caching stays on
        self.compacts = any(facts.get("keeps") for facts in code.facts.values())
        if Hook.STEP_END in facts.hooks and not self._role_keep("step_end"):
            self.budget.decode_bound = self.decode_bound
        # a chain prune's scorer: the prompt's keep scores (`token_scores`), reading the newest
        # `query_window` prefill queries (-1: every query, H2O's attention sums over the prompt)
        self.scores_tokens = code.end_scores is not None and code.score is not None
        chunk_only = self.window == 0 and code.chunk_hook is not None
        self.query_window = -1 if self.window == ALL_QUERIES or chunk_only else self.window
        self.tuned_kernels = frozenset({"compaction"} if self.compacts else ()) | (
            frozenset({"scores"}) if code.fused_names else frozenset())

    def _hooks(self) -> frozenset[Hook]:
        """The contract points the engine calls, from what the generated code has."""
        hooks = {Hook.PREFILL_END, Hook.RELEASE} if self.code.end_scores is not None else set()
        if self.code.chunk_hook is not None or self.window != 0 or self.chunk_keeps:  # chunk state, queries, keeps
            hooks.add(Hook.PREFILL_CHUNK)
        hooks |= self.decoding.hooks
        if self.indices is not None:  # per-sequence cluster indices: built at prefill end, grown at step end
            hooks |= {Hook.PREFILL_END, Hook.STEP_END, Hook.RELEASE}
        if self.replay is not None:  # the replay's state until its keep
            hooks.add(Hook.RELEASE)
        if self.states and self.replay is None:  # per-sequence state that a chain must carry between turns
            hooks.add(Hook.TURN)
        if hooks:  # some per-sequence state may exist: a cloned sequence must get its copy
            hooks.add(Hook.CLONE)
        return frozenset(hooks)

    @property
    def fingerprint(self) -> str:
        """What makes two instances compute the same cache: the method, its parameters, and the
        generated code's source hash (prefix-cache salt; chain records will carry it too)."""
        params = ",".join(f"{k}={self.params[k]!r}" for k in sorted(self.params))
        digests = [d for d in (self.roles.digest if self.roles is not None else "", self.layer_digest) if d]
        inputs = "".join(f"+inputs:{d}" for d in digests)  # the calibrated files' content
        return f"{self.name}({params}){inputs}@{self._source_sha256}"

    def bind(self, num_layers: int, num_kv_heads: int, model_dir: Path | None = None,
             max_context: int | None = None, num_heads: int | None = None, heads: Any = None) -> None:
        """The model's shape, for the budget formulas (called by the engine before admission; over
        cache layers when `kv_head_layers`), its directory, where the method's input tensors are
        found (roles.py), and the longest context a sequence reaches (what per-sequence index
        buffers are sized by). `heads`: this tensor-parallel rank's `HeadCollective`
        (runtime/distributed/group.py; `num_kv_heads` then counts this rank's): each hook runs as the
        compiler's `ranks` fact says (`_split_over_ranks`)."""
        if heads is not None:
            self._split_over_ranks(heads)
        layout = CacheLayout(num_layers, num_kv_heads, self.kv_head_layers)
        self.budget.num_layers, self.budget.num_kv_heads = layout.layers, layout.kv_heads
        self.max_context = max_context
        self.num_heads = num_heads
        self.inputs_dir = model_dir
        if self.roles is not None:
            self.roles.bind(num_layers, num_kv_heads, model_dir, per_head=self.kv_head_layers)
        if self.kv_head_layers:  # each cache layer's budget follows its head's role
            self.budget.prefill_kept = self._prefill_kept if self.chunk_keeps else None
            if Hook.STEP_END in self.hooks:
                self.budget.decode_bound = self.decode_bound

    def _split_over_ranks(self, heads) -> None:
        """Tensor parallelism (compiler/hook_facts.py, `ranks`): a "local" hook runs over this rank's heads
        as it is; a "reduce" one too, its reductions over the query heads combined across the ranks by the
        lowering (`_reduce_heads`; the fused scoring kernels, which reduce over this rank's heads only,
        are not used); a "gather" hook's selection runs over every rank's score rows (`_across_ranks`); a
        "global" one, per-head roles and method inputs (indexed by the model's heads) are refused. Where KV
        heads are replicated over ranks, folds over a query group (`_group`) combine the replicas' parts
        (HeadCollective.across_replicas), and the fused scoring kernels are not used either."""
        facts = {hook: f for hook, f in self.code.facts.items() if f}
        where = sorted(hook for hook, f in facts.items() if f.get("ranks", "global") == "global")
        if where or self.roles is not None or self.declared_inputs:
            why = (f"its {', '.join(where)} computes across KV heads" if where else
                   "it reads per-head inputs indexed by the model's heads")
            raise ConfigError(f"method {self.name!r} does not run under tensor parallelism yet: {why}",
                              param="tensor_parallel_size")
        if any(f.get("ranks") == "reduce" for f in facts.values()) or heads.replicas > 1:
            # (replicated KV heads: each rank folds part of a query group, which `group` completes)
            self.fused_devices = ()
        gathers = {hook for hook, f in facts.items() if f.get("ranks") == "gather"}
        if gathers - {"prefill_end", "step_end"}:
            raise ConfigError(f"method {self.name!r}: a selection across KV heads in "
                              f"{', '.join(sorted(gathers))} under tensor parallelism", param="tensor_parallel_size")
        if "prefill_end" in gathers:
            self.code.end_select = _across_ranks(self.code.end_select, heads)
        if "step_end" in gathers:
            self._select_fn = _across_ranks(self._select_fn, heads)

    def _prefill_kept(self, prompt_len: int, layer: int) -> int:
        """What a cache layer holds after a prefill that its chunk keeps cut (the last chunk's keep)."""
        sym = decode_sym(layer, self.budget.num_layers, prompt_len, prompt_len, prompt_len, None, 1, None)
        return self.roles.count("prefill_chunk", layer, sym)

    def _role_keep(self, hook: str) -> bool:
        """Is `hook`'s keep a per-head keep `for ROLE` (roles.py)?"""
        return self.roles is not None and hook in self.roles.keeps

    def layer_inputs(self, spec: KVSpec, num_layers: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
        """The spec's LAYER tensors that are the method's declared inputs (a `LowRank`'s projections:
        `input k_down: [layer, kv_head, channel, rank] from "FILE"`), [layers, Hkv, *shape] float32,
        from `given_inputs` or the files bind's model directory leads to (inputs.py)."""
        declared = self.declared_inputs
        values = {t.name: load_declared(self.name, t.name, declared[t.name], self.inputs_dir,
                                        (num_layers, num_kv_heads, *t.shape), self.given_inputs)
                  for t in spec.of(Extent.LAYER) if t.name in declared}
        self.layer_digest = digest(values) if values else ""
        return values

    def page_tokens(self) -> int | None:
        """The engine page its page summaries are over (the generated `page_tokens`; None: any)."""
        return self.code.page_tokens(self.params)

    def kv_spec(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int) -> KVSpec:
        """The spec the compiler derived from the .kvm (the generated `kv_spec` of hooks.py, which lists
        the state planes of a key-local decode hook), without those planes (and the positions of a keep
        in place) when the decode state lives in per-row dicts instead (`use_state_planes` off), with a
        read's cluster indices."""
        try:
            spec = self.code.kv_spec(num_kv_heads, head_dim, dtype, page_size, self.params)
        except ValueError as e:  # page summaries over pages of another size than the engine's, or parameters
            # the spec cannot hold (a window that is not whole key groups)
            pages = "pages of" in str(e) or "page_size" in str(e)
            hint = " (set the engine's page_size or the method's parameter to match)" if pages else ""
            raise ConfigError(f"method {self.name!r}: {e}{hint}",
                              param="page_size" if pages else "method_params") from None
        planes = {t.name for t in spec.method_tensors}
        if spec.positions is not None and self.decoding.keep_hook is None:  # a decode keep switched off
            spec = dataclasses.replace(spec, tensors=tuple(t for t in spec.tensors if t.name != spec.positions),
                                       positions=None, in_place=False)
        if spec.in_place and not self.paged_state and self.decoding.after is not None:
            planes.add(spec.positions)  # per-row dicts follow slot order: the keep compacts in order
            spec = dataclasses.replace(spec, positions=None, in_place=False)
        if planes and not self.paged_state:
            spec = dataclasses.replace(spec, tensors=tuple(t for t in spec.tensors if t.name not in planes))
        if self.indices is not None:  # the rows' cluster indices (SEQ tensors), sized by the longest context
            if self.max_context is None:
                raise ConfigError(f"method {self.name!r} keeps a cluster index per sequence, sized by the longest "
                                  "context: bind(..., max_context=) first", param="method")
            spec = dataclasses.replace(spec, tensors=spec.tensors + self.indices.tensors(
                head_dim, self.max_context, self.params, dtype))
        if self.decode_window:  # the newest queries of every row and layer, for step_end (query_window.py)
            if self.num_heads is None or self.num_heads % num_kv_heads:
                raise ConfigError(f"method {self.name!r} keeps each sequence's newest queries: bind(..., num_heads=) "
                                  "with a multiple of the KV heads first", param="method")
            spec = dataclasses.replace(spec, tensors=spec.tensors + query_window.tensors(
                self.decode_window, self.num_heads // num_kv_heads, head_dim, dtype))
        return spec

    def storage_classes(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        page_size: int) -> StorageClasses:
        """`kv_spec` in the layers its stores apply to, K or V dense in the others (the generated
        `dense_operands`: `store ... where layer [not] in P`)."""
        spec = self.kv_spec(num_kv_heads, head_dim, dtype, page_size)
        dense = [self.code.dense_operands(self.params, layer) for layer in range(num_layers)]
        if any(dense) and self.kv_head_layers:
            raise ConfigError(f"method {self.name!r}: a store for some layers with cache layers per KV head is not "
                              "supported", param="method")
        return StorageClasses.of_layers([spec.with_dense(d, head_dim, dtype) for d in dense])

    def token_scores(self, layer: int, num_layers: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The prompt's keep scores [Hkv, n] of keys k [Hkv, n, D] under queries q [Hq, w, D] (the
        generated `score`: a whole prompt's prefill_end scores)."""
        return self.code.score(q, k, layer=layer, num_layers=num_layers, params=self.params)

    def keep_period(self, hook: str) -> int | None:
        """n of a keep that runs `where step % n == 0` (the compiler's KEEP_PERIODS), else None."""
        period = self.code.keep_periods.get(hook)
        return None if period is None else max(1, int(period(self.params)))

    def kept_tail(self, hook: str, sym: dict, length: int) -> int:
        """How many of the newest of `length` stored tokens `hook`'s keep always keeps (`+ last N`):
        keep plans carry it, so the chain cache knows which stored tokens are still verbatim."""
        return self.code.kept_tail(hook, sym, self.params, length)

    def decode_before_attention(self, layer: int, view: DecodeView) -> ReadPlan | None:
        """The pages each decode row's KV heads read (read.py), or None: every page."""
        return None if self.reader is None else self.reader.plan(layer, self.budget.num_layers, view, self.params,
                                                                     self.fused_devices)

    def decode_after_attention(self, layer: int, view: DecodeView, out: torch.Tensor) -> None:
        self.decoder.after_attention(layer, view)

    # ---- cluster indices (cluster_index.py): written outside the decode step ----------------------
    def prefill_end(self, layer: int, view: PrefillView) -> KeepPlan | None:
        if self.indices is None:
            return super().prefill_end(layer, view)
        if self.num_heads is None:
            self.num_heads = view.q.shape[1]
        # the stored prompt (a pruned chain's history counts as stored, as in the decode hook's `prompt`)
        self.indices.build(layer, view.seq_id, view.cache.length, view.cache, self._index_sym(layer), self.params)
        return None

    def step_end_due(self, layer: int, lengths: np.ndarray, prompt_lens: np.ndarray,
                     context_lens: np.ndarray) -> np.ndarray | None:
        due = super().step_end_due(layer, lengths, prompt_lens, context_lens)
        if self.indices is None or due is None:
            return due
        return due | self.indices.due(lengths, prompt_lens, self._index_sym(layer), self.params)

    def step_end_batch(self, layer: int, views: Seq[StepView]) -> list[KeepPlan | None]:
        if self.indices is None:
            return super().step_end_batch(layer, views)
        self.indices.grow(layer, views, self._index_sym(layer), self.params)
        return [None] * len(views)

    def _index_sym(self, layer: int) -> dict[str, Any]:
        """The symbols of the read's `first`/`last` (the index's ranges), as the hook sees them."""
        return {"context": None, "prompt": None, "step": None, "layer": layer, "layers": self.budget.num_layers,
                "heads": self.num_heads, "kv_heads": self.budget.num_kv_heads, "head_dim": None}

    # ---- the replay pass (replay.py) --------------------------------------------------------------
    def replay_chunk(self, seq_id: int, layer: int, num_layers: int, q: torch.Tensor, attn: torch.Tensor,
                     start: int, context_len: int, num_kv_heads: int) -> None:
        self.replayer.chunk(seq_id, layer, num_layers, q, attn, start, context_len, num_kv_heads)

    def replay_end(self, seq_id: int, num_layers: int, context_len: int, num_kv_heads: int) -> list[KeepPlan]:
        return self.replayer.end(seq_id, num_layers, context_len, num_kv_heads)

    # ---- lifecycle (state.py) ------------------------------------------------------------------
    def turn_end(self, seq_id: int) -> dict[int, dict[str, torch.Tensor] | str]:
        return self.seqs.turn_end(seq_id)

    def turn_resume(self, seq_id: int, state: Any, lengths: Seq[int]) -> None:
        self.seqs.turn_resume(seq_id, state, lengths)

    def clone(self, src_seq_id: int, dst_seq_id: int) -> None:
        self.seqs.clone(src_seq_id, dst_seq_id)
        if self.indices is not None:
            self.indices.clone(src_seq_id, dst_seq_id)

    def release(self, seq_id: int) -> None:
        self.seqs.release(seq_id)
        self.replayer.release(seq_id)
        if self.indices is not None:
            self.indices.release(seq_id)

    # the stores under the names tests check (a released method holds nothing), and the fused kernels
    _q = property(lambda self: self.seqs.queries)
    _state = property(lambda self: self.seqs.prefill)
    _decode_state = property(lambda self: self.seqs.decode)
    _pending = property(lambda self: self.seqs.pending)
    _in_pages = property(lambda self: self.seqs.in_pages)
    _resume_pages = property(lambda self: self.seqs.resume_pages)
    _fused_names = property(lambda self: self.code.fused_names)
    _fused = property(lambda self: self.code.fused_kernels)


def resolve_compiled(spec: str, params: dict[str, Any] | None) -> CompiledMethod:
    """A shipped method name, compiled folder or .kvm path -> the adapter over its (possibly just compiled) code."""
    name, manifest, checked, folder = compiled_folder.resolve(spec, params)
    return CompiledMethod(name, manifest, checked, folder)


def _across_ranks(select, heads):
    """`select` (a generated `<hook>_select` across KV heads) over every tensor-parallel rank's score rows:
    the selection of the model's heads, this rank's part as `HeadKeeps` (the layer as wide as the widest
    head on any rank; a keep due where any head's is)."""

    def run(scores, sym, params):
        every = heads.gather(scores)
        starts = sym.get("starts")
        full = {**sym, "kv_heads": heads.total}
        if starts is not None:
            full["starts"] = starts = heads.gather_ints(list(starts))
        kept = select(every, full, params)
        counts = [int(t.numel()) for t in kept]
        length = scores.shape[-1]
        drop = max(length - start - count for start, count in zip(starts or [0] * len(counts), counts))
        return HeadKeeps(list(kept[heads.local]), max(counts), drop)

    return run
