"""Prefill-time hooks of a compiled method: `prefill_chunk` and `prefill_end`.

docs/design.md, "Compiled methods", is the design: a chunk keeps the newest `window` post-RoPE
queries per (sequence, layer) and runs a generated `prefill_chunk` hook (H2O's column sums) over
the keys stored so far; `prefill_end` scores and selects over `cache.keys()` -> `KeepPlan` (with
per-head `lengths` for a head-adaptive selection), then hands its state to decoding (decode.py).
On a GPU a hook the compiler fused into one Triton kernel runs that kernel; elsewhere the torch
lowering runs, in float32 on the CPU, a chunk hook over blocks of its queries.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvc.runtime.compiled.decode import DecodeHooks
from kvc.runtime.compiled.folder import ALL_QUERIES, GeneratedCode
from kvc.runtime.compiled.state import Key, SequenceStates
from kvc.runtime.kv.plans import keep_plan
from kvc.runtime.method_api import KeepPlan, LayerCacheView, PrefillView
from kvc.runtime.primitives.torch_primitives import attention


class PrefillHooks:
    """CompiledMethod's prefill points, as its own methods rather than a separate object: they call
    `_kernel` and `_resumed_state` through the method, so one replaced on the method (a test's spy)
    sees every call. State lives in the composed parts it reads:"""

    name: str
    params: dict[str, Any]
    code: GeneratedCode
    seqs: SequenceStates
    decoder: DecodeHooks
    window: int  # the newest prefill queries kept (ALL_QUERIES: every one; 0: none)
    fused_devices: tuple[str, ...]  # where the fused Triton kernels run
    QUERY_BLOCK_BYTES: int  # the torch path's attention matrix per block of a chunk's queries
    kept_tail: Callable[[str, dict, int], int]
    chunk_keeps: bool  # does prefill_chunk give keep plans (a keep `for ROLE`)?
    roles: Any  # RoleKeeps or None

    def prefill_chunk(self, layer: int, view: PrefillView) -> KeepPlan | None:
        """The chunk's state (and query window); a keep `for ROLE` in prefill_chunk gives its plan."""
        self._chunk_state(layer, view)
        if not self.chunk_keeps:
            return None
        sym = self._sym(view, view.q.shape[1], view.cache.num_kv_heads, view.k.shape[-1], view.cache.length)
        return self.roles.plan("prefill_chunk", layer, sym, view.cache,
                               self.kept_tail("prefill_chunk", sym, view.cache.length))

    def _chunk_state(self, layer: int, view: PrefillView) -> None:
        key = (view.seq_id, layer)
        q = operand(view.q.transpose(0, 1))  # [Hq, n, D]
        queries, accumulated = self.seqs.queries, self.seqs.prefill
        if view.start == 0:  # a new prefill (or a recompute): reset
            queries.pop(key, None)
            accumulated.pop(key, None)
        if self.window != 0:
            prev = queries.get(key)
            q_all = q if prev is None else torch.cat([prev, q], dim=1)
            queries[key] = (q_all if self.window == ALL_QUERIES else q_all[:, -self.window:]).contiguous()
        if self.code.chunk_hook is not None:
            shared = self._shared_chunk_key(layer, view)
            if shared is not None and shared in view.memo:  # another engine replaying this record computed it
                accumulated[key] = {name: value.clone() for name, value in view.memo[shared].items()}
                return
            k = operand(view.cache.keys())
            state = accumulated.get(key)
            if state is None:
                stored = view.cache.length - view.q.shape[0]
                state = self._resumed_state(key, view.cache, stored) or self.seqs.new(k.shape[0], k.device)
            fused = self._kernel("prefill_chunk", k.device)
            if fused is not None:  # no [head, query, key] matrix in memory
                accumulated[key] = fused(q, k, self.params, state)
            else:
                accumulated[key] = self._chunk_in_blocks(view, q, k, state)
            if shared is not None:
                view.memo[shared] = {name: value.clone() for name, value in accumulated[key].items()}

    def _shared_chunk_key(self, layer: int, view: PrefillView) -> tuple | None:
        """Where a replayed prefill's chunk state is shared: it depends on the recorded q/k (the
        record's memo), the generated code, the parameters the chunk hook reads (not a budget), the
        layer and the chunks so far; None when not replayed."""
        if view.memo is None:
            return None
        hook_params = self.code.hook_params
        names = sorted(self.params) if hook_params is None else hook_params.get("prefill_chunk", sorted(self.params))
        read = tuple((name, self.params[name]) for name in names)
        return ("prefill_chunk", self.fingerprint.rsplit("@", 1)[-1], read, layer, view.start, view.q.shape[0])

    def _chunk_in_blocks(self, view: PrefillView, q: torch.Tensor, k: torch.Tensor, state: dict) -> dict:
        """The torch path of a chunk hook, over blocks of the chunk's queries: each block is a
        smaller prefill chunk (its queries the newest positions of the keys up to it), which the
        contract already makes equivalent, since the engine may chunk a prompt anywhere. The
        [head, query, key] matrix of a block stays near `QUERY_BLOCK_BYTES`, instead of the whole
        chunk's (151 MB per layer for 2,048 queries over 2,048 keys at 9 heads, several passes each)."""
        heads, queries = q.shape[0], q.shape[1]
        length = k.shape[1]
        block = max(16, self.QUERY_BLOCK_BYTES // (4 * heads * length))
        for first in range(0, queries, block):
            last = min(queries, first + block)
            keys = k[:, : length - queries + last]
            attn = attention(q[:, first:last], keys, softmax=True)
            sym = self._sym(view, heads, k.shape[0], k.shape[-1], keys.shape[1])
            state = self.code.chunk_hook({"q": q[:, first:last], "k": keys, "v": None, "attn": attn}, state, sym,
                                         self.params)
        return state

    def prefill_end(self, layer: int, view: PrefillView) -> KeepPlan | None:
        key = (view.seq_id, layer)
        device = view.cache.device
        k = operand(view.cache.keys())
        kv_heads, length = k.shape[0], k.shape[1]
        q = self.seqs.queries.pop(key, None)
        if q is None:
            q = operand(view.q.transpose(0, 1))
        state = (self.seqs.prefill.pop(key, None) or self._resumed_state(key, view.cache, length - view.q.shape[0])
                 or self.seqs.new(kv_heads, device))
        sym = self._sym(view, q.shape[0], kv_heads, k.shape[-1], length)
        starts = view.cache.starts
        if starts is not None:  # a layer stored with per-head counts (a continued chain of Ada-KV)
            scores = self._scores_per_head(view, q, k, state, sym, starts)
        else:
            scores = self._end_scores(view, q, k, state, sym)
        kept = self.code.end_select(scores, sym, self.params)
        if starts is not None:  # a head never keeps its padding slots (its floor may reach them)
            kept[:] = [t[t >= start] for t, start in zip(kept, starts)]
        drop = getattr(kept, "drop", None)  # the most any head of any rank drops (HeadKeeps): one choice for all
        keeps_all = all(int(t.numel()) >= length for t in kept) if drop is None else drop <= 0
        plan = None if keeps_all else keep_plan(kept, device)
        if plan is not None:
            plan.tail = self.kept_tail("prefill_end", sym, length)
        self.decoder.start(key, state, view.cache, plan)
        return plan

    def _end_scores(self, view: PrefillView, q, k, state, sym, heads: slice = slice(None), start: int = 0):
        """prefill_end's ranking scores [kv_head, key]: the fused kernel on a GPU, else the lowering
        (values are copied out of the pages only when the hook reads them)."""
        fused = self._kernel("prefill_end", k.device)
        if fused is not None:
            return fused(q, k, self.params, state)
        v = operand(view.cache.values())[heads, start:] if self.code.end_reads_v else None
        return self.code.end_scores({"q": q, "k": k, "v": v}, state, sym, self.params)

    def _scores_per_head(self, view: PrefillView, q, k, state, sym, starts: list[int]) -> torch.Tensor:
        """Scores of a layer whose KV head h stores its tokens in slots [starts[h], length): each
        head is scored alone over its own tokens (its query group, its context), so padding takes
        no softmax mass and no pooling window; padding slots rank last (-inf)."""
        kv_heads, length = k.shape[0], k.shape[1]
        group = q.shape[0] // kv_heads
        if any(value.dim() == 2 and value.shape[-1] for value in state.values()):
            raise NotImplementedError(f"method {self.name!r}: per-token prefill state on a layer stored "
                                      "with per-head counts")
        scores = torch.full((kv_heads, length), float("-inf"), dtype=torch.float32, device=k.device)
        for head, start in enumerate(starts):
            own = k[head : head + 1, start:].contiguous()
            head_sym = {**sym, "context": length - start, "prompt": length - start, "heads": group, "kv_heads": 1}
            head_state = {name: value[head : head + 1] for name, value in state.items()}
            head_scores = self._end_scores(view, q[head * group : (head + 1) * group], own, head_state, head_sym,
                                           slice(head, head + 1), start)
            scores[head, start:] = head_scores[0].float()
        return scores

    def _sym(self, view: PrefillView, heads: int, kv_heads: int, head_dim: int, context: int) -> dict:
        return {"context": context, "prompt": context, "step": 0, "layer": view.layer,
                "layers": view.num_layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}

    def _kernel(self, hook: str, device: torch.device) -> Callable | None:
        """The fused Triton entry point computing `hook`'s scores (prefill_end) or state update
        (prefill_chunk) on a GPU, or None: on the CPU the torch lowering runs."""
        if device.type not in self.fused_devices:
            return None
        return self.code.fused(hook)

    def _resumed_state(self, key: Key, cache: LayerCacheView, stored: int) -> dict | None:
        """A chain continuation's state read back from the record's pages (`SequenceStates.resumed`)."""
        return self.seqs.resumed(key, cache, stored)


def operand(t: torch.Tensor) -> torch.Tensor:
    """A scoring operand on its own device: float32 on the CPU (the reference precision), the
    cache's dtype on a GPU (the fused kernels multiply bf16 with float32 accumulation, the torch
    lowering upcasts itself)."""
    t = t.detach()
    return t.float() if t.device.type == "cpu" else t
