"""The pieces under Ada-KV serving, one at a time: `KeepPlan.from_heads`, right-aligned
compaction of per-head variable counts (`runtime/kv/compaction.py`), and the admission bound
(`held_tokens`, compiler/budgets.py) never below what the generated selection really keeps."""

from __future__ import annotations

import pytest
import torch

from kvc.runtime.kv.compaction import compact_layer
from kvc.runtime.method_api import KeepPlan


def test_keep_plan_from_heads():
    equal = KeepPlan.from_heads([torch.tensor([0, 2]), torch.tensor([1, 3])])
    assert equal.lengths is None and equal.kept == 2 and equal.indices.tolist() == [[0, 2], [1, 3]]
    ragged = KeepPlan.from_heads([torch.tensor([4]), torch.tensor([0, 1, 5]), torch.tensor([], dtype=torch.long)])
    assert ragged.lengths.tolist() == [1, 3, 0] and ragged.kept == 3
    assert ragged.indices.shape == (3, 3) and ragged.indices[1].tolist() == [0, 1, 5]


def _pool(num_pages=6, heads=3, page=4, dim=2):
    # slot value = 1000 * page + 100 * head + 10 * offset + channel: every read is recognisable
    idx = torch.arange(num_pages)[:, None, None, None] * 1000 + torch.arange(heads)[None, :, None, None] * 100
    idx = idx + torch.arange(page)[None, None, :, None] * 10 + torch.arange(dim)[None, None, None, :]
    return idx.float(), -idx.float()


def _token(cache, pages, head, pos, page=4):
    return cache[pages[pos // page], head, pos % page]


@pytest.mark.parametrize("in_place_overlap", [False, True])
def test_right_aligned_compaction(in_place_overlap):
    k, v = _pool()
    k0, v0 = k.clone(), v.clone()
    pages = [5, 2, 0, 3] if in_place_overlap else [1, 4, 3]
    length = 13 if in_place_overlap else 11
    kept = [torch.tensor([0, 3, 7, 9, 10]), torch.tensor([10]), torch.tensor([1, 2, 4, 8, 9, 10, 6])[:6].sort().values]
    plan = KeepPlan.from_heads(kept)
    physical = compact_layer(k, v, pages, length, plan.indices, plan.lengths)
    assert physical == 6
    for h, tokens in enumerate(kept):
        start = physical - len(tokens)
        for j, pos in enumerate(tokens.tolist()):
            assert torch.equal(_token(k, pages, h, start + j), _token(k0, pages, h, pos))
            assert torch.equal(_token(v, pages, h, start + j), _token(v0, pages, h, pos))
    other = [p for p in range(6) if p not in pages]
    assert torch.equal(k[other], k0[other])  # pages of other sequences untouched


def test_equal_counts_keep_the_old_layout():
    k, v = _pool()
    k0 = k.clone()
    pages = [2, 5]
    keep = torch.tensor([[1, 4, 6], [0, 2, 7], [3, 5, 6]])
    assert compact_layer(k, v, pages, 8, keep) == 3
    for h in range(3):
        for j, pos in enumerate(keep[h].tolist()):
            assert torch.equal(_token(k, pages, h, j), _token(k0, pages, h, pos))


def test_bad_plans_are_rejected():
    k, v = _pool()
    keep = torch.tensor([[0, 1], [2, 3], [4, 5]])
    with pytest.raises(ValueError, match="lengths"):
        compact_layer(k, v, [0, 1], 8, keep, torch.tensor([1, 3, 0]))
    with pytest.raises(ValueError, match="outside"):
        compact_layer(k, v, [0, 1], 5, keep, torch.tensor([2, 2, 2]))
    # padding past a head's length is ignored, even out of range
    assert compact_layer(k, v, [0, 1], 5, torch.tensor([[0, 99], [2, 3], [4, 99]]), torch.tensor([1, 2, 1])) == 2


def test_held_tokens_bounds_every_head():
    """The generated adakv `held_tokens` is at least the most-keeping head's count on score
    patterns that concentrate the budget on one head, and snapkv's equals its kept count."""
    from kvc.kernels_generated.adakv import hooks, torch_lowering
    from kvc.kernels_generated.snapkv import hooks as snap_hooks

    g = torch.Generator().manual_seed(3)
    for kv_heads, length, params in [(2, 101, {"budget": 24, "window": 4, "kernel": 5, "alpha": 0.425}),
                                     (4, 300, {"budget": 40, "window": 8, "kernel": 1, "alpha": 0.2}),
                                     (8, 200, {"budget": 20, "window": 4, "kernel": 1, "alpha": 0.0})]:
        bound = hooks.held_tokens(length, 0, 2, kv_heads, {**hooks.DEFAULTS, **params})
        average = hooks.kept_tokens(length, 0, 2, kv_heads, {**hooks.DEFAULTS, **params})
        assert average < bound <= length
        worst = 0
        for trial in range(6):
            scores = torch.rand(kv_heads, length, generator=g)
            scores[trial % kv_heads] += 10.0  # one head outscores all others
            scores[:, length - params["window"]:] = float("-inf")
            kept = torch_lowering.select(scores, length, params=params)
            worst = max(worst, max(len(t) for t in kept))
        assert worst == bound  # the bound is reached: it is tight, not only safe
    snap = {"budget": 32, "window": 8}
    assert snap_hooks.held_tokens(100, 0, 2, 2, {**snap_hooks.DEFAULTS, **snap}) == \
        snap_hooks.kept_tokens(100, 0, 2, 2, {**snap_hooks.DEFAULTS, **snap}) == 32


def test_compiled_budget_reserves_the_most_keeping_head():
    from kvc.runtime.methods import resolve_method

    m = resolve_method("adakv", {"budget": 24, "window": 4, "alpha": 0.425})
    m.bind(2, 2)
    # a head may take 2 * 20 - 8 picks besides the window: 36 slots, not the average 24
    assert m.budget.steady_tokens(101, 101, 0) == 4 + 32
    assert m.budget.steady_tokens(101, 111, 1) == 36 + 10
    assert m.budget.steady_tokens(20, 25, 0) == 25
    assert m.budget.peak_tokens(101, 0) == 101


def _ragged_reference(scores, starts, length, *, last, count, at_least):
    """Per-head-count keep over heads holding slots [start_h, length), from the definition: each head's
    newest `last` forced, its `at_least` best others, then the best others of any head (flattened
    head-major, ties to the lower head and older slot) up to `count`."""
    heads = scores.shape[0]
    own = [[slot for slot in range(starts[h], length - min(last, length - starts[h]))] for h in range(heads)]
    kept = [set(range(max(starts[h], length - last), length)) for h in range(heads)]
    for h in range(heads):
        best = sorted(own[h], key=lambda slot: (-float(scores[h, slot]), slot))[: min(at_least, len(own[h]))]
        kept[h] |= set(best)
    rest = [(h, slot) for h in range(heads) for slot in own[h] if slot not in kept[h]]
    room = min(count, sum(map(len, own))) - sum(min(at_least, len(o)) for o in own)
    for h, slot in sorted(rest, key=lambda hs: (-float(scores[hs]), hs[0], hs[1]))[: max(0, room)]:
        kept[h].add(slot)
    return [sorted(k) for k in kept]


@pytest.mark.parametrize("seed", range(6))
def test_head_adaptive_selection_over_per_head_starts(seed):
    """`select` over a layer stored with per-head starts (a decode-time Ada-KV keep) ranks each head's own
    slots only, equal to the definition; its `meta` run bounds every head's count."""
    from kvc.runtime.primitives.torch_primitives import select

    g = torch.Generator().manual_seed(seed)
    heads, length, last = 3, 30, 4
    starts = torch.randint(0, 12, (heads,), generator=g).tolist()
    starts[int(torch.randint(0, heads, (1,), generator=g))] = 0
    scores = torch.rand(heads, length, generator=g).round(decimals=1)  # ties
    scores[:, length - last:] = float("-inf")
    count, at_least = 3 * 9, 2.5
    got = select(scores, length, heads, first=None, last=last, count=count, at_least=at_least,
                 granularity="head_adaptive", starts=starts)
    want = _ragged_reference(scores, starts, length, last=last, count=count, at_least=2)
    assert [t.tolist() for t in got] == want
    bound = select(torch.empty(heads, length, device="meta"), length, heads, first=None, last=last, count=count,
                   at_least=at_least, granularity="head_adaptive")[0].shape[0]
    assert max(len(k) for k in want) <= bound


def test_attention_over_per_head_starts():
    """The primitives' `attention` with starts: each KV head's query group attends over that head's own
    slots only, as over its keys alone."""
    from kvc.runtime.primitives.torch_primitives import attention

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 3, 8, generator=g), torch.randn(2, 10, 8, generator=g)
    probs = attention(q, k, starts=[0, 6])
    assert probs[2:, :, :6].eq(0).all()
    assert torch.allclose(probs[:2], attention(q[:2], k[:1]))
    assert torch.allclose(probs[2:, :, 6:], attention(q[2:], k[1:, 6:]))
