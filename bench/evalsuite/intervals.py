"""95% bootstrap intervals for means and paired differences over cases.

Written with numpy rather than scipy.stats.bootstrap: scipy would be a large dependency for a
percentile bootstrap of a mean, which is these ten lines.
"""

from __future__ import annotations

import math

import numpy as np

RESAMPLES = 4000


def mean_ci(values, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of `values` with a percentile bootstrap interval; NaNs when empty."""
    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(RESAMPLES, data.size))].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(data.mean()), float(low), float(high)


def paired_difference_ci(pruned, reference, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of pruned - reference, case by case (the same cases on both sides)."""
    pruned, reference = list(pruned), list(reference)
    assert len(pruned) == len(reference), "a paired comparison needs the same cases"
    return mean_ci([a - b for a, b in zip(pruned, reference)], level, seed)
