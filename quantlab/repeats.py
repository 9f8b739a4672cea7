"""A figure measured over repeated runs: the mean of the runs and its two-sided 95% Student t interval. Pure functions.

Each run of a timed figure (a load level served again, a generation timed again) is one draw of a noisy process;
runs are few, so the interval uses Student's t, not the normal quantile, which would be too narrow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
CI_STATISTICS = ("ci95_low", "ci95_high")


@dataclass(frozen=True)
class Interval:
    """The mean of `runs` values and its two-sided 95% t interval."""

    mean: float
    low: float
    high: float
    runs: int

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def inverted(self, scale: float) -> Interval:
        """The interval of `scale / x` for the positive figure x this interval bounds (e.g. tokens/s from ms per
        token): a monotone map of its ends, swapped; `mean` becomes `scale / mean`, which the new ends contain."""
        if self.low <= 0:
            return Interval(scale / self.mean, scale / self.high, math.inf, self.runs)
        return Interval(scale / self.mean, scale / self.high, scale / self.low, self.runs)

    def ends(self, key: str) -> dict[str, float]:
        """`<key>/ci95_low` and `<key>/ci95_high`, the finite ends only (an unbounded end is not logged)."""
        return {f"{key}/{name}": end for name, end in zip(CI_STATISTICS, (self.low, self.high)) if math.isfinite(end)}


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval | None:
    """Mean +- t(1 - (1 - confidence) / 2, n - 1) * s / sqrt(n) over the finite `values`; None for fewer than two
    (one run has no spread to estimate)."""
    from scipy.special import stdtrit  # scipy.special alone: scipy.stats costs a half-second import per sweep

    found = np.asarray([value for value in values if value is not None and math.isfinite(value)], dtype=float)
    if found.size < 2:
        return None
    mean = float(found.mean())
    half = float(stdtrit(found.size - 1, (1 + confidence) / 2)) * float(found.std(ddof=1)) / math.sqrt(found.size)
    return Interval(mean, mean - half, mean + half, int(found.size))
