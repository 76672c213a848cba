"""The reference eviction methods on hand-made tensors whose answer is known by construction.

`magnets` builds queries and keys where chosen keys soak up nearly all the attention of chosen
queries (a large shared direction), so which tokens a method must keep is obvious.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.references.eviction import (
    DEFAULTS,
    RANKINGS,
    adakv,
    adakv_safeguard,
    gather_kv,
    h2o,
    kvcache_factory_budgets,
    pyramid_budgets,
    pyramidkv,
    rank,
    select,
    snapkv,
    streamingllm,
    tova,
)

DIM = 8


def magnets(
    length: int, pulls: dict[tuple[int, int], int], num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Small random q/k, then for each (query head, query position) -> key in `pulls`, that query
    and the key (in the query head's KV head) share a strong direction, one axis per pulled key."""
    generator = torch.Generator().manual_seed(seed)
    q = 0.1 * torch.randn(num_heads, length, DIM, generator=generator)
    k = 0.1 * torch.randn(num_kv_heads, length, DIM, generator=generator)
    group = num_heads // num_kv_heads
    axes = {key: axis for axis, key in enumerate(sorted(set(pulls.values())))}
    assert len(axes) <= DIM, "one axis per pulled key"
    for (head, query), key in pulls.items():
        q[head, query, axes[key]] = 6.0
        k[head // group, key, axes[key]] = 6.0
    return q, k


def pull_all(queries: range, key: int, heads: range = range(4)) -> dict[tuple[int, int], int]:
    return {(h, t): key for h in heads for t in queries}


def test_streamingllm_keeps_sinks_and_recent() -> None:
    q, k = magnets(20, {})
    assert streamingllm(q, k, budget=10).tolist() == [[0, 1, 2, 3, 14, 15, 16, 17, 18, 19]] * 2
    assert streamingllm(q, k, budget=3, n_sink=3).tolist() == [[0, 1, 2]] * 2
    assert streamingllm(q, k, budget=20).tolist() == [list(range(20))] * 2
    with pytest.raises(ValueError, match="n_sink"):
        streamingllm(q, k, budget=3)


def test_snapkv_keeps_the_key_the_window_attends_to_and_the_window() -> None:
    length, window = 30, 8
    q, k = magnets(length, pull_all(range(length - window, length), key=5))
    kept = snapkv(q, k, budget=window + 1, window=window, kernel=1)
    assert kept.tolist() == [[5, *range(22, 30)]] * 2


def test_snapkv_pooling_keeps_the_neighbourhood_of_a_spike() -> None:
    length, window = 30, 8
    q, k = magnets(length, pull_all(range(length - window, length), key=12))
    for pool in ("avg", "max"):
        kept = snapkv(q, k, budget=window + 5, window=window, kernel=5, pool=pool)
        assert kept.tolist() == [[10, 11, 12, 13, 14, *range(22, 30)]] * 2


def test_snapkv_selects_per_kv_head_and_averages_each_group() -> None:
    length, window = 30, 6
    # KV head 0's group (query heads 0, 1) looks at 3 and 9; KV head 1's (2, 3) at 17.
    pulls = {**pull_all(range(24, 30), 3, range(0, 1)), **pull_all(range(24, 30), 9, range(1, 2))}
    pulls.update(pull_all(range(24, 30), 17, range(2, 4)))
    q, k = magnets(length, pulls)
    kept = snapkv(q, k, budget=window + 2, window=window, kernel=1)
    assert kept[0, :2].tolist() == [3, 9]
    assert 17 in kept[1].tolist() and kept[1, -window:].tolist() == list(range(24, 30))


def test_snapkv_too_small_budget_and_short_prompt() -> None:
    q, k = magnets(20, {})
    with pytest.raises(ValueError, match="observation window"):
        snapkv(q, k, budget=7, window=8)
    assert snapkv(q, k, budget=20).shape == (2, 20)


def test_pyramid_budgets_fall_with_depth_and_sum_to_the_average() -> None:
    # max = 2 * 75 - 75 / 2 = 112.5, min = 37.5; halves round to even.
    assert pyramid_budgets(150, num_layers=4, budget=75, window=16, beta=2) == [112, 88, 62, 38]
    # max capped at T - window = 84, min takes the slack: 150 - 84 = 66.
    assert pyramid_budgets(100, num_layers=4, budget=75, window=16, beta=2) == [84, 78, 72, 66]
    # min = 24.5 / 20 < window: every layer falls back to round(24.5) = 24 (half to even).
    assert pyramid_budgets(61, num_layers=4, budget=24.5, window=8) == [24] * 4
    # max capped at 61 - 8 = 53 leaves min = 61 - 53 = 8 >= window: still a pyramid.
    assert pyramid_budgets(61, num_layers=4, budget=30.5, window=8) == [53, 38, 23, 8]
    # Default beta: max = 2 * 512 - 512 / 20 = 998.4, min = 25.6.
    budgets = pyramid_budgets(4096, num_layers=32, budget=512, window=16)
    assert (budgets[0], budgets[-1]) == (998, 26)
    assert all(a > b for a, b in zip(budgets, budgets[1:]))
    assert abs(sum(budgets) - 32 * 512) <= 16
    assert pyramid_budgets(4096, num_layers=32, budget=512, window=32) == [512] * 32  # min < window


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(8, 5000),
    num_layers=st.integers(2, 64),
    fraction=st.floats(0.05, 0.95),
    window=st.integers(1, 64),
    beta=st.integers(1, 40),
)
def test_pyramid_budgets_properties(
    length: int, num_layers: int, fraction: float, window: int, beta: int
) -> None:
    budget = max(1.0, length * fraction)
    budgets = pyramid_budgets(length, num_layers=num_layers, budget=budget, window=window, beta=beta)
    assert len(budgets) == num_layers
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))
    assert abs(sum(budgets) - num_layers * budget) <= num_layers / 2 + 1e-6
    if budgets[0] != budgets[-1]:  # a real pyramid stays within the prompt and above the window
        assert budgets[0] <= length - window and budgets[-1] >= window


def test_kvcache_factory_budgets_floor_in_integers() -> None:
    # r = 24 - 8 = 16: most = 2 * 16 - 16 // 2 = 24, least = 8, step (24 - 8) // 3 = 5; + window.
    assert kvcache_factory_budgets(101, num_layers=4, budget=24, window=8, beta=2) == [32, 27, 22, 17]
    # T < 2r = 32: SnapKV's uniform budget.
    assert kvcache_factory_budgets(31, num_layers=4, budget=24, window=8, beta=2) == [24] * 4
    # r = 36, 36 // 20 = 1: most = min(71, 72 - 4) = 68 (capped), least = 4, step 64 // 3 = 21.
    assert kvcache_factory_budgets(72, num_layers=4, budget=40, window=4) == [72, 51, 30, 9]
    # kvpress's real-valued schedule differs: 2 * 24 - 24 / 2 = 36 at the bottom.
    assert pyramid_budgets(101, num_layers=4, budget=24, window=8, beta=2) == [36, 28, 20, 12]
    with pytest.raises(ValueError, match="budget > window"):
        kvcache_factory_budgets(100, num_layers=4, budget=8, window=8)


def test_pyramidkv_is_snapkv_with_the_layer_budget() -> None:
    length, window = 150, 16
    q, k = magnets(length, pull_all(range(length - window, length), key=40))
    budgets = pyramid_budgets(length, num_layers=4, budget=75, window=window, beta=2)
    for layer, layer_budget in enumerate(budgets):
        kept = pyramidkv(q, k, layer=layer, num_layers=4, budget=75, window=window, beta=2)
        assert torch.equal(kept, snapkv(q, k, budget=layer_budget, window=window))
        assert 40 in kept[0].tolist() and kept[0, -window:].tolist() == list(range(length - window, length))


def test_h2o_keeps_heavy_hitters_of_all_queries_and_the_recent_window() -> None:
    # Queries 2..10 pile onto key 2; later queries (the last one included) onto key 7.
    length = 24
    q, k = magnets(length, {**pull_all(range(2, 11), 2), **pull_all(range(11, length), 7)})
    kept = h2o(q, k, budget=8)  # recent = 4, heavy = 4
    assert kept.shape == (2, 8) and kept[:, -4:].tolist() == [list(range(20, 24))] * 2
    assert {2, 7} <= set(kept[0].tolist())
    assert h2o(q, k, budget=2, recent=0).tolist() == [[2, 7]] * 2
    # TOVA only asks the last query: key 2 is not kept.
    kept_tova = tova(q, k, budget=3)
    assert 7 in kept_tova[0].tolist() and 2 not in kept_tova[0].tolist()


def test_tova_keeps_the_last_token_and_shares_tokens_across_heads() -> None:
    length = 20
    # The last query looks at 4 in KV head 0's group, at 9 in KV head 1's; never at itself.
    last = range(19, 20)
    q, k = magnets(length, {**pull_all(last, 4, range(0, 2)), **pull_all(last, 9, range(2, 4))})
    shared = tova(q, k, budget=3)
    assert shared[0].tolist() == shared[1].tolist() and shared[0].tolist() == [4, 9, 19]
    per_head = tova(q, k, budget=2, per_kv_head=True)
    assert per_head.tolist() == [[4, 19], [9, 19]]


def test_adakv_moves_budget_to_concentrated_heads() -> None:
    length, window, budget = 40, 4, 10
    # KV head 0's window queries each pull a different key hard; KV head 1 stays diffuse.
    pulls = {(h, t): 3 * (t - 35) + 5 * h for h in range(2) for t in range(36, 40)}
    q, k = magnets(length, pulls)
    kept = adakv(q, k, budget=budget, window=window, alpha=0.2)
    counts = [len(head) for head in kept]
    assert sum(counts) == 2 * budget and counts[0] != counts[1]
    for head in kept:
        assert head.tolist() == sorted(head.tolist()) and head[-window:].tolist() == list(range(36, 40))
        assert len(head) >= max(window, adakv_safeguard(budget, 0.2))
    # A full safeguard pins every head to its own SnapKV budget.
    assert [t.tolist() for t in adakv(q, k, budget=budget, window=window, alpha=1.0)] == snapkv(
        q, k, budget=budget, window=window
    ).tolist()


def test_adakv_safeguard_floor_beyond_the_window() -> None:
    # KV head 0's window pulls 4 keys hard and gives the rest next to nothing; KV head 1 spreads
    # its attention evenly, so without a floor head 0 keeps its window and 4 keys only.
    length, window, budget = 40, 4, 12
    q, k = magnets(length, {(h, t): 3 * (t % 4) for h in range(2) for t in range(36, 40)})
    no_floor = adakv(q, k, budget=budget, window=window, kernel=1, alpha=0.0)
    floored = adakv(q, k, budget=budget, window=window, kernel=1, alpha=0.75)
    assert [len(head) for head in no_floor] == [8, 16]
    assert no_floor[0].tolist() == [0, 3, 6, 9, 36, 37, 38, 39]
    assert [len(head) for head in floored] == [9, 15]  # int(0.75 * 12) = 9, window included
    assert set(no_floor[0].tolist()) < set(floored[0].tolist())
    assert adakv_safeguard(12, 0.75) == 9 and adakv_safeguard(3, 0.2) == 1 and adakv_safeguard(5, 0.0) == 0


def test_gather_kv_takes_the_kept_rows() -> None:
    k = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    v = -k
    kept = torch.tensor([[0, 4], [1, 5]])
    keys, values = gather_kv(k, v, kept)
    assert torch.equal(keys[1, 1], k[1, 5]) and torch.equal(values[0, 1], v[0, 4])
    ragged_keys, _ = gather_kv(k, v, [torch.tensor([2]), torch.tensor([0, 3, 5])])
    assert [t.shape[0] for t in ragged_keys] == [1, 3] and torch.equal(ragged_keys[1][2], k[1, 5])


def test_defaults_are_the_functions_defaults() -> None:
    assert DEFAULTS.keys() == RANKINGS.keys()
    for method, defaults in DEFAULTS.items():
        signature = inspect.signature(RANKINGS[method]).parameters
        assert {name: signature[name].default for name in defaults} == defaults
    with pytest.raises(ValueError, match="unknown method"):
        select("quest", *magnets(10, {}), layer=0, num_layers=1, budget=4)


PARAMS = {
    "streamingllm": {"n_sink": 2},
    "snapkv": {"window": 4, "kernel": 3},
    "pyramidkv": {"window": 4, "beta": 2},
    "h2o": {},
    "observed_attention": {},
    "tova": {},
    "adakv": {"window": 4},
}


@settings(max_examples=40, deadline=None)
@given(
    method=st.sampled_from(sorted(PARAMS)),
    length=st.integers(5, 40),
    budget=st.integers(4, 48),
    groups=st.sampled_from([(2, 2), (4, 2), (8, 2), (3, 1)]),
    seed=st.integers(0, 1000),
)
def test_every_method_keeps_budget_sorted_unique_tokens(
    method: str, length: int, budget: int, groups: tuple[int, int], seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(groups[0], length, DIM, generator=generator)
    k = torch.randn(groups[1], length, DIM, generator=generator)
    ranking = rank(method, q, k, layer=1, num_layers=3, budget=budget, **PARAMS[method])
    kept = list(ranking.kept())
    assert len(kept) == groups[1]
    for head in kept:
        tokens = head.tolist()
        assert tokens == sorted(set(tokens)) and all(0 <= t < length for t in tokens)
        if length <= budget and method != "pyramidkv":
            assert tokens == list(range(length))
        if length > budget and method in ("snapkv", "adakv"):
            assert tokens[-4:] == list(range(length - 4, length))
        if length > budget and method == "streamingllm":
            assert tokens[:2] == [0, 1] and tokens[-1] == length - 1
    total = sum(len(head) for head in kept)
    if ranking.across_heads:
        assert total == ranking.count
    else:
        assert {len(head) for head in kept} == {ranking.count}
    assert ranking.count <= max(length, budget) * (groups[1] if ranking.across_heads else 1)
