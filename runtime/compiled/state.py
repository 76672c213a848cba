"""What a compiled method keeps per (sequence, layer), and how it follows a sequence's lifecycle.

The adapter's hooks (prefill.py, decode.py, step_end.py) read and write these stores; the
contract's lifecycle points (`turn_end` / `turn_resume` for the chain cache, `clone`, `release`)
are here. Per-token state lives either in dicts or in the KV store's paged state planes;
docs/design.md, "Decode-time eviction" (state planes, chains, clones), says which and why.
"""

from __future__ import annotations

from typing import Any

import torch

from kvc.runtime.kv import state_planes
from kvc.runtime.method_api import LayerCacheView

Key = tuple[int, int]  # (sequence id, layer)
IN_PAGES = "in pages"  # turn_end's state of a layer whose decode state stays in the record's pages


class SequenceStates:
    """The stores, keyed by (sequence, layer). `states` names the method's per-token states
    (declaration order); `planes` the store tensors holding them (and the pending scores) when the
    decode state is paged (empty: dicts)."""

    def __init__(self, method: str, states: list[str], planes: tuple[str, ...]) -> None:
        self.method, self.states, self.plane_names = method, states, planes
        self.queries: dict[Key, torch.Tensor] = {}  # the newest prefill queries [Hq, <=w, D]
        self.prefill: dict[Key, dict[str, torch.Tensor]] = {}  # prefill accumulators (H2O's column sums)
        self.decode: dict[Key, dict[str, torch.Tensor]] = {}  # decode state (dicts path)
        self.pending: dict[Key, torch.Tensor] = {}  # decode_after_attention's scores, until step end
        self.in_pages: set[Key] = set()  # whose decode state is in the planes
        self.resume_pages: set[Key] = set()  # a continuation's layers to read back at its first chunk

    def planes(self, store) -> dict[str, torch.Tensor]:
        """The store's tensors of this method's state planes, by name."""
        if store is None or any(name not in store.spec for name in self.plane_names):
            raise RuntimeError(f"method {self.method!r} keeps its decode state in the per-token tensors "
                               f"{list(self.plane_names)}, which the KV store does not hold (its spec is "
                               "not this method's kv_spec)")
        return {name: store[name] for name in self.plane_names}

    def new(self, kv_heads: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Every per-token state of zero tokens."""
        return {s: torch.zeros(kv_heads, 0, device=device) for s in self.states}

    def resumed(self, key: Key, cache: LayerCacheView, stored: int) -> dict[str, torch.Tensor] | None:
        """A continuation's state for slots [0, stored) (what the record's pages hold, cut by any
        rollback), read from the planes once, at its first prefill chunk; None when not resumed so."""
        if key not in self.resume_pages:
            return None
        self.resume_pages.discard(key)
        planes = self.planes(cache.store)
        return {name: state_planes.read(planes[name], cache.page_ids, stored) for name in self.states}

    # ---- lifecycle ---------------------------------------------------------------------------
    def turn_end(self, seq_id: int) -> dict[int, dict[str, torch.Tensor] | str]:
        """Per layer, the sequence's per-token state (decode state, or a cut-short prefill's
        accumulator), or `IN_PAGES` where it is in the state planes of the pages the chain record
        keeps; the sequence is forgotten."""
        state: dict[int, dict[str, torch.Tensor] | str] = {}
        for store in (self.prefill, self.decode):  # decode state wins: it is the newer
            for key in [key for key in store if key[0] == seq_id]:
                state[key[1]] = store.pop(key)
        state.update({layer: IN_PAGES for seq, layer in self.in_pages if seq == seq_id})
        self.release(seq_id)
        return state

    def turn_resume(self, seq_id: int, state: Any, lengths) -> None:
        """A chain's state becomes `seq_id`'s prefill accumulator (copied: forks share the record),
        cut to the physical `lengths` per layer (a rollback dropped the stored tail); a layer
        `IN_PAGES` is read back from its pages at the first prefill chunk."""
        self.release(seq_id)
        for layer, tensors in (state or {}).items():
            if tensors == IN_PAGES:
                self.resume_pages.add((seq_id, layer))
                continue
            self.prefill[seq_id, layer] = {
                name: (value[:, : lengths[layer]] if value.dim() == 2 else value).clone()
                for name, value in tensors.items()
            }

    def clone(self, src: int, dst: int) -> None:
        """`dst` gets a copy (cloned tensors) of every entry of `src`; state in the planes came with
        the copied pages, so the clone's layers are marked in pages too."""
        self.release(dst)
        for store in (self.queries, self.prefill, self.pending, self.decode):
            copy_entries(store, src, dst)
        self.in_pages.update({(dst, layer) for seq, layer in self.in_pages if seq == src})

    def release(self, seq_id: int) -> None:
        for store in (self.pending, self.decode, self.queries, self.prefill):
            for key in [key for key in store if key[0] == seq_id]:
                del store[key]
        for keys in (self.in_pages, self.resume_pages):
            keys.difference_update({key for key in keys if key[0] == seq_id})


def copy_entries(store: dict[Key, Any], src: int, dst: int) -> None:
    """store[(dst, layer)] = a copy of store[(src, layer)] for every layer src has (a tensor, or
    a dict of tensors)."""
    for (seq, layer), value in list(store.items()):
        if seq == src:
            store[dst, layer] = ({name: t.clone() for name, t in value.items()} if isinstance(value, dict)
                                 else value.clone())


def gather_state(state: dict[str, torch.Tensor], length: int, indices: torch.Tensor | None,
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
