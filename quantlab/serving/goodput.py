"""From measured load levels to what a release manager pays: the best level meeting the service levels
(goodput), dollars per million output tokens there, and measured peak throughput against the modeled ceiling.
Pure functions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from quantlab.serving.levels import LoadLevel
from quantlab.serving.settings import ServiceLevels

SERVING_TAG = "quantlab.serving."  # facts the report shows beside the figures
UNAVAILABLE_TAG = SERVING_TAG + "unavailable."  # + figure: why it was not logged


def misses(level: LoadLevel, slo: ServiceLevels) -> list[str]:
    """Why `level` does not meet the service levels (empty when it does)."""
    found = []
    if level.errors or level.incomplete:
        found.append(f"{level.errors} errored and {level.incomplete} incomplete requests")
    if not level.succeeded:
        found.append("no successful request")
    if not level.ttft_ms_p99 <= slo.ttft_p99_ms:  # NaN (no figure) misses too
        found.append(f"TTFT p99 {level.ttft_ms_p99:.0f} ms > {slo.ttft_p99_ms:g} ms")
    if not level.itl_ms_p99 <= slo.itl_p99_ms:
        found.append(f"ITL p99 {level.itl_ms_p99:.1f} ms > {slo.itl_p99_ms:g} ms")
    return found


def goodput_level(levels: Sequence[LoadLevel], slo: ServiceLevels) -> LoadLevel | None:
    """The level with the most output tokens/s among those meeting every service level; None if none does."""
    meeting = [level for level in levels if not misses(level, slo)]
    return max(meeting, key=lambda level: level.output_tokens_per_s, default=None)


def usd_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    """What a million output tokens cost on a machine billed `price_per_hour`, kept busy at `tokens_per_s`."""
    if not tokens_per_s > 0:
        raise ValueError(f"no dollar figure at {tokens_per_s} tokens/s")
    return price_per_hour / (tokens_per_s * 3600) * 1_000_000


@dataclass(frozen=True)
class Price:
    usd_per_hour: float
    source: str  # where the price comes from, logged beside the dollar figure


@dataclass(frozen=True)
class ServingSummary:
    """A variant's serving figures as the metric contract names them (`cost/serving/...`)."""

    levels: tuple[LoadLevel, ...]
    goodput: LoadLevel | None
    why_no_goodput: str
    price: Price | None
    modeled_tokens_per_s: float | None  # decode ceiling on the serving hardware at the peak level's concurrency

    @property
    def peak(self) -> LoadLevel:
        return max(self.levels, key=lambda level: level.output_tokens_per_s)

    def to_metrics(self) -> dict[str, float]:
        metrics = {
            f"cost/serving/{level.label}/{name}": value
            for level in self.levels
            for name, value in level.figures().items()
        }
        metrics["cost/serving/peak_tokens_per_s"] = self.peak.output_tokens_per_s
        if self.modeled_tokens_per_s:
            metrics["cost/serving/modeled_tokens_per_s"] = self.modeled_tokens_per_s
            metrics["cost/serving/peak_vs_modeled"] = self.peak.output_tokens_per_s / self.modeled_tokens_per_s
        if self.goodput is not None:
            metrics["cost/serving/goodput_tokens_per_s"] = self.goodput.output_tokens_per_s
            metrics["cost/serving/goodput_requests_per_s"] = self.goodput.requests_per_s
            metrics["cost/serving/goodput_concurrency"] = self.goodput.concurrency
            if self.price is not None and self.goodput.output_tokens_per_s > 0:
                usd = usd_per_million_tokens(self.price.usd_per_hour, self.goodput.output_tokens_per_s)
                metrics["cost/serving/usd_per_mtok"] = usd
        return {key: value for key, value in metrics.items() if math.isfinite(value)}

    def to_tags(self, engine: str) -> dict[str, str]:
        found = {SERVING_TAG + "engine": engine}
        if self.goodput is not None:
            found[SERVING_TAG + "goodput_level"] = self.goodput.label
        return found | {UNAVAILABLE_TAG + name: why for name, why in self.unavailable().items()}

    def unavailable(self) -> dict[str, str]:
        """Figures left out, and why (logged as tags: never a silent gap)."""
        why: dict[str, str] = {}
        if self.goodput is None:
            why["goodput"] = self.why_no_goodput
            why["usd_per_mtok"] = "no load level met the service levels"
        elif self.price is None:
            why["usd_per_mtok"] = "no price per hour for this hardware: set serving.price_per_hour"
        if not self.modeled_tokens_per_s:
            why["peak_vs_modeled"] = "no modeled decode ceiling (the measure stage's bandwidth and weights are needed)"
        return why


def summarize(
    levels: Sequence[LoadLevel], slo: ServiceLevels, price: Price | None, modeled_tokens_per_s: float | None
) -> ServingSummary:
    best = goodput_level(levels, slo)
    why = "; ".join(f"{level.label}: {', '.join(misses(level, slo))}" for level in levels) if best is None else ""
    return ServingSummary(tuple(levels), best, why, price, modeled_tokens_per_s)
