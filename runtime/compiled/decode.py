"""Decode-time facts of a compiled method and its `decode_after_attention` hook.

docs/design.md, "Decode-time eviction", is the design: which hooks are served, how the decode
attention hands the hook its statistics (`view.attn_stats`), and where the decode state lives
(paged state planes for a key-local hook, CUDA-graph capturable; per-row dicts otherwise, the
oracle). Everything comes from the manifest's hook facts (compiler/hook_facts.py) and the generated
lowering; nothing here knows a method by name. Step end (the keep's plans) is step_end.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvc.runtime.compiled.budget import CompiledBudget
from kvc.runtime.compiled.folder import GeneratedCode
from kvc.runtime.compiled.state import Key, SequenceStates, gather_state
from kvc.runtime.errors import ConfigError
from kvc.runtime.kv import state_planes
from kvc.runtime.kv.ring import promote
from kvc.runtime.kv.state_planes import BatchSlots
from kvc.runtime.method_api import DecodeView, Hook, KeepPlan, LayerCacheView

DECODE_KEEP_HOOKS = ("decode_after_attention", "step_end")


@dataclass(frozen=True)
class DecodeFacts:
    """What a method does while decoding (`read_decode_facts`)."""

    hooks: frozenset[Hook]  # the contract points decoding needs
    keep_hook: str | None  # the hook whose keep runs at step end
    keep: dict | None  # its facts: inputs, `where`, `rowwise_select`
    select: Callable | None  # its generated `<hook>_select`
    step_scores: Callable | None  # the generated `step_end_scores`
    after: dict | None  # decode_after_attention's facts
    after_fn: Callable | None  # its generated lowering (`_scores` when it keeps)
    paged: bool  # decode state in paged state planes (else per-row dicts)
    scores_plane: str | None  # the plane of decode_after_attention's pending scores
    planes: tuple[str, ...]  # every state plane, in the KV spec's order

    @property
    def head_counts(self) -> bool:
        """Does the decode-time keep leave different counts per KV head (the layer's heads then store
        different tokens, from per-head start slots)?"""
        return bool(self.keep and self.keep.get("head_counts"))

    @property
    def graphs(self) -> bool:
        """May decode steps be captured (nothing per row on the host while decoding)?"""
        return self.paged or Hook.DECODE_AFTER_ATTENTION not in self.hooks

    @property
    def decoding(self) -> bool:
        """Does the prefill state continue into decoding?"""
        return bool(self.hooks)


def read_decode_facts(code: GeneratedCode, use_state_planes: bool) -> DecodeFacts:
    """The decode facts of `code`'s manifest; what the engine does not serve is a ConfigError."""
    name, facts = code.name, code.facts
    before = facts.get("decode_before_attention")
    if before is not None and not before.get("reads"):
        raise ConfigError(f"method {name!r} estimates before decode attention; the engine serves "
                          "decode_before_attention of compiled methods that read (runtime/compiled/read.py)",
                          param="method")
    keeping = [h for h in DECODE_KEEP_HOOKS if facts.get(h, {}).get("keeps")]
    if len(keeping) > 1:
        raise ConfigError(f"method {name!r} keeps in both decode_after_attention and step_end; "
                          "the engine serves one decode-time keep per method", param="method")
    after = facts.get("decode_after_attention")
    unsupported = set(after["inputs"]) - {"attn"} if after else set()
    if facts.get("step_end") is not None:
        unsupported |= set(facts["step_end"]["inputs"]) & {"attn"}  # q: the rows' query windows
    if after is not None and after["keeps"] and "attn" not in after["inputs"]:
        unsupported.add("no attn (a keep that needs no attention belongs in step_end)")
    if unsupported:
        raise ConfigError(f"method {name!r}: decode hooks reading {', '.join(sorted(unsupported))} are not "
                          "served yet (decode_after_attention gets attn; step_end gets k, v and its `q[last n]`)",
                          param="method")
    if after is not None and after.get("attention") and code.attention.decode_stats is None:
        raise ConfigError(f"method {name!r} reads attention while decoding but its manifest names attention "
                          f"variant {code.attention.variant!r}, which emits no statistics; run `kvc compile --all`",
                          param="method")
    hooks: set[Hook] = {Hook.DECODE_BEFORE_ATTENTION} if before is not None else set()
    paged = bool(after is not None and after.get("key_local") and use_state_planes)
    scores_plane = "decode_after_attention.scores" if paged and after["keeps"] else None
    planes = (tuple(code.states) + ((scores_plane,) if scores_plane else ())) if paged else ()
    after_fn = None
    if after is not None:
        hooks.add(Hook.DECODE_AFTER_ATTENTION)
        after_fn = code.required("decode_after_attention" + ("_scores" if after["keeps"] else ""))
    keep_hook = select = step_scores = None
    if keeping:
        keep_hook = keeping[0]
        select = code.required(f"{keep_hook}_select")
        if facts[keep_hook].get("head_counts") and (code.states or keep_hook != "step_end"):
            raise ConfigError(f"method {name!r} keeps per-head counts while decoding from state or attention "
                              "statistics; the engine serves a per-head-count keep in a stateless step_end",
                              param="method")
        step_scores = code.optional("step_end_scores")
        hooks.add(Hook.STEP_END)
    if paged:
        # a decode step writes the planes of every stored slot; a method listing STEP_END gets
        # spare pages for each shared one (Scheduler._copies), which the runner copies first
        hooks.add(Hook.STEP_END)
    return DecodeFacts(frozenset(hooks), keep_hook, facts[keep_hook] if keep_hook else None, select, step_scores,
                       after, after_fn, paged, scores_plane, planes)


def without_idle_keep(facts: DecodeFacts, code: GeneratedCode, params: dict[str, Any]) -> DecodeFacts:
    """`facts` as if the method had no decode-time keep where that keep's period is 0 for these
    parameters: a keep `where every > 0 and step % every == 0` with every = 0, a decode budget that a
    parameter switches off (the compiler's KEEP_PERIODS), so the method decodes exactly as one without."""
    period = code.keep_periods.get(facts.keep_hook) if facts.keep_hook else None
    if period is None or int(period(params)) > 0:
        return facts
    hooks = facts.hooks if facts.paged else facts.hooks - {Hook.STEP_END}
    return dataclasses.replace(facts, hooks=frozenset(hooks), keep_hook=None, keep=None, select=None,
                               step_scores=None)


class DecodeHooks:
    """The prefill state's handover into decoding (`start`, after prefill_end) and
    `decode_after_attention` (`after_attention`), over `seqs`' dicts or planes."""

    def __init__(self, name: str, params: dict[str, Any], facts: DecodeFacts, seqs: SequenceStates,
                 budget: CompiledBudget, code: GeneratedCode) -> None:
        self.name, self.params, self.facts, self.seqs, self.budget = name, params, facts, seqs, budget
        self.states, self.decode_stats = code.states, code.attention.decode_stats

    def start(self, key: Key, state: dict[str, torch.Tensor], cache: LayerCacheView, plan: KeepPlan | None) -> None:
        """After prefill_end: the prefill state continues into decoding, gathered to the kept tokens
        (dicts), or written into the planes at the stored slots, which compaction then moves with
        K/V (the runner owns the layer's pages before prefill_end)."""
        if not self.facts.decoding:
            return
        self.seqs.pending.pop(key, None)
        length, device = cache.length, cache.device
        if not self.facts.paged:
            self.seqs.decode[key] = gather_state(state, length, None if plan is None else plan.indices, device)
            return
        planes = self.seqs.planes(cache.store)
        full = gather_state(state, length, None, device)  # every stored slot, new keys at 0
        for name in self.states:
            value = torch.nn.functional.pad(full[name], (0, length - full[name].shape[-1]))
            state_planes.write(planes[name], cache.page_ids, value)
        self.seqs.in_pages.add(key)

    def after_attention(self, layer: int, view: DecodeView) -> None:
        """The hook over the step's decode rows (a ranked ring's rows hand their leaving slots to the ranking,
        `view.ring_leave`: runtime/kv/ring.py `promote`)."""
        if self.facts.paged:
            self._after_paged(layer, view)
            return
        if view.rows is None:
            raise RuntimeError(f"method {self.name!r} needs eager decode steps (decode_graphs is False)")
        kv_heads = view.k.shape[1]
        attn = view.attn_stats  # [B, R, W], emitted by the decode attention
        if attn is None and self.decode_stats is not None:
            raise RuntimeError(f"method {self.name!r}: the decode attention emitted no statistics (view.attn_stats)")
        decode, keeps, after_fn = self.seqs.decode, self.facts.after["keeps"], self.facts.after_fn
        for b, row in enumerate(view.rows):
            key = (row.seq_id, layer)
            state = decode.get(key)
            if state is None:
                state = self.seqs.new(kv_heads, view.q.device)
            inputs = {"attn": None if attn is None else attn[b, :, : row.length]}
            sym = decode_sym(layer, self.budget.num_layers, row.length, row.context_len, row.prompt_len,
                             view.q.shape[1], kv_heads, view.q.shape[2])
            if keeps:
                self.seqs.pending[key] = after_fn(inputs, state, sym, self.params)
                decode[key] = state  # the generated scoring updates its state in place
            else:
                decode[key] = after_fn(inputs, state, sym, self.params)

    def _after_paged(self, layer: int, view: DecodeView) -> None:
        """The generated hook once over the batch, its rows' keys side by side (docs/design.md,
        "State planes and CUDA graphs"). Tensors of static shape only, no host reads: CUDA-graph
        capturable."""
        planes = self.seqs.planes(view.store)
        attn = view.attn_stats  # [B, R, W]
        if attn is None:
            raise RuntimeError(f"method {self.name!r}: the decode attention emitted no statistics (view.attn_stats)")
        batch, rows, width = attn.shape
        kv_heads = view.k.shape[1]
        some = next(iter(planes.values()))
        slots = BatchSlots.of(view.block_tables, view.context_lens, width, some.shape[2], some.shape[0] - 1)
        # the state covers the slots stored before this step; the step's own starts at 0 (`_grow`): the slot it
        # was written to, the last one or, in a decode ring, the one it replaced
        slot = torch.arange(width, device=attn.device)[None, :]
        if view.write_slots is None:
            before = slot < (view.context_lens.long() - 1)[:, None]
        else:
            before = (slot < view.context_lens.long()[:, None]) & (slots.flat(some.shape[2])
                                                                   != view.write_slots.long()[:, None])
        state = {}
        for name in self.states:
            value = torch.where(before[:, None, :], slots.gather(planes[name]), 0.0)
            state[name] = value.transpose(0, 1).reshape(kv_heads, batch * width)
        inputs = {"attn": attn.transpose(0, 1).reshape(rows, batch * width)}
        sym = {"context": batch * width, "prompt": None, "step": None, "layer": layer,
               "layers": self.budget.num_layers, "heads": view.q.shape[1], "kv_heads": kv_heads,
               "head_dim": view.q.shape[2]}
        if self.facts.scores_plane is not None:
            scores = self.facts.after_fn(inputs, state, sym, self.params)  # updates `state` in place
            slots.scatter(planes[self.facts.scores_plane], _unflatten(scores, batch, width))
        else:
            state = self.facts.after_fn(inputs, state, sym, self.params)
        for name in self.states:
            slots.scatter(planes[name], _unflatten(state[name], batch, width))
        if view.ring_leave is not None:  # a ranked ring's rows (runtime/kv/ring.py)
            if self.facts.scores_plane is None:
                raise RuntimeError(f"method {self.name!r}: a ranked decode ring needs the decode keep's scores")
            promote(view.store, view.block_tables, _unflatten(scores, batch, width), view.ring_leave,
                    view.ring_first)


def decode_sym(layer: int, layers: int, length: int, context_len: int, prompt_len: int, heads: int | None,
               kv_heads: int, head_dim: int | None, starts: list[int] | None = None) -> dict[str, Any]:
    """A decode hook's symbols: `context` the physical length ranked (the step's token included),
    `prompt` the tokens the prefill covered, `step` the decode steps so far (1 at the first);
    `starts` each KV head's first stored slot where a keep left per-head counts (None: 0)."""
    return {"context": length, "prompt": prompt_len, "step": context_len - prompt_len, "layer": layer,
            "layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "starts": starts}


def _unflatten(value: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """[Hkv, B*W] (rows side by side) -> [B, Hkv, W]."""
    return value.reshape(value.shape[0], batch, width).transpose(0, 1)
