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
    """The mean of `runs` values and its two-sided 95% t interval. `values`: the runs' own, in the order they ran
    (empty where some run gave none): a comparison paired run by run reads them (quantlab.frontier.cost_order)."""

    mean: float
    low: float
    high: float
    runs: int
    values: tuple[float, ...] = ()

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def inverted(self, scale: float) -> Interval:
        """The interval of `scale / x` for the positive figure x this interval bounds (e.g. tokens/s from ms per
        token): a monotone map of its ends, swapped; `mean` becomes `scale / mean`, which the new ends contain."""
        values = tuple(scale / value for value in self.values) if all(value > 0 for value in self.values) else ()
        if self.low <= 0:
            return Interval(scale / self.mean, scale / self.high, math.inf, self.runs, values)
        return Interval(scale / self.mean, scale / self.high, scale / self.low, self.runs, values)

    def ends(self, key: str) -> dict[str, float]:
        """`<key>/ci95_low` and `<key>/ci95_high`, the finite ends only (an unbounded end is not logged)."""
        return {f"{key}/{name}": end for name, end in zip(CI_STATISTICS, (self.low, self.high)) if math.isfinite(end)}

    def rounds(self, key: str) -> dict[str, float]:
        """`<key>/round_1`, `<key>/round_2`, ...: each run's value, for runs that went in rounds across the variants
        (serving.interleave), so that round r of one variant pairs with round r of another; empty without values."""
        return {round_key(key, number): value for number, value in enumerate(self.values, 1)}


def round_key(key: str, number: int) -> str:
    return f"{key}/round_{number}"


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval | None:
    """Mean +- t(1 - (1 - confidence) / 2, n - 1) * s / sqrt(n) over the finite `values`; None for fewer than two
    (one run has no spread to estimate)."""
    from scipy.special import stdtrit  # scipy.special alone: scipy.stats costs a half-second import per sweep

    found = np.asarray([value for value in values if value is not None and math.isfinite(value)], dtype=float)
    if found.size < 2:
        return None
    mean = float(found.mean())
    half = float(stdtrit(found.size - 1, (1 + confidence) / 2)) * float(found.std(ddof=1)) / math.sqrt(found.size)
    every_run = tuple(float(value) for value in found) if found.size == len(values) else ()
    return Interval(mean, mean - half, mean + half, int(found.size), every_run)


def paired_ratio(first: Sequence[float], second: Sequence[float], confidence: float = CONFIDENCE) -> Interval | None:
    """The ratio first / second of two figures measured run by run in the same rounds (run r of each in round r),
    paired by round: the t interval of the mean log ratio over the rounds, back-transformed (its centre is the
    geometric mean of the rounds' ratios). A drift of the machine over the rounds moves both runs of a round alike and
    cancels in their ratio, which two intervals set side by side would count as noise twice. None where the rounds
    differ in number, are fewer than two, or a value is not positive."""
    if len(first) != len(second) or len(first) < 2 or min(*first, *second) <= 0:
        return None
    found = t_interval([math.log(a / b) for a, b in zip(first, second)], confidence)
    if found is None:
        return None
    return Interval(math.exp(found.mean), math.exp(found.low), math.exp(found.high), found.runs)
