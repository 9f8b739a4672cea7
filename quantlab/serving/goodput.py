"""From measured load levels to what a release manager pays: goodput, dollars per million output tokens there,
and measured peak throughput against the modeled ceiling. Pure functions.

Goodput as DistServe (Zhong et al., OSDI 2024) defines it: the highest load a server sustains while at least a
stated share of its requests (serving.slo.attainment, default 90%) meets every per-request latency limit. (vLLM's
benchmark calls "request goodput" the SLO-conforming completions per second at one level: logged per level as
`good_requests_per_s`.) A level's share is guidellm's own per-request count (`slo_attainment`: errored requests
miss; requests cut off by the level's time limit are left out, as guidellm leaves them out of every figure), so no
percentile of a small sample stands in for it; "highest load" is the level's measured requests/s.

A share counted over a few requests is itself noisy (8 of 8 within the SLO shows the true share over 69% only, at
95%), so levels are taken in the order of their load (mean requests in flight), and none counts after the first
whose share is shown below the goal (its exact one-sided 95% upper bound under it): a lucky high level does not
count after a lower one failed. Each level's exact (Clopper-Pearson) 95% bounds on its share are logged.

A level run several times (serving.repeats) counts its share over every request of its runs, and its figures are
means over the runs with 95% t intervals (quantlab.serving.intervals): goodput's throughput and dollar figure carry
the interval of the goodput level's runs. A level whose runs other work competed with, after the serve stage's
re-runs, is named in a tag (CONTENDED_LEVELS_TAG): its figures are logged, and no decision rests on them
(quantlab.metrics.rests_on_contention).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from quantlab.metrics import CONTENDED_LEVELS_TAG, LEVEL_CONTENTION_TAG, SERVING_TAG_PREFIX
from quantlab.serving.intervals import CI_STATISTICS, INTERVAL_FIGURES, Interval, interval_of, pooled, runs_by_level
from quantlab.serving.levels import LoadLevel
from quantlab.serving.settings import ServiceLevels

SERVING_TAG = SERVING_TAG_PREFIX  # facts the report shows beside the figures
UNAVAILABLE_TAG = SERVING_TAG + "unavailable."  # + figure: why it was not logged
# quantlab's engine plugins the server loaded (serving.plugins): its served figures are not the stock engine's
NOT_STOCK_TAG = SERVING_TAG + "not_stock"
# the named workloads served (serving.workloads), in order, the primary first: a JSON list of their shapes
WORKLOADS_TAG = SERVING_TAG + "workloads"


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


ATTAINMENT_CONFIDENCE = 0.95  # one-sided, each bound of a level's share


def judged(level: LoadLevel) -> int:
    """The requests guidellm judged against the SLOs: the successful ones and the errored ones (which miss)."""
    return level.succeeded + level.errors


def attainment_bounds(level: LoadLevel) -> tuple[float, float] | None:
    """Exact (Clopper-Pearson) one-sided 95% lower and upper bounds on the level's true share of requests within
    every SLO, from its judged requests; None where guidellm judged none."""
    n = judged(level)
    if level.slo_attainment is None or n == 0:
        return None
    return clopper_pearson(round(level.slo_attainment * n), n, 1 - ATTAINMENT_CONFIDENCE)


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """One-sided (1 - alpha) exact bounds on a binomial proportion: the beta quantiles of Clopper and Pearson (1934)."""
    from scipy.special import betaincinv  # scipy.special alone: scipy.stats costs a half-second import per sweep

    lower = 0.0 if successes == 0 else float(betaincinv(successes, trials - successes + 1, alpha))
    upper = 1.0 if successes == trials else float(betaincinv(successes + 1, trials - successes, 1 - alpha))
    return lower, upper


def shown_below(level: LoadLevel, slo: ServiceLevels) -> str | None:
    """Why the level's share is shown below the goal (its upper bound under it); None when it is not."""
    bounds = attainment_bounds(level)
    if bounds is None or bounds[1] >= slo.attainment:
        return None
    return (
        f"{level.label} before it is shown below {_percent(slo.attainment)} within every SLO "
        f"({level.slo_attainment:.0%} of {judged(level)} requests, {ATTAINMENT_CONFIDENCE:.0%} upper bound "
        f"{_percent(bounds[1])})"
    )


def by_load(levels: Sequence[LoadLevel]) -> list[LoadLevel]:
    """The levels from the lightest load to the heaviest: mean requests in flight grows with the load offered, and
    keeps growing past saturation, where requests/s levels off."""
    return sorted(levels, key=lambda level: level.concurrency)


def goodput_level(levels: Sequence[LoadLevel], slo: ServiceLevels) -> LoadLevel | None:
    """The highest load (measured requests/s) among the levels whose SLO attainment reaches `slo.attainment`, up to
    the first level shown below it (none after that one counts); None if none does."""
    counted = []
    for level in by_load(levels):
        if shown_below(level, slo) is not None:
            break
        if misses(level, slo) is None:
            counted.append(level)
    return max(counted, key=lambda level: level.requests_per_s, default=None)


def not_counted(levels: Sequence[LoadLevel], slo: ServiceLevels) -> dict[str, str]:
    """Each level that does not count toward goodput, and why."""
    why: dict[str, str] = {}
    stopped = None
    for level in by_load(levels):
        if stopped is not None:
            why[level.label] = f"not counted: {stopped}"
            continue
        if (missed := misses(level, slo)) is not None:
            why[level.label] = missed
        stopped = shown_below(level, slo)
    return why


def good_requests_per_s(level: LoadLevel) -> float | None:
    """vLLM's request goodput at one level: requests completed within every SLO per second of the measured window."""
    if level.slo_attainment is None or level.succeeded == 0:
        return None
    window_s = level.succeeded / level.requests_per_s if level.requests_per_s > 0 else math.inf
    return level.slo_attainment * judged(level) / window_s


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


def _with_interval(metrics: dict[str, float], key: str, found: Interval | None) -> None:
    if found is not None:
        metrics |= {f"{key}/{name}": end for name, end in zip(CI_STATISTICS, (found.low, found.high))}


@dataclass(frozen=True)
class ServingSummary:
    """A variant's serving figures as the metric contract names them (`cost/serving/...`)."""

    levels: tuple[LoadLevel, ...]  # each level's runs pooled (quantlab.serving.intervals.pooled)
    slo: ServiceLevels
    goodput: LoadLevel | None
    why_no_goodput: str
    price: Price | None
    modeled_tokens_per_s: float | None  # prefill + decode ceiling on the serving hardware at the peak's concurrency
    runs: dict[str, tuple[LoadLevel, ...]] = field(default_factory=dict)  # level -> its runs (absent: one run)
    contended: dict[str, str] = field(default_factory=dict)  # level -> why its runs are contended, after re-runs
    # each level's runs went in rounds across the sweep's variants (serving.interleave): the goodput figures are also
    # logged round by round (`<key>/round_<n>`), which the frontier pairs with another variant's same round
    in_rounds: bool = False

    @property
    def peak(self) -> LoadLevel:
        return max(self.levels, key=lambda level: level.output_tokens_per_s)

    def runs_of(self, level: LoadLevel) -> tuple[LoadLevel, ...]:
        return self.runs.get(level.label, (level,))

    def to_metrics(self) -> dict[str, float]:
        metrics = {
            f"cost/serving/{level.label}/{name}": value
            for level in self.levels
            for name, value in level.figures().items()
        }
        for level in self.levels:
            key, runs = f"cost/serving/{level.label}", self.runs_of(level)
            metrics[f"{key}/runs"] = len(runs)
            for name in INTERVAL_FIGURES:
                _with_interval(metrics, f"{key}/{name}", interval_of(runs, lambda run, name=name: getattr(run, name)))
            if (bounds := attainment_bounds(level)) is not None:
                metrics[f"{key}/slo_attainment_lower"] = bounds[0]
                metrics[f"{key}/slo_attainment_upper"] = bounds[1]
            good = interval_of(runs, good_requests_per_s)
            if good is not None:  # the mean over the runs, as the interval around it
                metrics[f"{key}/good_requests_per_s"] = good.mean
                _with_interval(metrics, f"{key}/good_requests_per_s", good)
            elif (rate := good_requests_per_s(level)) is not None:
                metrics[f"{key}/good_requests_per_s"] = rate
        metrics["cost/serving/peak_tokens_per_s"] = self.peak.output_tokens_per_s
        if self.modeled_tokens_per_s:
            metrics["cost/serving/modeled_tokens_per_s"] = self.modeled_tokens_per_s
            metrics["cost/serving/peak_vs_modeled"] = self.peak.output_tokens_per_s / self.modeled_tokens_per_s
        if self.goodput is not None:
            runs = self.runs_of(self.goodput)
            tokens = interval_of(runs, lambda run: run.output_tokens_per_s)
            requests = interval_of(runs, lambda run: run.requests_per_s)
            metrics["cost/serving/goodput_tokens_per_s"] = self.goodput.output_tokens_per_s
            _with_interval(metrics, "cost/serving/goodput_tokens_per_s", tokens)
            metrics["cost/serving/goodput_requests_per_s"] = self.goodput.requests_per_s
            _with_interval(metrics, "cost/serving/goodput_requests_per_s", requests)
            metrics["cost/serving/goodput_concurrency"] = self.goodput.concurrency
            if self.price is not None and self.goodput.output_tokens_per_s > 0:
                usd = usd_per_million_tokens(self.price.usd_per_hour, self.goodput.output_tokens_per_s)
                metrics["cost/serving/usd_per_mtok"] = usd
                if tokens is not None:
                    # dollars are the price over the throughput: the cheap end at the fast one, and no dear end
                    # (unbounded) where the throughput's interval reaches zero; round by round alike
                    dollars = tokens.inverted(usd_per_million_tokens(self.price.usd_per_hour, 1.0))
                    metrics |= dollars.ends("cost/serving/usd_per_mtok")
                    metrics |= dollars.rounds("cost/serving/usd_per_mtok") if self.in_rounds else {}
            if self.in_rounds:
                for key, found in (("goodput_tokens_per_s", tokens), ("goodput_requests_per_s", requests)):
                    metrics |= found.rounds(f"cost/serving/{key}") if found is not None else {}
        return {key: value for key, value in metrics.items() if math.isfinite(value)}

    def to_tags(self, engine: str) -> dict[str, str]:
        found = {SERVING_TAG + "engine": engine, SERVING_TAG + "goodput_definition": self.definition()}
        if self.goodput is not None:
            found[SERVING_TAG + "goodput_level"] = self.goodput.label
        if self.contended:
            found[CONTENDED_LEVELS_TAG] = ",".join(self.contended)
            found |= {LEVEL_CONTENTION_TAG + label: why for label, why in self.contended.items()}
        return found | {UNAVAILABLE_TAG + name: why for name, why in self.unavailable().items()}

    def definition(self) -> str:
        runs = max((len(self.runs_of(level)) for level in self.levels), default=1)
        pooled_words = f", each level's share counted over the requests of its {runs} runs" if runs > 1 else ""
        return (
            f"DistServe's: the highest load level (by requests/s) with {describe(self.slo)}, none counted after the "
            f"first level shown below that share ({ATTAINMENT_CONFIDENCE:.0%} exact upper bound){pooled_words}. "
            "vLLM's request goodput (requests within every SLO per second at one level) is each level's "
            "good_requests_per_s"
        )

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
            if len(self.runs_of(level)) < 2:
                why[f"{level.label}/ci95"] = (
                    f"one run of {level.label}: no interval (serving.repeats, or a profile whose levels run once)"
                )
        return why


def summarize(
    runs: Sequence[LoadLevel],
    slo: ServiceLevels,
    price: Price | None,
    modeled_tokens_per_s: float | None,
    contended: Mapping[str, str] | None = None,
    in_rounds: bool = False,
) -> ServingSummary:
    """The variant's serving figures from guidellm's runs (a level's runs share its label): each level's runs pooled,
    goodput over the pooled levels. `contended`: level -> why other work competed with it, after the re-runs.
    `in_rounds`: each level's runs went in rounds across the sweep's variants (ServingSummary.in_rounds)."""
    by_level = runs_by_level(runs)
    levels = [pooled(each) for each in by_level.values()]
    best = goodput_level(levels, slo)
    why = "; ".join(f"{label}: {reason}" for label, reason in not_counted(levels, slo).items()) if best is None else ""
    several = {label: each for label, each in by_level.items() if len(each) > 1}
    return ServingSummary(
        tuple(levels), slo, best, why, price, modeled_tokens_per_s, several, dict(contended or {}), in_rounds
    )
