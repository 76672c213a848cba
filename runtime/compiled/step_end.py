"""Step end of a compiled method: the decode-time keep's plans, which rows are due, and its bound.

docs/design.md, "Decode-time eviction", is the design: the generated `<hook>_select` gives
ascending physical indices; how many it keeps is known on the host from a `meta` run
(`decode_kept`); the eviction interval decides when a row is due (`_due`) and the budget's decode
bound (`decode_bound`); `step_end_batch` groups rows of one length, and selects once per set of them
that agrees on the symbols the selection reads (`_group_symbols`: StreamingLLM's and TOVA's read
none but the length, H2O's the prompt; `group_mode`: from the symbols alone, or stacked selections
over the rows' score planes, read once per length), equal to `step_end` per row.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any, Callable

import numpy as np
import torch

from kvc.runtime.compiled.budget import CompiledBudget
from kvc.runtime.compiled.decode import DecodeFacts, decode_sym
from kvc.runtime.compiled.state import SequenceStates, gather_state
from kvc.runtime.compiled.stacked import StackedRows
from kvc.runtime.kv import slot_order
from kvc.runtime.kv.plans import keep_plan_if_due
from kvc.runtime.kv.ring import Ring
from kvc.runtime.method_api import Hook, KeepPlan, LayerCacheView, StackedPlan, StepView, StepViews
from kvc.runtime.transfer import to_device

MEMO_LIMIT = 4096  # memoised counts (decode_kept) before the memo starts over


class StepEnd:
    """CompiledMethod's step-end points (`step_end`, `step_end_batch`, `step_end_due`) and the
    counts they share with its budget, as its own methods rather than a separate object: they call
    `_step_end_group` and `_select_fn` through the method, so one replaced on the method (a test's
    spy, bench/step_end_runner_host.py's timer) sees every call. State lives in the composed parts
    it reads:"""

    name: str
    params: dict[str, Any]
    hooks: frozenset[Hook]
    decoding: DecodeFacts
    seqs: SequenceStates
    budget: CompiledBudget
    evict_interval: int
    _select_fn: Callable  # the keep's generated selection (decoding.select)
    _group_mode: str | None  # group_mode(decoding, stateful)
    _count_memo: dict[tuple, int]
    _rings: dict[tuple, list]  # (evict_interval, layers, prompt) -> `decode_ring` per layer
    _row_bytes: dict  # StackedRows.map's device bytes a stacked row takes, per length and device
    kept_tail: Callable[[str, dict, int], int]
    keep_period: Callable[[str], int | None]
    roles: Any  # RoleKeeps or None (a keep `for ROLE`: per-head counts, roles.py)
    kv_head_layers: bool  # a cache layer per KV head: a role keep's count is its one head's
    _role_keep: Callable[[str], bool]
    kv_spec: Callable  # the method's KV spec (a ranked ring needs its slot positions)
    _positions_recorded: bool | None  # whether it records them (`_ranks_in_place`, found once)
    _kernel: Callable  # the fused Triton kernel of a hook on a device, or None (runtime/compiled/prefill.py)

    # ---- host-side counts ----------------------------------------------------------------------
    def decode_kept(self, length: int, prompt_len: int, context_len: int, layer: int, kv_heads: int) -> int:
        """Tokens the decode-time keep leaves of `length` stored ones (host only: a `meta` run of the
        generated selection). `length` when the method has no decode-time keep."""
        facts = self.decoding
        if facts.keep_hook is None:
            return length
        role = self._role_keep(facts.keep_hook)
        if role and not self.kv_head_layers:
            raise NotImplementedError(f"method {self.name!r}: per-head counts on shared pages follow each row's starts")
        reads = facts.keep.get("keep_symbols", ("prompt", "step", "layer"))  # the memo keys on what the counts read
        step = context_len - prompt_len if facts.keep["where"] or "step" in reads else None
        key = (length, prompt_len if "prompt" in reads else None, layer if role or "layer" in reads else None,
               kv_heads, step)
        count = self._count_memo.get(key)
        if count is None:
            sym = decode_sym(layer, self.budget.num_layers, length, context_len, prompt_len, None, kv_heads, None)
            if role:  # a cache layer of one KV head: its role decides
                return self._memo(key, self.roles.count(facts.keep_hook, layer, sym))
            kept = self._select_fn(torch.empty(kv_heads, length, device="meta"), sym, self.params)
            counts = {int(t.shape[0]) for t in kept}
            if len(counts) != 1:
                raise NotImplementedError(f"method {self.name!r} keeps unequal counts per KV head while decoding")
            count = self._memo(key, counts.pop())
        return count

    def _memo(self, key: tuple, count: int) -> int:
        if len(self._count_memo) >= MEMO_LIMIT:
            self._count_memo.clear()
        self._count_memo[key] = count
        return count

    def step_end_due(self, layer: int, lengths: np.ndarray, prompt_lens: np.ndarray,
                     context_lens: np.ndarray) -> np.ndarray:
        """The contract's `step_end_due`: which rows' `step_end` may give a plan at this step (host
        facts per row; one `decode_kept` per distinct row, rows of a batch mostly share them)."""
        if self.decoding.keep_hook is None:
            return np.zeros(len(lengths), dtype=bool)
        if self.decoding.head_counts:
            return None  # per-head counts: whether a head drops tokens depends on the scores (step_end decides)
        if self._role_keep(self.decoding.keep_hook):
            if not self.kv_head_layers:
                return None  # per-head counts: whether a row is due depends on its heads' starts (step_end decides)
            if not any(self.roles.heads(self.decoding.keep_hook, layer)):
                return np.zeros(len(lengths), dtype=bool)  # a head outside the role keeps every token
            cap = self.roles.static_count(self.decoding.keep_hook, layer)
            if cap is not None:  # `first a + last b`: min(length, a + b) kept, whatever the row
                return lengths >= cap + self.evict_interval
        kv_heads = self.budget.num_kv_heads
        facts = np.stack([lengths, prompt_lens, context_lens], axis=1)
        if len(facts) and (facts == facts[0]).all():
            n, p, c = (int(x) for x in facts[0])
            return np.full(len(facts), self._due(n, self.decode_kept(n, p, c, layer, kv_heads)))
        distinct, inverse = np.unique(facts, axis=0, return_inverse=True)
        due = np.array([self._due(int(n), self.decode_kept(int(n), int(p), int(c), layer, kv_heads))
                        for n, p, c in distinct], dtype=bool)
        return due[inverse.reshape(-1)]

    def decode_ring(self, layer: int, prompt_len: int) -> Ring | None:
        """The contract's `decode_ring` (runtime/kv/ring.py) for a row whose prefill covered `prompt_len` tokens:
        where the decode-time keep at every step is a `first a + last b` (the compiler's `ring` fact "window": no
        decode hook reads the layer) or a `top(score, a) + last b` of decode_after_attention's paged scores over
        slots with positions ("ranked"), with no `where`, counts equal per KV head that read nothing of the row
        but its prompt (a role's keep on a cache layer of one KV head of the role, DuoAttention's streaming heads,
        is a window), and the prefill keeps at most a + b: (a, a + b + 1, ranked); else None. The engine skips a
        ringed row's step end, so rings are all or nothing: None for every layer unless each one that evicts
        rings."""
        key = (self.evict_interval, self.budget.num_layers, prompt_len)  # both set before the engine asks (`bind`)
        rings = self._rings.get(key)
        if rings is None:
            rings = [self._ring_of(n, prompt_len) for n in range(self.budget.num_layers)]
            rings = rings if all(r is not False for r in rings) else [None] * len(rings)
            if len(self._rings) >= MEMO_LIMIT:
                self._rings.clear()
            self._rings[key] = rings
        return rings[layer]

    def _ring_of(self, layer: int, prompt: int) -> Ring | None | bool:
        """`decode_ring`'s answer for one layer; None where the layer's keep never drops a token at decode (a
        head outside the role), False where it evicts but cannot ring."""
        facts, hook = self.decoding, self.decoding.keep_hook
        if hook is None:
            return None
        form = facts.keep.get("ring")
        if (self.evict_interval != 1 or facts.keep["where"] or facts.head_counts or form is None
                or set(facts.keep.get("keep_symbols", ["step"])) - {"layer", "prompt"}
                or Hook.DECODE_BEFORE_ATTENTION in self.hooks):
            return False
        if form == "window" and (facts.keep["inputs"] or Hook.DECODE_AFTER_ATTENTION in self.hooks):
            return False
        if form == "ranked" and not (hook == "decode_after_attention" and facts.scores_plane is not None
                                     and self._ranks_in_place()):
            return False
        kv_heads, huge = self.budget.num_kv_heads, max(1 << 20, 16 * prompt)  # more than the keep of a row
        if self._role_keep(hook):  # per-head counts: only a cache layer of one KV head, of the role, rings
            heads = self.roles.heads(hook, layer)
            if not any(heads):
                return None  # no head of the role: nothing evicted
            kept = self.roles.static_count(hook, layer) if self.kv_head_layers and all(heads) else None
        else:  # the count of a layer storing more than it keeps: the keep's, at this prompt
            kept = self.decode_kept(huge, prompt, huge + prompt, layer, kv_heads)
        if kept is None or self.budget.kept(prompt, layer) > kept:
            return False  # counts that depend on the row, or a prefill that keeps more than the window
        if kept >= huge:
            return None  # keeps every token
        return Ring(kept - self._tail(hook, layer, huge, prompt), kept + 1, form == "ranked")

    def _tail(self, hook: str, layer: int, length: int, prompt: int) -> int:
        sym = decode_sym(layer, self.budget.num_layers, length, length + prompt, prompt, None,
                         self.budget.num_kv_heads, None)
        return int(self.kept_tail(hook, sym, length))

    def _ranks_in_place(self) -> bool:
        """Does the KV spec record each slot's position (a ranked ring breaks ties to the older token by it)?"""
        if self._positions_recorded is None:
            self._positions_recorded = self.kv_spec(1, 8, torch.float32, 16).positions is not None
        return self._positions_recorded

    def _due(self, length: int, count: int) -> bool:
        """Does a row storing `length` tokens, of which the keep leaves `count`, evict at this step:
        has it grown `evict_interval` tokens past the count (N = 1: whenever the keep drops any)."""
        return length >= count + self.evict_interval

    def decode_bound(self, prompt_len: int, physical: int, layer: int) -> int:
        """The most a layer holds during a decode step once `physical` tokens (prefill kept +
        generated) would be stored without decode-time eviction. The first step holds the prefill's
        kept tokens plus its own; later ones at most the decode keep's count at `physical` plus
        `evict_interval` (the step's token, and the N - 1 a row keeps between evictions; counts grow
        with length, so no earlier step held more). A keep `where step % n == 0` (`keep_period`) runs
        every n steps: the prefill's kept tokens plus the first n steps', then its count plus the
        steps to the next run at or past N. Any other `where` may skip steps: no bound then."""
        hook = self.decoding.keep_hook
        if hook is None or physical <= 0:
            return physical
        gap, first_gap, context = self.evict_interval, 1, prompt_len
        if self.decoding.keep["where"]:
            period = self.keep_period(hook)
            if period is None:
                return physical
            gap = first_gap = period * -(-self.evict_interval // period)
            context = prompt_len + period  # a step at which the keep runs
        prefill_kept = self.budget.kept(prompt_len, layer)
        first = prefill_kept + min(first_gap, physical - prefill_kept)
        kept = self.decode_kept(physical, prompt_len, context, layer, self.budget.num_kv_heads)
        return min(physical, max(first, kept + gap))

    # ---- one row ---------------------------------------------------------------------------------
    def step_end(self, layer: int, view: StepView) -> KeepPlan | None:
        key = (view.seq_id, layer)
        length, kv_heads = view.cache.length, view.cache.num_kv_heads
        pending = self.seqs.pending.pop(key, None)
        if self.decoding.keep_hook is None:
            return None
        if self._role_keep(self.decoding.keep_hook):  # per-head counts (roles.py): due when a head drops N
            sym = self._step_sym(layer, view, kv_heads)
            hook = self.decoding.keep_hook
            return self.roles.plan(hook, layer, sym, view.cache, self.kept_tail(hook, sym, length),
                                   self.evict_interval)
        if self.decoding.head_counts:
            return self._step_end_heads(layer, view)
        count = self.decode_kept(length, view.prompt_len, view.context_len, layer, kv_heads)
        if not self._due(length, count):
            return None
        sym = self._step_sym(layer, view, kv_heads)
        if self.decoding.paged:
            return self._step_end_paged(view, count, sym)
        return self._step_end_row(layer, view, count, sym, pending)

    def _step_sym(self, layer: int, view: StepView, kv_heads: int) -> dict[str, Any]:
        return decode_sym(layer, self.budget.num_layers, view.cache.length, view.context_len, view.prompt_len, None,
                          kv_heads, view.cache.store.head_dim("k"), view.cache.starts)

    def _step_end_heads(self, layer: int, view: StepView) -> KeepPlan | None:
        """A keep with per-head counts (`top(..., across kv_head)`, Ada-KV's): head h's own tokens are slots
        [starts[h], length), which the scores and the selection see alone (`sym["starts"]`); due where a
        head would drop `evict_interval` or more of them. Counts stay on the CPU (host facts)."""
        cache = view.cache
        period = self.keep_period(self.decoding.keep_hook) if self.decoding.keep["where"] else None
        if period is not None and (view.context_len - view.prompt_len) % period:
            return None  # a periodic keep's `where` does not hold: no scores to compute
        sym = self._with_spans(view, self._step_sym(layer, view, cache.num_kv_heads))
        scores = self.decoding.step_scores(CacheInputs(cache), {}, sym, self.params)
        return keep_plan_if_due(self._select_fn(scores, sym, self.params), cache.length, cache.starts,
                                self.evict_interval, cache.device,
                                self.kept_tail(self.decoding.keep_hook, sym, cache.length))

    def _with_spans(self, view: StepView, sym: dict[str, Any]) -> dict[str, Any]:
        """`sym` with each text partition the keep reads (the compiler's `spans`): `sym[P]` [Hkv, length] int64,
        the span of each stored slot (from the slot's recorded position), -1 below a head's start."""
        names = self.decoding.keep.get("spans") or {}
        if not names:
            return sym
        if view.spans is None:
            raise RuntimeError(f"method {self.name!r} reads the spans of its tokens' text, which the engine did not "
                               "give (no tokenizer)")
        cache = view.cache
        positions = cache.positions()
        below = None
        if cache.starts is not None:
            starts = torch.as_tensor(cache.starts, device=positions.device)[:, None]
            below = torch.arange(cache.length, device=positions.device)[None, :] < starts
        out = dict(sym)
        for name in names:
            index = torch.as_tensor(view.spans(name), device=positions.device)
            spans = index[positions.clamp(0, len(index) - 1)]
            out[name] = spans if below is None else spans.masked_fill(below, -1)
        return out

    def _step_end_paged(self, view: StepView, count: int, sym: dict) -> KeepPlan:
        """step_end over the planes: the scores (or the state) of the stored slots; compaction moves
        the planes with K/V, so nothing is gathered here."""
        cache = view.cache
        planes = self.seqs.planes(cache.store)
        if self.decoding.keep_hook == "decode_after_attention":
            scores = cache.read_plane(planes[self.decoding.scores_plane])
        else:
            state = {name: cache.read_plane(planes[name]) for name in self.seqs.states}
            scores = self.decoding.step_scores(CacheInputs(cache), state, sym, self.params)
        return self._plan(self._select_fn(scores, sym, self.params), count, sym, cache)

    def _step_end_row(self, layer: int, view: StepView, count: int, sym: dict,
                      pending: torch.Tensor | None = None) -> KeepPlan:
        """step_end of one row over its dict state, its count and symbols known: the keep's scores
        (decode_after_attention's `pending` ones, or step_end's own), the plan, and the state
        gathered to the kept tokens."""
        key = (view.seq_id, layer)
        decode = self.seqs.decode
        state = decode.get(key)
        if state is None:
            state = self.seqs.new(view.cache.num_kv_heads, view.cache.device)
        if self.decoding.keep_hook == "decode_after_attention":
            if pending is None:
                raise RuntimeError(f"method {self.name!r}: step_end without decode_after_attention's scores")
            scores = pending
        else:
            scores = self.decoding.step_scores(CacheInputs(view.cache), state, sym, self.params)
        plan = self._plan(self._select_fn(scores, sym, self.params), count, sym, view.cache)
        if key in decode:
            decode[key] = gather_state(state, view.cache.length, plan.indices, plan.indices.device)
        return plan

    def _plan(self, kept: list[torch.Tensor], count: int, sym: dict, cache: LayerCacheView) -> KeepPlan:
        indices = stacked(kept, cache.device)
        if indices.shape[1] != count:
            raise RuntimeError(f"method {self.name!r}: selection kept {indices.shape[1]}, its count says {count}")
        return KeepPlan(indices, tail=self.kept_tail(self.decoding.keep_hook, sym, cache.length))

    # ---- a decode batch --------------------------------------------------------------------------
    def step_end_batch(self, layer: int, views: Seq[StepView]) -> list[KeepPlan | None]:
        """`step_end` of every view, in order, grouped by equal symbols (module docstring). A
        group's rows share their plan's tensor: one plan object (symbols alone), or `StackedPlan`
        rows of one stacked selection, so the engine moves one tensor per group, not per row."""
        if self._group_mode is None or len(views) < 2:
            return [self.step_end(view.layer, view) for view in views]
        plans: list[KeepPlan | None] = [None] * len(views)
        if isinstance(views, StepViews):  # the rows' facts as arrays: no view made to group them
            # rows that agree on what the selection reads share it (one layer: one store); rows over score
            # planes group by length alone: one read of their planes, a selection per `_sym_groups`
            groups = row_groups(views.lengths[:, None] if self._group_mode == "planes" else self._read_facts(views))
            if len(groups) == 1:  # the common case (a decode batch in step): one group
                return self._step_end_group(layer, views)
        else:
            keys = [(view.cache.length, view.context_len, view.prompt_len, id(view.cache.store))  # the store: shapes
                    for view in views]
            if keys.count(keys[0]) == len(keys):
                return self._step_end_group(layer, views)
            by_key: dict = {}
            for i, key in enumerate(keys):
                by_key.setdefault(key, []).append(i)
            groups = list(by_key.values())
        for rows in groups:
            if len(rows) == 1:
                view = views[rows[0]]
                plans[rows[0]] = self.step_end(view.layer, view)
                continue
            group = views.subset(rows) if isinstance(views, StepViews) else [views[i] for i in rows]
            lead = group.layer if isinstance(group, StepViews) else group[0].layer
            for i, plan in zip(rows, self._step_end_group(lead, group)):
                plans[i] = plan
        return plans

    def _group_symbols(self) -> frozenset[str]:
        """The decode symbols besides the length (`context`) that the keep's counts, ranges and `where`
        read (the compiler's hook fact `keep_symbols`; all of them where a manifest has none): rows of one
        length that agree on them get the same plan (a StreamingLLM or TOVA batch is one group whatever its
        prompts; H2O's fractions of the prompt are not)."""
        keep = self.decoding.keep
        read = set(keep.get("keep_symbols", ("prompt", "step")))
        if self._group_mode == "inputs":  # the stacked scores read their own symbols too
            read |= set(keep.get("score_symbols", ("prompt", "step")))
        return frozenset(read) & {"prompt", "step"}

    def _read_facts(self, views: StepViews) -> np.ndarray:
        """[n, k]: each row's length and the symbols its selection reads (`_group_symbols`)."""
        read = self._group_symbols()
        return np.stack([views.lengths] + ([views.prompts] if "prompt" in read else [])
                        + ([views.contexts - views.prompts] if "step" in read else []), axis=1)

    def _sym_groups(self, views: Seq[StepView]) -> list[list[int]]:
        """Rows of one length as groups that agree on what the selection reads (all of them: one group)."""
        if not isinstance(views, StepViews) or not self._group_symbols():
            return [list(range(len(views)))]
        return row_groups(self._read_facts(views))

    def _step_end_group(self, layer: int, views: Seq[StepView]) -> list[KeepPlan | None]:
        """step_end of rows of one length: one selection per group of them that agrees on what it reads
        (`_sym_groups`), over score planes read (and sorted by position) once for all of them."""
        if self._group_mode == "inputs":
            return self._step_end_stacked(layer, views)
        first = views[0]
        seq_ids = views.seq_ids if isinstance(views, StepViews) else [view.seq_id for view in views]
        pending = self.seqs.pending
        if pending:
            for seq_id in seq_ids:
                pending.pop((seq_id, layer), None)
        cache = first.cache
        length, kv_heads = cache.length, cache.num_kv_heads
        if self._group_mode == "symbolic":  # the same scores, so the same plan (one object) for every row
            count = self.decode_kept(length, first.prompt_len, first.context_len, layer, kv_heads)
            if not self._due(length, count):
                return [None] * len(views)
            sym = self._step_sym(layer, first, kv_heads)
            plan = self._step_end_row(layer, first, count, sym)
            decode = self.seqs.decode
            if decode:
                for seq_id in seq_ids[1:]:
                    key = (seq_id, layer)
                    if key in decode:  # no state: the per-row path would store an empty dict
                        decode[key] = {}
            return [plan] * len(views)
        planes = self.seqs.planes(cache.store)
        tables = views.tables if isinstance(views, StepViews) else [view.cache.page_ids for view in views]
        scores = read_rows(planes[self.decoding.scores_plane], tables, length)
        order = None
        if cache.store.spec.in_place:  # slots out of time order (runtime/kv/slot_order.py)
            order = slot_order.order(read_rows(cache.store[cache.store.spec.positions], tables, length))
            scores = slot_order.in_order(scores, order)
        out: list[KeepPlan | None] = [None] * len(views)
        for members in self._sym_groups(views):
            lead = views[members[0]]
            count = self.decode_kept(length, lead.prompt_len, lead.context_len, layer, kv_heads)
            if not self._due(length, count):
                continue
            sym = self._step_sym(layer, lead, kv_heads)
            part = scores if len(members) == len(views) else scores[to_device(members, scores.device)]
            rows = len(members) * kv_heads
            kept = self._select_fn(part.reshape(rows, length), {**sym, "kv_heads": rows}, self.params)
            indices = stacked(kept, cache.device)
            if indices.shape != (rows, count):
                raise RuntimeError(f"method {self.name!r}: the stacked selection kept {tuple(indices.shape)}, "
                                   f"its count says ({rows}, {count})")
            tail = self.kept_tail(self.decoding.keep_hook, sym, length)
            stack = indices.view(len(members), kv_heads, count)
            for g, i in enumerate(members):
                out[i] = StackedPlan(stack, g, tail, order, order_row=i)
        return out

    def _step_end_stacked(self, layer: int, views: Seq[StepView]) -> list[KeepPlan | None]:
        """step_end of rows of one length that agree on what the keep reads, its score head-local (the
        compiler's `head_local`): the rows' keys and query windows stacked as the heads of one call of the
        generated scores and selection, a chunk of rows at a time (`StackedRows`), one stack of kept
        indices for all. Where the keys are encoded or a row has no query window: per row."""
        first = views[0]
        length, kv_heads = first.cache.length, first.cache.num_kv_heads
        count = self.decode_kept(length, first.prompt_len, first.context_len, layer, kv_heads)
        if not self._due(length, count):
            return [None] * len(views)
        rows = StackedRows.of(views, self.decoding.keep["inputs"])
        if rows is None:
            return [self.step_end(view.layer, view) for view in views]
        sym = self._step_sym(layer, first, kv_heads)
        fused = self._kernel("step_end", rows.device)  # the keep's score as one Triton kernel (compiler/fusion.py)

        def kept(lo: int, hi: int) -> torch.Tensor:
            stacked_sym = {**sym, "kv_heads": (hi - lo) * kv_heads}
            inputs = rows.inputs(lo, hi)
            if fused is not None:  # no [rows x heads, queries, keys] attention in memory, no copy of the keys
                scores = fused(inputs["q"], rows.paged_keys(lo, hi), self.params, {})
            else:
                scores = self.decoding.step_scores(inputs, {}, stacked_sym, self.params)
            return stacked(self._select_fn(scores, stacked_sym, self.params), rows.device)

        stack = rows.map(kept, self._row_bytes).view(len(views), kv_heads, -1)
        if stack.shape[2] != count:
            raise RuntimeError(f"method {self.name!r}: the stacked selection kept {stack.shape[2]}, its count "
                               f"says {count}")
        tail = self.kept_tail(self.decoding.keep_hook, sym, length)
        return [StackedPlan(stack, g, tail, rows.order) for g in range(len(views))]


def row_groups(facts: np.ndarray) -> list[list[int]]:
    """The rows of `facts [n, k]` with equal facts, as lists of row indices in order of first appearance
    (one list where every row agrees)."""
    if (facts == facts[0]).all():
        return [list(range(len(facts)))]
    _, first, inverse = np.unique(facts, axis=0, return_index=True, return_inverse=True)
    groups: list[list[int]] = [[] for _ in first]
    for i, key in enumerate(inverse.reshape(-1).tolist()):
        groups[key].append(i)
    return [groups[key] for key in np.argsort(first, kind="stable")]


def group_mode(facts: DecodeFacts, stateful: bool) -> str | None:
    """How `step_end_batch` batches a group of rows with equal symbols: "symbolic" (scores from the
    symbols alone: one selection, one plan for all), "planes" (scores in a plane, row-wise
    selection: one stacked selection), "inputs" (a head-local score over q/k/v: the rows stacked as the
    heads of one scoring and selection, `StackedRows`), or None (per row)."""
    if facts.keep_hook is None:
        return None
    if facts.keep_hook == "step_end" and not facts.keep["inputs"] and not stateful and not facts.paged:
        return "symbolic"
    if facts.keep_hook == "decode_after_attention" and facts.paged and facts.keep.get("rowwise_select"):
        return "planes"
    if facts.keep_hook == "step_end" and facts.keep.get("head_local") and not stateful and not facts.paged:
        return "inputs"
    return None


def read_rows(plane: torch.Tensor, tables: list[list[int]] | np.ndarray, n: int) -> torch.Tensor:
    """The state of slots [0, n) of several sequences' layer: [G, Hkv, n] float32, row g equal to
    `state_planes.read(plane, tables[g], n)`. The tables (lists, or a [G, W] array of store indices
    whose rows hold at least the pages n needs) go to the device in one array."""
    page_size = plane.shape[2]
    pages = -(-n // page_size)
    if isinstance(tables, np.ndarray):
        if tables.shape[1] < pages:
            raise ValueError(f"tables of {tables.shape[1]} pages of {page_size} slots cannot hold {n} tokens")
        ids = np.ascontiguousarray(tables[:, :pages], dtype=np.int64)
    else:
        if any(len(table) < pages for table in tables):
            raise ValueError(f"a table of fewer than {pages} pages of {page_size} slots cannot hold {n} tokens")
        flat = itertools.chain.from_iterable(table if len(table) == pages else table[:pages] for table in tables)
        ids = np.fromiter(flat, dtype=np.int64, count=len(tables) * pages).reshape(len(tables), pages)
    return slot_order.read_rows(plane, ids, np.full(len(ids), n))


def stacked(kept: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The generated selection's per-row index tensors (equal lengths) as one [rows, kept] int64
    tensor on `device`: one stack, one move (not one per row); a selection that kept them stacked
    (`KeptRows`) gives its tensor."""
    whole = getattr(kept, "stack", None)
    if whole is not None:
        return whole.to(device=device, dtype=torch.long)
    return torch.stack(kept).to(device=device, dtype=torch.long)


class CacheInputs(dict):
    """A step_end hook's inputs: `k` / `v` are dense copies of the layer's cache ([Hkv, n, D]), `q` the row's
    newest queries ([Hq, window, D], oldest first: runtime/kv/query_window.py); float32 on the CPU, the reference
    precision; each made only if the hook reads it."""

    def __init__(self, cache: LayerCacheView) -> None:
        super().__init__()
        self._cache = cache
        self.device = cache.device  # where the scores go (`no_scores`), without reading the cache

    def __missing__(self, name: str) -> torch.Tensor:
        if name not in ("k", "v", "q"):
            raise KeyError(name)
        value = {"k": self._cache.keys, "v": self._cache.values, "q": self._cache.queries}[name]()
        self[name] = value = value.float() if value.device.type == "cpu" else value
        return value
