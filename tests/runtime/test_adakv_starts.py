"""Ada-KV scoring a layer that is already stored with per-head counts (a continued chain): each
KV head is scored over its own slots [start_h, length), padding is never kept, and with every
start at 0 the per-head path gives exactly the joint scores (`CompiledMethod._scores_per_head`)."""

from __future__ import annotations

import torch

from kvc.runtime.kv.spec import dense_spec
from kvc.runtime.kv.store import KVStore
from kvc.runtime.method_api import LayerCacheView, PrefillView
from kvc.runtime.methods import resolve_method

HEADS, KV_HEADS, PAGE, DIM = 4, 2, 4, 8


def _view(length: int, starts, seed: int = 0) -> PrefillView:
    g = torch.Generator().manual_seed(seed)
    pages = -(-length // PAGE)
    k = torch.randn(pages, KV_HEADS, PAGE, DIM, generator=g)
    v = torch.randn(pages, KV_HEADS, PAGE, DIM, generator=g)
    q = torch.randn(length, HEADS, DIM, generator=g)
    cache = LayerCacheView(KVStore.from_tensors(dense_spec(DIM, k.dtype), {"k": k, "v": v}, 1), list(range(pages)),
                           length, starts)
    return PrefillView(seq_id=1, layer=0, num_layers=1, q=q, k=q[:, :KV_HEADS], v=q[:, :KV_HEADS],
                       start=0, prompt_len=length, cache=cache)


def _plan(method, view):
    method.release(1)
    plan = method.prefill_end(0, view)
    rows = plan.indices.tolist()
    lengths = [len(r) for r in rows] if plan.lengths is None else plan.lengths.tolist()
    return [r[:n] for r, n in zip(rows, lengths)]


def test_zero_starts_score_like_the_joint_path():
    method = resolve_method("adakv", {"budget": 9, "window": 3, "kernel": 3})
    method.bind(1, KV_HEADS)
    joint = _plan(method, _view(30, None))
    per_head = _plan(method, _view(30, [0, 0]))
    assert per_head == joint


def test_padding_slots_never_kept_and_heads_scored_alone():
    method = resolve_method("adakv", {"budget": 9, "window": 3, "kernel": 3, "alpha": 1.0})
    method.bind(1, KV_HEADS)
    starts = [7, 0]
    kept = _plan(method, _view(30, starts, seed=1))
    for head, start in enumerate(starts):
        assert kept[head] and min(kept[head]) >= start
        assert kept[head][-3:] == [27, 28, 29]  # the window stays, in every head
    # head 0 scored alone over its own 23 slots picks what a 1-KV-head layer of those tokens picks
    view = _view(30, starts, seed=1)
    own = method._scores_per_head(view, view.q[-3:].transpose(0, 1), view.cache.keys(),
                                  {}, method._sym(view, HEADS, KV_HEADS, DIM, 30), starts)
    assert torch.isinf(own[0, :7]).all() and torch.isfinite(own[0, 7:-3]).all()
