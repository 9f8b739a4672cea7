"""A load level run several times (serving.repeats): its runs pooled into the level's figures, and 95% intervals
over them. Pure functions.

Each run of a level is one draw of a noisy process (the server's scheduling, the host, when requests happen to
line up), so one run's throughput says little about the next. A figure is the mean over the runs, with a two-sided
95% Student t interval over them: runs are few, and the normal quantile would be too narrow. The SLO attainment is
a count, not a mean: its requests are pooled over the runs, and its exact bounds come from all of them
(quantlab.serving.goodput). Percentiles are per run (each run's nearest-rank p50), then averaged; maxima are the
largest of any run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from quantlab.repeats import CI_STATISTICS, CONFIDENCE, Interval, t_interval
from quantlab.serving.levels import LoadLevel

# Interval, t_interval and their constants live in quantlab.repeats (a foundation the measure stage shares); kept
# importable from here, where the serving figures' readers look for them.
__all__ = [
    "CI_STATISTICS",
    "CONFIDENCE",
    "INTERVAL_FIGURES",
    "Interval",
    "interval_of",
    "pooled",
    "ratio_interval",
    "runs_by_level",
    "standard_error",
    "t_interval",
]

# The figures a reader compares across variants and runs: each is logged with its interval over the runs.
INTERVAL_FIGURES = ("output_tokens_per_s", "requests_per_s", "ttft_ms_p50", "itl_ms_p50")


def interval_of(runs: Sequence[LoadLevel], figure: Callable[[LoadLevel], float | None]) -> Interval | None:
    """The t interval of a served figure over the runs. None of them is negative (rates, latencies): an interval
    that reaches below 0 (a few runs that spread) starts at 0, which keeps its coverage."""
    values = [figure(run) for run in runs]
    found = t_interval([value for value in values if value is not None])
    return None if found is None else replace(found, low=max(found.low, 0.0))


def runs_by_level(runs: Sequence[LoadLevel]) -> dict[str, tuple[LoadLevel, ...]]:
    """Each level's runs, in the order guidellm ran them; levels in the order of their first run."""
    found: dict[str, list[LoadLevel]] = {}
    for run in runs:
        found.setdefault(run.label, []).append(run)
    return {label: tuple(each) for label, each in found.items()}


def pooled(runs: Sequence[LoadLevel]) -> LoadLevel:
    """One level's runs as one level: rates, latency percentiles and requests in flight averaged over the runs,
    maxima the largest, counts summed, and the SLO attainment counted over every request judged in any run."""
    if len({run.label for run in runs}) != 1:
        raise ValueError(f"runs of several levels pooled as one: {sorted({run.label for run in runs})}")
    if len(runs) == 1:
        return runs[0]

    def mean(name: str) -> float:
        return float(np.mean([getattr(run, name) for run in runs]))  # NaN where any run lacks it

    averaged = ("concurrency", "output_tokens_per_s", "requests_per_s")
    averaged += tuple(f"{latency}_{q}" for latency in LoadLevel.LATENCIES for q in LoadLevel.PERCENTILES)
    maxima = {f"{latency}_max": max(getattr(run, f"{latency}_max") for run in runs) for latency in LoadLevel.LATENCIES}
    # guidellm judges a run's successful and errored requests (errored ones miss); its share is of those.
    judged = [(run.slo_attainment, run.succeeded + run.errors) for run in runs if run.slo_attainment is not None]
    total = sum(n for _, n in judged)
    within = sum(round(share * n) for share, n in judged)
    starts = [run.started_at for run in runs if run.started_at is not None]
    ends = [run.ended_at for run in runs if run.ended_at is not None]
    return replace(
        runs[0],
        **{name: mean(name) for name in averaged},
        **maxima,
        **{name: sum(getattr(run, name) for run in runs) for name in LoadLevel.COUNTS},
        output_tokens_min=min(run.output_tokens_min for run in runs),
        slo_attainment=within / total if total else None,
        first_error=next((run.first_error for run in runs if run.first_error), None),
        # percentiles are per run: the smallest run is what supports them
        sampled=min(run.succeeded if run.sampled is None else run.sampled for run in runs),
        started_at=min(starts, default=None),
        ended_at=max(ends, default=None),
        runs=len(runs),
    )


def standard_error(found: Interval, confidence: float = CONFIDENCE) -> float:
    """The standard error a t interval over `found.runs` values was made from: its upper half-width over the t
    quantile (the lower end may have been raised to 0: `interval_of`)."""
    from scipy.special import stdtrit

    return (found.high - found.mean) / float(stdtrit(found.runs - 1, (1 + confidence) / 2))


def ratio_interval(variant: Interval, baseline: Interval, confidence: float = CONFIDENCE) -> Interval | None:
    """The ratio of two means (variant / baseline) with its two-sided interval, from each one's t interval over its
    runs: on the log scale, where a ratio's error is the sum of the two relative errors (the delta method:
    se(log m) = se(m) / m), with Welch-Satterthwaite's degrees of freedom; the interval is back-transformed, so it is
    not symmetric around the ratio. None where a mean is not positive or either has fewer than two runs."""
    from scipy.special import stdtrit

    if variant.mean <= 0 or baseline.mean <= 0 or variant.runs < 2 or baseline.runs < 2:
        return None
    relative = [standard_error(each, confidence) / each.mean for each in (variant, baseline)]
    ratio = variant.mean / baseline.mean
    spread = math.hypot(*relative)
    if spread == 0:
        return Interval(ratio, ratio, ratio, min(variant.runs, baseline.runs))
    dof = spread**4 / sum(se**4 / (each.runs - 1) for se, each in zip(relative, (variant, baseline)))
    half = float(stdtrit(dof, (1 + confidence) / 2)) * spread
    return Interval(ratio, ratio * math.exp(-half), ratio * math.exp(half), min(variant.runs, baseline.runs))
