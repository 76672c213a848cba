"""Binomial confidence intervals for `kvc eval`'s accuracies (runtime/eval/)."""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of `correct` successes in `total` trials (95% by default): unlike
    the normal approximation it stays inside [0, 1] and is sensible at 0/n and n/n."""
    if total <= 0:
        return (0.0, 1.0)
    p = correct / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    low = 0.0 if correct == 0 else max(0.0, centre - half)  # exact ends: no rounding residue at 0/n, n/n
    high = 1.0 if correct == total else min(1.0, centre + half)
    return (low, high)
