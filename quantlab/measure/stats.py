"""Summaries of timing samples: medians and percentiles."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between the two nearest ranks
    (numpy's default), so p50 of an even count is the mean of the middle two."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def median(samples: Sequence[float]) -> float:
    return percentile(samples, 50)
