"""The Wilson interval `kvc eval` reports (runtime/eval/stats.py), against published values."""

from __future__ import annotations

import pytest

from kvc.runtime.eval.stats import wilson_interval


@pytest.mark.parametrize(("correct", "total", "low", "high"), [
    (0, 10, 0.0, 0.2775),   # Wilson (1927) / Newcombe (1998): 0/10 -> [0, 27.8%]
    (10, 10, 0.7225, 1.0),
    (5, 10, 0.2366, 0.7634),
    (81, 263, 0.2553, 0.3662),  # Newcombe (1998), table I, 81/263
])
def test_known_intervals(correct, total, low, high) -> None:
    got = wilson_interval(correct, total)
    assert got == pytest.approx((low, high), abs=5e-4)


def test_bounds_and_monotonicity() -> None:
    for n in (1, 7, 24, 100):
        previous = (-1.0, -1.0)
        for k in range(n + 1):
            low, high = wilson_interval(k, n)
            assert 0.0 <= low <= k / n <= high <= 1.0
            assert low >= previous[0] and high >= previous[1]
            previous = (low, high)
    assert wilson_interval(0, 0) == (0.0, 1.0)
