"""The decode-time half of the generic compiled-method adapter (`methods_compiled.py`).

Nothing here knows a method by name: what a method does while decoding comes from its manifest's
hook facts (`manifest["hooks"]`, written by `compiler/hook_facts.py`) and its generated torch
lowering (`<hook>` accumulating state, or `<hook>_scores` + `<hook>_select` when it keeps).

- `decode_after_attention(layer, view, out)`: when the hook reads `attn`, the method declares the
  fold in `attention.decode_stats` (from the manifest's `attention` entry: over the GQA group, over
  every head, or not) and runs the attention variant that emits it (`decode_stats`), so the decode
  attention kernels themselves leave the step's softmax probabilities over each row's paged keys
  in `view.attn_stats` (the torch backend: `attention/decode_stats.py`); then the generated hook
  accumulates the method's state (H2O's `seen`) and its ranking scores wait for step end.
- `step_end(layer, view)`: the hook's generated selection (H2O heavy hitters + recent window,
  TOVA's top, StreamingLLM's sink + window) -> `KeepPlan` of ascending physical indices, so the
  newest tokens stay last; per-token state follows the same indices. How many tokens survive is
  known on the host without reading the device: the generated `<hook>_select` runs on a `meta`
  tensor of the cache's shape (counts depend on lengths and parameters only), so a step that
  does not evict skips the selection and a step that does never syncs for its size.
- `step_end_batch(layer, views)`: the same plans for a whole decode batch, with host work per
  group of rows rather than per row. Rows whose symbols are equal (stored length, context and
  prompt length: the same count and `sym`) form a group. A keep whose scores read nothing but the
  symbols (a `step_end` hook with no inputs, a method without state: StreamingLLM) selects once
  per group and every row gets that plan. A keep whose scores are in a plane and whose selection
  is row-wise (manifest fact `rowwise_select`: each KV head kept from its own score row, no count
  reading `kv_heads`) reads the group's scores as [G, Hkv, n] and runs the generated selection once
  over the G*Hkv rows (`kv_heads` set to G*Hkv). Anything else, and a group of one, runs
  `step_end` per row, the oracle the batched plans equal (tensor-equal indices, same tail).
- Eviction interval (`evict_interval`, set by the engine from `EngineConfig.evict_interval`): a
  row evicts only once its stored length reaches its count + N (`_due`), then down to the count
  at once: the selection at that length, over the scores of that step (StreamingLLM keeps exactly
  what per-step eviction keeps at that length; H2O's accumulated and TOVA's last-step scores rank
  N tokens at once, the usual batched approximation). N = 1 is eviction at every step. The decode
  bound counts the N - 1 tokens a row holds above the per-step peak.
- After `prefill_end`, the prefill state (H2O's column sums) continues into decoding.
- Keep plans carry `tail` (the keep's `+ last N`, `CompiledMethod.kept_tail`) for the chain cache.

Where the decode state lives: paged state planes (the default), or per-row dicts (the oracle).

- Planes, when the hook is key-local (manifest fact `key_local`: every accumulated value and the
  ranking score is computed key by key from `attn`, parameters and `[kv_head, key]` states) and
  `use_state_planes` is on. The method's `kv_spec` lists one float32 per-token tensor per state and one
  for the pending scores (`<hook>.scores`); `PagedAttention` holds them beside K/V, addressed by
  the same page tables and slots (runtime/kv/state_planes.py), so state scales with stored tokens
  and is freed, shared (copy-on-write) and compacted with the pages. The decode hook then runs
  the generated lowering ONCE per layer over the whole batch: the rows' keys laid side by side
  (`attn [B, R, W]` -> `[R, B*W]`, each state gathered from its plane to `[Hkv, B*W]`, the new
  token's slot at 0 as `_grow` would pad it), and scatters state and scores back (padding into
  the planes' scratch page). Key-locality is what makes this exact: no value looks across keys,
  so laying rows side by side changes nothing, and no per-row symbol enters the math (`context`
  is the flattened width, which `_full_scores`/`_grow` only use to pad, and they pad nothing here).
  Only device tensors of static shape, no host reads: the same code runs eagerly (CPU, mixed
  steps) and inside the CUDA graphs of decode steps, so `decode_graphs` is True. Step end reads
  the scores from their plane (eager, after the replay); compaction moves the planes with K/V.
  Chains: the state stays in the pages the record keeps (`turn_end` marks such layers
  `IN_PAGES`), and a continuation's first prefill chunk reads it back from them.
- Dicts keyed by (sequence, layer), one generated call per row with the row's host facts
  (`view.rows`), when the hook is not key-local or `use_state_planes` is off (tests compare the
  two): those decode steps run eagerly (`decode_graphs = False`).

A `step_end`-only method (StreamingLLM) keeps no decode state and its graphs: step_end runs after
the replay.

Symbols in decode hooks: `context` is the physical length the selection ranks (the stored
tokens, the step's own included), `prompt` the tokens the prefill covered, `step` the decode
steps so far (1 at the first), `heads` the model's query heads. The engine hands `attn` with the
folded axis already reduced to size 1 (`[kv_head, key]` or `[1, key]`); the hook's own
`mean(attn, over group|head)` then folds it exactly.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any

import numpy as np
import torch

from kvc.runtime.errors import ConfigError
from kvc.runtime.kv import state_planes
from kvc.runtime.kv.state_planes import BatchSlots
from kvc.runtime.kv.spec import KVSpec
from kvc.runtime.method_api import DecodeView, Hook, KeepPlan, LayerCacheView, StackedPlan, StepView

DECODE_KEEP_HOOKS = ("decode_after_attention", "step_end")
IN_PAGES = "in pages"  # turn_end's state of a layer whose decode state stays in the record's pages
_MEMO_LIMIT = 4096


class DecodeHooks:
    """Mixed into `CompiledMethod`, which provides `name`, `params`, `lowering`, `states`, `attention` and `budget`
    (for `num_layers` / `num_kv_heads`), and calls `_decode_start` from prefill_end and
    `_release_decode` from release. Decode state lives apart from the prefill's: a recompute after
    preemption starts a fresh prefill state and then replaces this one."""

    use_state_planes = True  # keep key-local decode state in paged planes (False: per-row dicts, eager)

    def _init_decode(self, manifest: dict) -> set[Hook]:
        """Reads the decode facts; returns the contract hooks they need."""
        facts = manifest.get("hooks", {})
        if "decode_before_attention" in facts:
            raise ConfigError(f"method {self.name!r} reads or estimates before decode attention; the engine does "
                              "not serve decode_before_attention of compiled methods yet", param="method")
        self._keep_hook = None  # the hook whose keep runs at step end
        keeping = [h for h in DECODE_KEEP_HOOKS if facts.get(h, {}).get("keeps")]
        if len(keeping) > 1:
            raise ConfigError(f"method {self.name!r} keeps in both decode_after_attention and step_end; "
                              "the engine serves one decode-time keep per method", param="method")
        after = facts.get("decode_after_attention")
        unsupported = set(after["inputs"]) - {"attn"} if after else set()
        if facts.get("step_end") is not None:
            unsupported |= set(facts["step_end"]["inputs"]) & {"q", "attn"}
        if after is not None and after["keeps"] and "attn" not in after["inputs"]:
            unsupported.add("no attn (a keep that needs no attention belongs in step_end)")
        if unsupported:
            raise ConfigError(f"method {self.name!r}: decode hooks reading {', '.join(sorted(unsupported))} are not "
                              "served yet (decode_after_attention gets attn; step_end gets k and v)", param="method")
        self._after = after
        if after is not None and after.get("attention") and self.attention.decode_stats is None:
            raise ConfigError(f"method {self.name!r} reads attention while decoding but its manifest names attention "
                              f"variant {self.attention.variant!r}, which emits no statistics; run `kvc compile --all`",
                              param="method")
        hooks: set[Hook] = set()
        self.paged_state = bool(after is not None and after.get("key_local") and self.use_state_planes)
        self._scores_plane = "decode_after_attention.scores" if self.paged_state and after["keeps"] else None
        self.state_planes: tuple[str, ...] = ()
        if self.paged_state:
            self.state_planes = tuple(self.states) + ((self._scores_plane,) if self._scores_plane else ())
        if after is not None:
            hooks.add(Hook.DECODE_AFTER_ATTENTION)
            suffix = "_scores" if after["keeps"] else ""
            self._after_fn = getattr(self.lowering, f"decode_after_attention{suffix}")
        if keeping:
            self._keep_hook = keeping[0]
            self._keep_facts = facts[self._keep_hook]
            self._select_fn = getattr(self.lowering, f"{self._keep_hook}_select")
            if "head_adaptive" in inspect.getsource(self._select_fn):
                raise NotImplementedError(f"method {self.name!r} keeps per-head variable counts while decoding; "
                                          "the engine needs per-head lengths in its metadata first")
            self._step_scores = getattr(self.lowering, "step_end_scores", None)
            hooks.add(Hook.STEP_END)
        self._group_mode = _group_mode(self._keep_hook, facts, bool(self.states), self.paged_state)
        if self.paged_state:
            # a decode step writes the planes of every stored slot; a method listing STEP_END gets
            # spare pages for each shared one (Scheduler._copies), which the runner copies first
            hooks.add(Hook.STEP_END)
        self.decode_graphs = self.paged_state or Hook.DECODE_AFTER_ATTENTION not in hooks
        self._decoding = bool(hooks)
        self._decode_state: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (seq, layer) -> states
        self._pending: dict[tuple[int, int], torch.Tensor] = {}  # decode_after_attention scores, until step end
        self._in_pages: set[tuple[int, int]] = set()  # (seq, layer) whose decode state is in the planes
        self._resume_pages: set[tuple[int, int]] = set()  # (seq, layer) to read back at the first chunk
        self._count_memo: dict[tuple, int] = {}
        return hooks

    def kv_spec(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int) -> KVSpec:
        """The spec the compiler derived from the .kvm (the generated `kv_spec` of hooks.py, which lists
        the state planes of a key-local decode hook), without those planes when the decode state lives
        in per-row dicts instead (`use_state_planes` off)."""
        generated = getattr(self.hooks_module, "kv_spec", None)
        if generated is None:
            raise ConfigError(f"the generated hooks.py of method {self.name!r} predates `kv_spec`; run "
                              "`kvc compile --all` (or recompile the method's folder)", param="method")
        spec = generated(num_kv_heads, head_dim, dtype, page_size, self.params)
        planes = {t.name for t in spec.method_tensors}
        if self.paged_state or not planes:
            return spec
        return dataclasses.replace(spec, tensors=tuple(t for t in spec.tensors if t.name not in planes))

    # ---- chain cache: decode state in the record's pages ------------------------------------
    def _layers_in_pages(self, seq_id: int) -> dict[int, str]:
        """turn_end's value for the layers whose decode state is in the planes: `IN_PAGES` (the
        chain record keeps the pages, and with them the state)."""
        return {layer: IN_PAGES for seq, layer in self._in_pages if seq == seq_id}

    def _resume_in_pages(self, seq_id: int, layer: int) -> None:
        """turn_resume of a layer recorded `IN_PAGES`: its first prefill chunk reads the state back."""
        self._resume_pages.add((seq_id, layer))

    def _resumed_state(self, key: tuple[int, int], cache: LayerCacheView, stored: int) -> dict | None:
        """A continuation's state for slots [0, stored) (what the record's pages hold, cut by any
        rollback), read from the planes once, at its first prefill chunk; None when not resumed so."""
        if key not in self._resume_pages:
            return None
        self._resume_pages.discard(key)
        planes = self._planes(cache.store)
        return {name: state_planes.read(planes[name], cache.page_ids, stored) for name in self.states}

    # ---- symbols and host-side counts -------------------------------------------------------
    def _decode_sym(self, layer: int, length: int, context_len: int, prompt_len: int, heads: int | None,
                    kv_heads: int, head_dim: int | None) -> dict[str, Any]:
        return {"context": length, "prompt": prompt_len, "step": context_len - prompt_len, "layer": layer,
                "layers": self.budget.num_layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}

    def decode_kept(self, length: int, prompt_len: int, context_len: int, layer: int, kv_heads: int) -> int:
        """Tokens the decode-time keep leaves of `length` stored ones (host only: a `meta` run of the
        generated selection). `length` when the method has no decode-time keep."""
        if self._keep_hook is None:
            return length
        step = context_len - prompt_len if self._keep_facts["where"] else None
        key = (length, prompt_len, layer, kv_heads, step)
        count = self._count_memo.get(key)
        if count is None:
            sym = self._decode_sym(layer, length, context_len, prompt_len, None, kv_heads, None)
            kept = self._select_fn(torch.empty(kv_heads, length, device="meta"), sym, self.params)
            counts = {int(t.shape[0]) for t in kept}
            if len(counts) != 1:
                raise NotImplementedError(f"method {self.name!r} keeps unequal counts per KV head while decoding")
            if len(self._count_memo) >= _MEMO_LIMIT:
                self._count_memo.clear()
            count = self._count_memo[key] = counts.pop()
        return count

    def step_end_due(self, layer: int, lengths: np.ndarray, prompt_lens: np.ndarray,
                     context_lens: np.ndarray) -> np.ndarray:
        """The contract's `step_end_due`: which rows' `step_end` may give a plan at this step (host
        facts per row; one `decode_kept` per distinct row, rows of a batch mostly share them)."""
        if self._keep_hook is None:
            return np.zeros(len(lengths), dtype=bool)
        kv_heads = self.budget.num_kv_heads
        facts = np.stack([lengths, prompt_lens, context_lens], axis=1)
        if len(facts) and (facts == facts[0]).all():
            n, p, c = (int(x) for x in facts[0])
            return np.full(len(facts), self._due(n, self.decode_kept(n, p, c, layer, kv_heads)))
        distinct, inverse = np.unique(facts, axis=0, return_inverse=True)
        due = np.array([self._due(int(n), self.decode_kept(int(n), int(p), int(c), layer, kv_heads))
                        for n, p, c in distinct], dtype=bool)
        return due[inverse.reshape(-1)]

    def _due(self, length: int, count: int) -> bool:
        """Does a row storing `length` tokens, of which the keep leaves `count`, evict at this step:
        has it grown `evict_interval` tokens past the count (N = 1: whenever the keep drops any)."""
        return length >= count + self.evict_interval

    def decode_bound(self, prompt_len: int, physical: int, layer: int) -> int:
        """The most a layer holds during a decode step once `physical` tokens (prefill kept +
        generated) would be stored without decode-time eviction. The first step holds the prefill's
        kept tokens plus its own; later ones at most the decode keep's count at `physical` plus
        `evict_interval` (the step's token, and the N - 1 a row keeps between evictions; counts grow
        with length, so no earlier step held more). A keep with a `where` may skip steps: no bound
        then."""
        if self._keep_hook is None or self._keep_facts["where"] or physical <= 0:
            return physical
        prefill_kept = self.budget.kept(prompt_len, layer)
        first = prefill_kept + min(1, physical - prefill_kept)
        kept = self.decode_kept(physical, prompt_len, prompt_len, layer, self.budget.num_kv_heads)
        return min(physical, max(first, kept + self.evict_interval))

    # ---- the contract's decode points ----------------------------------------------------------
    def _decode_start(self, key: tuple[int, int], state: dict[str, torch.Tensor], cache: LayerCacheView,
                      plan: KeepPlan | None) -> None:
        """After prefill_end: the prefill state continues into decoding, gathered to the kept tokens
        (dicts), or written into the planes at the stored slots, which compaction then moves with
        K/V (the runner owns the layer's pages before prefill_end)."""
        if not self._decoding:
            return
        self._pending.pop(key, None)
        length, device = cache.length, cache.device
        if not self.paged_state:
            self._decode_state[key] = _gather_state(state, length, None if plan is None else plan.indices, device)
            return
        planes = self._planes(cache.store)
        full = _gather_state(state, length, None, device)  # every stored slot, new keys at 0
        for name in self.states:
            value = torch.nn.functional.pad(full[name], (0, length - full[name].shape[-1]))
            state_planes.write(planes[name], cache.page_ids, value)
        self._in_pages.add(key)

    def _planes(self, store) -> dict[str, torch.Tensor]:
        """The store's tensors of this method's state planes, by name."""
        if store is None or any(name not in store.spec for name in self.state_planes):
            raise RuntimeError(f"method {self.name!r} keeps its decode state in the per-token tensors "
                               f"{list(self.state_planes)}, which the KV store does not hold (its spec is "
                               "not this method's kv_spec)")
        return {name: store[name] for name in self.state_planes}

    def decode_after_attention(self, layer: int, view: DecodeView, out: torch.Tensor) -> None:
        if self.paged_state:
            self._decode_after_paged(layer, view)
            return
        if view.rows is None:
            raise RuntimeError(f"method {self.name!r} needs eager decode steps (decode_graphs is False)")
        kv_heads = view.k.shape[1]
        attn = view.attn_stats  # [B, R, W], emitted by the decode attention
        if attn is None and self.attention.decode_stats is not None:
            raise RuntimeError(f"method {self.name!r}: the decode attention emitted no statistics (view.attn_stats)")
        for b, row in enumerate(view.rows):
            key = (row.seq_id, layer)
            state = self._decode_state.get(key)
            if state is None:
                state = {s: torch.zeros(kv_heads, 0, device=view.q.device) for s in self.states}
            inputs = {"attn": None if attn is None else attn[b, :, : row.length]}
            sym = self._decode_sym(layer, row.length, row.context_len, row.prompt_len, view.q.shape[1], kv_heads,
                                   view.q.shape[2])
            if self._after["keeps"]:
                self._pending[key] = self._after_fn(inputs, state, sym, self.params)
                self._decode_state[key] = state  # the generated scoring updates its state in place
            else:
                self._decode_state[key] = self._after_fn(inputs, state, sym, self.params)

    def _decode_after_paged(self, layer: int, view: DecodeView) -> None:
        """The generated hook once over the batch, its rows' keys side by side (module docstring).
        Tensors of static shape only, no host reads: CUDA-graph capturable."""
        planes = self._planes(view.store)
        attn = view.attn_stats  # [B, R, W]
        if attn is None:
            raise RuntimeError(f"method {self.name!r}: the decode attention emitted no statistics (view.attn_stats)")
        batch, rows, width = attn.shape
        kv_heads = view.k.shape[1]
        some = next(iter(planes.values()))
        slots = BatchSlots.of(view.block_tables, view.context_lens, width, some.shape[2], some.shape[0] - 1)
        # the state covers the slots stored before this step; the step's own starts at 0 (`_grow`)
        before = torch.arange(width, device=attn.device)[None, :] < (view.context_lens.long() - 1)[:, None]
        state = {}
        for name in self.states:
            value = torch.where(before[:, None, :], slots.gather(planes[name]), 0.0)
            state[name] = value.transpose(0, 1).reshape(kv_heads, batch * width)
        inputs = {"attn": attn.transpose(0, 1).reshape(rows, batch * width)}
        sym = {"context": batch * width, "prompt": None, "step": None, "layer": layer,
               "layers": self.budget.num_layers, "heads": view.q.shape[1], "kv_heads": kv_heads,
               "head_dim": view.q.shape[2]}
        if self._scores_plane is not None:
            scores = self._after_fn(inputs, state, sym, self.params)  # updates `state` in place
            slots.scatter(planes[self._scores_plane], _unflatten(scores, batch, width))
        else:
            state = self._after_fn(inputs, state, sym, self.params)
        for name in self.states:
            slots.scatter(planes[name], _unflatten(state[name], batch, width))

    def step_end(self, layer: int, view: StepView) -> KeepPlan | None:
        key = (view.seq_id, layer)
        length, kv_heads = view.cache.length, view.cache.num_kv_heads
        pending = self._pending.pop(key, None)
        if self._keep_hook is None:
            return None
        count = self.decode_kept(length, view.prompt_len, view.context_len, layer, kv_heads)
        if not self._due(length, count):
            return None
        head_dim = view.cache.store.head_dim("k")
        sym = self._decode_sym(layer, length, view.context_len, view.prompt_len, None, kv_heads, head_dim)
        if self.paged_state:
            return self._step_end_paged(view, count, sym)
        return self._step_end_row(layer, view, count, sym, pending)

    def _step_end_paged(self, view: StepView, count: int, sym: dict) -> KeepPlan:
        """step_end over the planes: the scores (or the state) of the stored slots; compaction moves
        the planes with K/V, so nothing is gathered here."""
        cache = view.cache
        planes = self._planes(cache.store)
        if self._keep_hook == "decode_after_attention":
            scores = state_planes.read(planes[self._scores_plane], cache.page_ids, cache.length)
        else:
            state = {name: state_planes.read(planes[name], cache.page_ids, cache.length) for name in self.states}
            scores = self._step_scores(_CacheInputs(cache), state, sym, self.params)
        return self._plan(self._select_fn(scores, sym, self.params), count, sym, cache)

    def _plan(self, kept: list[torch.Tensor], count: int, sym: dict, cache: LayerCacheView) -> KeepPlan:
        indices = _stacked(kept, cache.device)
        if indices.shape[1] != count:
            raise RuntimeError(f"method {self.name!r}: selection kept {indices.shape[1]}, its count says {count}")
        return KeepPlan(indices, tail=self.kept_tail(self._keep_hook, sym, cache.length))

    def step_end_batch(self, layer: int, views: list[StepView]) -> list[KeepPlan | None]:
        """`step_end` of every view, in order, grouped by equal symbols (module docstring). A
        group's rows share their plan's tensor: one plan object (symbols alone), or `StackedPlan`
        rows of one stacked selection, so the engine moves one tensor per group, not per row."""
        if self._group_mode is None or len(views) < 2:
            return [self.step_end(layer, view) for view in views]
        plans: list[KeepPlan | None] = [None] * len(views)
        keys = [(view.cache.length, view.context_len, view.prompt_len, id(view.cache.store))  # the store: shapes
                for view in views]
        if keys.count(keys[0]) == len(keys):  # the common case (a decode batch in step): one group
            return self._step_end_group(layer, views)
        groups: dict[tuple, list[int]] = {}
        for i, key in enumerate(keys):
            rows = groups.get(key)
            if rows is None:
                groups[key] = [i]
            else:
                rows.append(i)
        for rows in groups.values():
            if len(rows) == 1:
                plans[rows[0]] = self.step_end(layer, views[rows[0]])
                continue
            for i, plan in zip(rows, self._step_end_group(layer, [views[i] for i in rows])):
                plans[i] = plan
        return plans

    def _step_end_group(self, layer: int, views: list[StepView]) -> list[KeepPlan | None]:
        """step_end of rows with equal symbols: one selection for the group."""
        first = views[0]
        pending = self._pending
        if pending:
            for view in views:
                pending.pop((view.seq_id, layer), None)
        cache = first.cache
        length, kv_heads, head_dim = cache.length, cache.num_kv_heads, cache.store.head_dim("k")
        count = self.decode_kept(length, first.prompt_len, first.context_len, layer, kv_heads)
        if not self._due(length, count):
            return [None] * len(views)
        sym = self._decode_sym(layer, length, first.context_len, first.prompt_len, None, kv_heads, head_dim)
        if self._group_mode == "symbolic":  # the same scores, so the same plan (one object) for every row
            plan = self._step_end_row(layer, first, count, sym)
            if self._decode_state:
                for view in views[1:]:
                    key = (view.seq_id, layer)
                    if key in self._decode_state:  # no state: the per-row path would store an empty dict
                        self._decode_state[key] = {}
            return [plan] * len(views)
        planes = self._planes(cache.store)
        scores = _read_rows(planes[self._scores_plane], [view.cache.page_ids for view in views], length)
        rows = len(views) * kv_heads
        kept = self._select_fn(scores.reshape(rows, length), {**sym, "kv_heads": rows}, self.params)
        indices = _stacked(kept, cache.device)
        if indices.shape != (rows, count):
            raise RuntimeError(f"method {self.name!r}: the stacked selection kept {tuple(indices.shape)}, "
                               f"its count says ({rows}, {count})")
        tail = self.kept_tail(self._keep_hook, sym, length)
        stack = indices.view(len(views), kv_heads, count)
        return [StackedPlan(stack, g, tail) for g in range(len(views))]

    def _step_end_row(self, layer: int, view: StepView, count: int, sym: dict,
                      pending: torch.Tensor | None = None) -> KeepPlan:
        """step_end of one row over its dict state, its count and symbols known: the keep's scores
        (decode_after_attention's `pending` ones, or step_end's own), the plan, and the state
        gathered to the kept tokens."""
        key = (view.seq_id, layer)
        state = self._decode_state.get(key)
        if state is None:
            state = {s: torch.zeros(view.cache.num_kv_heads, 0, device=view.cache.device)
                     for s in self.states}
        if self._keep_hook == "decode_after_attention":
            if pending is None:
                raise RuntimeError(f"method {self.name!r}: step_end without decode_after_attention's scores")
            scores = pending
        else:
            scores = self._step_scores(_CacheInputs(view.cache), state, sym, self.params)
        plan = self._plan(self._select_fn(scores, sym, self.params), count, sym, view.cache)
        if key in self._decode_state:
            self._decode_state[key] = _gather_state(state, view.cache.length, plan.indices, plan.indices.device)
        return plan

    def _clone_decode(self, src: int, dst: int) -> None:
        """A cloned sequence's decode state and pending scores: copies of its source's (state in
        the planes came with the copied pages: the clone's layers are marked in pages too)."""
        for store in (self._pending, self._decode_state):
            copy_entries(store, src, dst)
        self._in_pages |= {(dst, layer) for seq, layer in self._in_pages if seq == src}

    def _release_decode(self, seq_id: int) -> None:
        for store in (self._pending, self._decode_state):
            for key in [key for key in store if key[0] == seq_id]:
                del store[key]
        for keys in (self._in_pages, self._resume_pages):
            keys -= {key for key in keys if key[0] == seq_id}


def copy_entries(store: dict[tuple[int, int], Any], src: int, dst: int) -> None:
    """store[(dst, layer)] = a copy of store[(src, layer)] for every layer src has (a tensor, or
    a dict of tensors)."""
    for (seq, layer), value in list(store.items()):
        if seq == src:
            store[dst, layer] = ({name: t.clone() for name, t in value.items()} if isinstance(value, dict)
                                 else value.clone())


def _group_mode(keep_hook: str | None, facts: dict, stateful: bool, paged: bool) -> str | None:
    """How `step_end_batch` batches a group of rows with equal symbols: "symbolic" (scores from the
    symbols alone: one selection, one plan for all), "planes" (scores in a plane, row-wise
    selection: one stacked selection), or None (per row)."""
    if keep_hook is None:
        return None
    keep = facts[keep_hook]
    if keep_hook == "step_end" and not keep["inputs"] and not stateful and not paged:
        return "symbolic"
    if keep_hook == "decode_after_attention" and paged and keep.get("rowwise_select"):
        return "planes"
    return None


def _read_rows(plane: torch.Tensor, tables: list[list[int]], n: int) -> torch.Tensor:
    """The state of slots [0, n) of several sequences' layer: [G, Hkv, n] float32, row g equal to
    `state_planes.read(plane, tables[g], n)`. The tables go to the device in one array."""
    page_size = plane.shape[2]
    pages = -(-n // page_size)
    if any(len(table) < pages for table in tables):
        raise ValueError(f"a table of fewer than {pages} pages of {page_size} slots cannot hold {n} tokens")
    flat = itertools.chain.from_iterable(table if len(table) == pages else table[:pages] for table in tables)
    ids = np.fromiter(flat, dtype=np.int64, count=len(tables) * pages).reshape(len(tables), pages)
    ids = torch.from_numpy(ids).to(plane.device)  # [G, pages]
    slots = torch.arange(n, device=plane.device)
    return plane[ids[:, slots // page_size], :, slots % page_size].permute(0, 2, 1)


def _stacked(kept: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The generated selection's per-row index tensors (equal lengths) as one [rows, kept] int64
    tensor on `device`: one stack, one move (not one per row)."""
    return torch.stack(kept).to(device=device, dtype=torch.long)


class _CacheInputs(dict):
    """A step_end hook's inputs: `k` / `v` are dense copies of the layer's cache ([Hkv, n, D];
    float32 on the CPU, the reference precision), made only if the hook reads them."""

    def __init__(self, cache) -> None:
        super().__init__()
        self._cache = cache

    def __missing__(self, name: str) -> torch.Tensor:
        if name not in ("k", "v"):
            raise KeyError(name)
        value = self._cache.keys() if name == "k" else self._cache.values()
        self[name] = value = value.float() if value.device.type == "cpu" else value
        return value


def _unflatten(value: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """[Hkv, B*W] (rows side by side) -> [B, Hkv, W]."""
    return value.reshape(value.shape[0], batch, width).transpose(0, 1)


def _gather_state(state: dict[str, torch.Tensor], length: int, indices: torch.Tensor | None,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """Per-token state ([kv_head, key], growing with the cache) follows the kept tokens; keys not
    reached yet start at 0 (the state's initial value, as the lowering's `_grow` does)."""
    out = {}
    for name, value in state.items():
        value = value.to(device)
        if value.dim() == 2 and indices is not None and value.shape[-1] <= length:
            value = torch.nn.functional.pad(value, (0, length - value.shape[-1])).gather(1, indices)
        out[name] = value
    return out
