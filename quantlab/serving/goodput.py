"""From measured load levels to what a release manager pays: goodput, dollars per million output tokens there,
and measured peak throughput against the modeled ceiling. Pure functions.

Goodput as DistServe (Zhong et al., OSDI 2024) and vLLM's benchmarks define it: the highest load a server sustains
while at least a stated share of its requests (serving.slo.attainment, default 90%) meets every per-request latency
limit. A level's share is guidellm's own per-request count (`slo_attainment`: errored requests miss; requests cut
off by the level's time limit are left out, as guidellm leaves them out of every figure), so no percentile of a
small sample stands in for it; "highest load" is the level's measured requests/s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from quantlab.serving.levels import LoadLevel
from quantlab.serving.settings import ServiceLevels

SERVING_TAG = "quantlab.serving."  # facts the report shows beside the figures
UNAVAILABLE_TAG = SERVING_TAG + "unavailable."  # + figure: why it was not logged


def describe(slo: ServiceLevels) -> str:
    return (
        f"at least {_percent(slo.attainment)} of requests with TTFT <= {slo.ttft_ms:g} ms and ITL <= {slo.itl_ms:g} ms"
    )


def misses(level: LoadLevel, slo: ServiceLevels) -> str | None:
    """Why `level` does not count toward goodput; None when it does."""
    if level.slo_attainment is None:
        return "guidellm judged no request against the SLOs"
    if level.slo_attainment < slo.attainment:
        errored = f" ({level.errors} errored)" if level.errors else ""
        return f"{_percent(level.slo_attainment)} of requests within every SLO{errored} < {_percent(slo.attainment)}"
    return None


def goodput_level(levels: Sequence[LoadLevel], slo: ServiceLevels) -> LoadLevel | None:
    """The highest load (measured requests/s) among the levels whose SLO attainment reaches `slo.attainment`; None
    if none does."""
    meeting = [level for level in levels if misses(level, slo) is None]
    return max(meeting, key=lambda level: level.requests_per_s, default=None)


def _percent(share: float) -> str:
    return f"{100 * share:.3g}%"


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
    slo: ServiceLevels
    goodput: LoadLevel | None
    why_no_goodput: str
    price: Price | None
    modeled_tokens_per_s: float | None  # prefill + decode ceiling on the serving hardware at the peak's concurrency

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
        found = {SERVING_TAG + "engine": engine, SERVING_TAG + "goodput_definition": self.definition()}
        if self.goodput is not None:
            found[SERVING_TAG + "goodput_level"] = self.goodput.label
        return found | {UNAVAILABLE_TAG + name: why for name, why in self.unavailable().items()}

    def definition(self) -> str:
        return f"the highest load level (by requests/s) with {describe(self.slo)}"

    def unavailable(self) -> dict[str, str]:
        """Figures left out, and why (logged as tags: never a silent gap)."""
        why: dict[str, str] = {}
        if self.goodput is None:
            why["goodput"] = self.why_no_goodput
            why["usd_per_mtok"] = "no load level reached the SLO attainment"
        elif self.price is None:
            why["usd_per_mtok"] = "no price per hour for this hardware: set serving.price_per_hour"
        if not self.modeled_tokens_per_s:
            why["peak_vs_modeled"] = "no modeled ceiling (the measure stage's bandwidth and weights are needed)"
        for level in self.levels:
            why |= {f"{level.label}/{name}": reason for name, reason in level.left_out().items()}
        return why


def summarize(
    levels: Sequence[LoadLevel], slo: ServiceLevels, price: Price | None, modeled_tokens_per_s: float | None
) -> ServingSummary:
    best = goodput_level(levels, slo)
    why = "; ".join(f"{level.label}: {misses(level, slo)}" for level in levels) if best is None else ""
    return ServingSummary(tuple(levels), slo, best, why, price, modeled_tokens_per_s)
