"""Quality-versus-cost Pareto frontiers of a finished sweep, judged against paired noise (pure).

Directions and scales come from the metric contract (`quantlab.metrics`): lm-eval scores take
lm-eval's own `higher_is_better`, recorded by the sweep and merged across its variants. A score
whose direction nobody declared is named (`Frontiers.direction_unknown`), never placed or dropped
in silence.

Dominance. On one quality/cost pair, variant B is dominated by A when A costs no more, A is at
least as good on quality beyond the paired noise (the lower end of the paired 95% interval of
A - B, taken in the metric's better direction, is >= 0), and A is strictly better on one axis
(cheaper, or that lower end > 0). Two variants whose quality interval straddles 0
are a tie within noise: neither can dominate the other on quality, both are reported as tied.
Paired noise comes from a `Noise` callable (per-document scores of both runs, or the figures each
run logged against the baseline); where it has none the pair is compared on the point estimates
and the result says so. Unpaired standard errors are never used: baseline and variants answer the
same documents, and treating them as independent overstates the noise several times.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantlab.metrics import Declared, MetricSpec, Scale, is_eval_score, paired_key
from quantlab.metrics import spec as metric_spec
from quantlab.metrics import unknown_directions as contract_unknown_directions
from quantlab.paired import (
    DocumentScores,
    NotPaired,
    PairedComparison,
    combine,
    compare,
)
from quantlab.policy import Policy, format_change

# --------------------------------------------------------------------------------------
# Input
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VariantSummary:
    """What one variant's run logged: its metrics (MLflow keys) and tags."""

    name: str
    method: str
    succeeded: bool
    metrics: dict[str, float]
    tags: dict[str, str] = field(default_factory=dict)
    is_baseline: bool = False
    # What the sweep recorded about each lm-eval score (direction from lm-eval, scale seen).
    declared: dict[str, Declared] = field(default_factory=dict)

    def spec(self, key: str) -> MetricSpec:
        """The metric contract's entry for one of this run's keys."""
        return metric_spec(key, self.declared)

    def value(self, metric: str) -> float | None:
        """The metric's value, or None when it was not logged or is not a finite number.

        NaN and infinities count as missing: a diverged measurement must not win a frontier.
        """
        raw = self.metrics.get(metric)
        if raw is None:
            return None
        number = float(raw)
        return number if math.isfinite(number) else None


def merged_declared(variants: Iterable[VariantSummary]) -> dict[str, Declared]:
    """Every variant's declarations in one; runs that disagree on a direction make it unknown."""
    merged: dict[str, Declared] = {}
    for variant in variants:
        for key, declared in variant.declared.items():
            seen = merged.setdefault(key, declared)
            if seen.higher_is_better != declared.higher_is_better:
                merged[key] = Declared(None, seen.scale)
    return merged


def find_baseline(variants: Sequence[VariantSummary]) -> VariantSummary | None:
    """The one variant marked as baseline; None if none is, an error if several are."""
    baselines = [variant for variant in variants if variant.is_baseline]
    if len(baselines) > 1:
        raise ValueError(f"several variants are marked as baseline: {[v.name for v in baselines]}")
    return baselines[0] if baselines else None


def ensure_unique_names(variants: Sequence[VariantSummary]) -> None:
    counts = Counter(variant.name for variant in variants)
    duplicates = sorted(name for name, count in counts.items() if count > 1)
    if duplicates:
        raise ValueError(f"variant names must be unique; repeated: {duplicates}")


# --------------------------------------------------------------------------------------
# Paired comparisons in words (values through policy.py's formatting, in the contract's scale)
# --------------------------------------------------------------------------------------


def format_p(p: float) -> str:
    if not math.isfinite(p):
        return "n/a"
    return f"{p:.0e}".replace("e-0", "e-") if p < 1e-3 else f"{p:.2g}"


def describe_comparison(comparison: PairedComparison, metric: MetricSpec) -> str:
    """ "-2.00 pts [-3.10, -0.90], p=3e-4, 25 right→wrong / 5 wrong→right" (variant minus baseline)."""
    text = format_change(metric, comparison.diff)
    if math.isfinite(comparison.ci95_low) and math.isfinite(comparison.ci95_high):
        ends = (comparison.ci95_low, comparison.ci95_high)
        low, high = (format_change(metric, end).removesuffix(" pts") for end in ends)
        text += f" [{low}, {high}]"
    text += f", p={format_p(comparison.p_value)}"
    if comparison.correct_to_wrong is not None and comparison.wrong_to_correct is not None:
        text += f", {comparison.correct_to_wrong} right→wrong / {comparison.wrong_to_correct} wrong→right"
    return text


# --------------------------------------------------------------------------------------
# Axes
# --------------------------------------------------------------------------------------


class UnknownDirectionError(ValueError):
    """A metric whose better direction the contract does not know and the user did not give."""


@dataclass(frozen=True)
class Axis:
    metric: str
    higher_is_better: bool
    # How to show and scale its values; None: the contract's scale for the key alone.
    scale: Scale | None = field(default=None, compare=False)

    @classmethod
    def of(
        cls, metric: str, higher_is_better: bool | None = None, declared: Mapping[str, Declared] | None = None
    ) -> Axis:
        """An axis whose direction is given, or else the metric contract's."""
        found = metric_spec(metric, declared)
        direction = found.higher_is_better if higher_is_better is None else higher_is_better
        if direction is None:
            raise UnknownDirectionError(
                f"the metric contract has no direction for {metric!r}; say it explicitly (higher_is_better: true/false)"
            )
        return cls(metric, direction, found.scale)

    @property
    def unit(self) -> Scale:
        return self.scale or metric_spec(self.metric).scale

    @property
    def label(self) -> str:
        arrow = "higher is better" if self.higher_is_better else "lower is better"
        return f"{metric_spec(self.metric).label} ({arrow})"

    def is_better(self, first: float, second: float) -> bool:
        """Whether `first` is strictly better than `second` on this axis."""
        return first > second if self.higher_is_better else first < second

    def sort_key(self, value: float) -> float:
        """Ascending sort puts the best value first."""
        return -value if self.higher_is_better else value

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "higher_is_better": self.higher_is_better}


@dataclass(frozen=True)
class AxisPair:
    quality: Axis
    cost: Axis

    @property
    def name(self) -> str:
        return f"{self.quality.metric} vs {self.cost.metric}"

    @property
    def title(self) -> str:
        return f"{metric_spec(self.quality.metric).label} vs {metric_spec(self.cost.metric).label}"

    def to_dict(self) -> dict[str, Any]:
        return {"quality": self.quality.to_dict(), "cost": self.cost.to_dict()}


DEFAULT_COST_METRICS: tuple[str, ...] = ("cost/weight_bytes", "cost/decode_tokens_per_s")
DEFAULT_DAMAGE_METRICS: tuple[str, ...] = ("quality/kld_mean",)
# Token-level figures shown beside the task scores (paired noise for them comes later, per token).
DAMAGE_METRICS: tuple[str, ...] = ("quality/kld_mean", "quality/top1_agreement", "quality/ppl")


def logged_keys(variants: Iterable[VariantSummary]) -> set[str]:
    return {key for variant in variants if variant.succeeded for key in variant.metrics}


def task_scores(variants: Sequence[VariantSummary], declared: Mapping[str, Declared]) -> list[str]:
    """Every lm-eval score (filtered ones too) whose direction is declared, sorted."""
    return sorted(
        key for key in logged_keys(variants) if is_eval_score(key) and metric_spec(key, declared).direction_known
    )


def default_axis_pairs(
    variants: Sequence[VariantSummary], declared: Mapping[str, Declared] | None = None
) -> tuple[AxisPair, ...]:
    """Every lm-eval score of known direction, and mean KL, against weight size and decode speed.

    Only pairs that at least one succeeded variant can be placed on are returned, so a CPU
    sweep without throughput numbers simply has no speed plots.
    """
    declared = merged_declared(variants) if declared is None else declared
    succeeded = [variant for variant in variants if variant.succeeded]
    logged = logged_keys(variants)
    qualities = [*task_scores(variants, declared), *(key for key in DEFAULT_DAMAGE_METRICS if key in logged)]
    return tuple(
        AxisPair(Axis.of(quality, declared=declared), Axis.of(cost, declared=declared))
        for cost in DEFAULT_COST_METRICS
        for quality in qualities
        if any(v.value(quality) is not None and v.value(cost) is not None for v in succeeded)
    )


# --------------------------------------------------------------------------------------
# Paired noise: second variant minus first, on one metric
# --------------------------------------------------------------------------------------

Noise = Callable[[str, str, str], "PairedComparison | None"]
"""(metric key, first variant, second variant) -> the paired comparison of second minus first,
or None when no paired figures exist for them."""


def no_noise(metric: str, first: str, second: str) -> None:
    """Point comparison everywhere (tests, and sweeps that logged no paired figures)."""
    return


@dataclass(frozen=True)
class Group:
    """A group score as lm-eval aggregates it: sum(weight * leaf score)."""

    leaves: tuple[str, ...]
    weights: tuple[float, ...]


def reversed_comparison(c: PairedComparison) -> PairedComparison:
    """first minus second from second minus first."""
    return replace(
        c,
        baseline=c.variant,
        variant=c.baseline,
        diff=-c.diff,
        ci95_low=-c.ci95_high,
        ci95_high=-c.ci95_low,
        correct_to_wrong=c.wrong_to_correct,
        wrong_to_correct=c.correct_to_wrong,
    )


def logged_comparison(variant: VariantSummary, metric: str) -> PairedComparison | None:
    """The variant-minus-baseline figures its run logged under `quality/paired/<metric>/...`."""
    figure = {
        stat: variant.value(paired_key(metric, stat))
        for stat in ("diff", "se", "ci95_low", "ci95_high", "p_value", "n", "correct_to_wrong", "wrong_to_correct")
    }
    value = variant.value(metric)
    if value is None or any(figure[stat] is None for stat in ("diff", "ci95_low", "ci95_high")):
        return None
    flips = [None if figure[s] is None else int(figure[s]) for s in ("correct_to_wrong", "wrong_to_correct")]
    return PairedComparison(
        n=int(figure["n"] or 0),
        baseline=value - figure["diff"],
        variant=value,
        diff=figure["diff"],
        se=math.nan if figure["se"] is None else figure["se"],
        ci95_low=figure["ci95_low"],
        ci95_high=figure["ci95_high"],
        p_value=math.nan if figure["p_value"] is None else figure["p_value"],
        test="logged",
        correct_to_wrong=flips[0],
        wrong_to_correct=flips[1],
    )


def paired_noise(
    variants: Sequence[VariantSummary],
    documents: Mapping[str, Mapping[str, DocumentScores]],
    groups: Mapping[str, Group],
) -> Noise:
    """Paired comparisons between any two variants.

    From both runs' per-document scores when both have them (`documents`: variant -> metric key ->
    scores; a group score from its leaves with lm-eval's weights); otherwise, between a variant and
    the baseline, from what the variant's run logged. Each answer is computed once.
    """
    by_name = {variant.name: variant for variant in variants}
    baseline = find_baseline(variants)
    cache: dict[tuple[str, str, str], PairedComparison | None] = {}

    def from_documents(metric: str, first: str, second: str) -> PairedComparison | None:
        a, b = documents.get(first, {}), documents.get(second, {})
        group = groups.get(metric)
        try:
            if group is None:
                return compare(metric, a[metric], b[metric]) if metric in a and metric in b else None
            if not all(leaf in a and leaf in b for leaf in group.leaves):
                return None
            return combine([compare(leaf, a[leaf], b[leaf]) for leaf in group.leaves], group.weights)
        except NotPaired:
            return None  # other documents (another limit): not comparable pairwise

    def from_logged(metric: str, first: str, second: str) -> PairedComparison | None:
        if baseline is None:
            return None
        if first == baseline.name and second in by_name:
            return logged_comparison(by_name[second], metric)
        if second == baseline.name and first in by_name:
            found = logged_comparison(by_name[first], metric)
            return None if found is None else reversed_comparison(found)
        return None

    def noise(metric: str, first: str, second: str) -> PairedComparison | None:
        key = (metric, first, second)
        if key not in cache:
            found = from_documents(*key) or from_logged(*key)
            # n < 2 leaves no standard error: such a comparison says nothing about noise.
            usable = found is not None and math.isfinite(found.ci95_low) and math.isfinite(found.ci95_high)
            cache[key] = found if usable else None
        return cache[key]

    return noise


# --------------------------------------------------------------------------------------
# The Pareto front
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrontierPoint:
    name: str
    method: str
    quality: float
    cost: float
    dominated_by: tuple[str, ...] = ()  # empty: on the front
    tied_with: tuple[str, ...] = ()  # quality differences within the paired noise
    is_baseline: bool = False
    vs_baseline: PairedComparison | None = None  # on the quality axis: this variant minus the baseline

    @property
    def on_front(self) -> bool:
        return not self.dominated_by

    @property
    def interval(self) -> tuple[float, float] | None:
        """The paired 95% interval of the difference to the baseline, placed around this value."""
        c = self.vs_baseline
        if c is None:
            return None
        return self.quality + (c.ci95_low - c.diff), self.quality + (c.ci95_high - c.diff)


@dataclass(frozen=True)
class Exclusion:
    """A variant that could not be placed on a pair's plot, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class FrontierResult:
    pair: AxisPair
    points: tuple[FrontierPoint, ...]  # best cost first
    excluded: tuple[Exclusion, ...]
    baseline: str | None
    # Placed pairs whose quality difference had no paired noise: compared on point estimates.
    point_compared: tuple[tuple[str, str], ...] = ()

    @property
    def on_front(self) -> tuple[str, ...]:
        return tuple(point.name for point in self.points if point.on_front)

    @property
    def dominated(self) -> dict[str, tuple[str, ...]]:
        return {point.name: point.dominated_by for point in self.points if not point.on_front}

    @property
    def ties(self) -> dict[str, tuple[str, ...]]:
        return {point.name: point.tied_with for point in self.points if point.tied_with}

    def point(self, name: str) -> FrontierPoint | None:
        return next((point for point in self.points if point.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.pair.name,
            **self.pair.to_dict(),
            "baseline": self.baseline,
            "on_front": list(self.on_front),
            "points": [
                asdict(point) | {"on_front": point.on_front, "interval": point.interval} for point in self.points
            ],
            "excluded": [asdict(exclusion) for exclusion in self.excluded],
            "no_paired_noise": [list(names) for names in self.point_compared],
        }


def exclusion_reason(variant: VariantSummary, required_metrics: Iterable[str]) -> str | None:
    """Why a variant cannot be judged on these metrics ("failed", "missing X"), or None."""
    if not variant.succeeded:
        return "failed"
    missing = [metric for metric in required_metrics if variant.value(metric) is None]
    return "missing metric " + ", ".join(missing) if missing else None


@dataclass(frozen=True)
class Margin:
    """How much better the first point is than the second on quality, in the better direction."""

    point: float
    low: float  # lower end of the paired 95% interval (= point without paired noise)
    high: float
    paired: bool


def quality_margin(pair: AxisPair, first: FrontierPoint, second: FrontierPoint, noise: Noise) -> Margin:
    found = noise(pair.quality.metric, second.name, first.name)  # first minus second
    if found is None:
        point = first.quality - second.quality
        low = high = point
    else:
        point, low, high = found.diff, found.ci95_low, found.ci95_high
    if not pair.quality.higher_is_better:
        point, low, high = -point, -high, -low
    return Margin(point, low, high, found is not None)


def dominates(pair: AxisPair, first: FrontierPoint, second: FrontierPoint, margin: Margin) -> bool:
    """First costs no more, is at least as good on quality beyond the noise, and is strictly
    better on one axis."""
    costs_no_more = not pair.cost.is_better(second.cost, first.cost)
    strictly = pair.cost.is_better(first.cost, second.cost) or margin.low > 0
    return costs_no_more and margin.low >= 0 and strictly


def pareto_front(variants: Sequence[VariantSummary], pair: AxisPair, noise: Noise = no_noise) -> FrontierResult:
    """Place every variant on one quality/cost pair; find the dominated ones and the ties within noise."""
    ensure_unique_names(variants)
    baseline = find_baseline(variants)
    required = (pair.quality.metric, pair.cost.metric)
    excluded: list[Exclusion] = []
    placed: list[FrontierPoint] = []
    for variant in variants:
        reason = exclusion_reason(variant, required)
        if reason is not None:
            excluded.append(Exclusion(variant.name, reason))
            continue
        versus = None
        if baseline is not None and baseline.succeeded and variant.name != baseline.name:
            versus = noise(pair.quality.metric, baseline.name, variant.name)
        placed.append(
            FrontierPoint(
                variant.name,
                variant.method,
                variant.value(pair.quality.metric),  # type: ignore[arg-type]
                variant.value(pair.cost.metric),
                is_baseline=variant.is_baseline,
                vs_baseline=versus,  # type: ignore[arg-type]
            )
        )
    margins = {(a.name, b.name): quality_margin(pair, a, b, noise) for a in placed for b in placed if a is not b}
    judged = [
        replace(
            point,
            dominated_by=tuple(
                sorted(
                    o.name for o in placed if o is not point and dominates(pair, o, point, margins[o.name, point.name])
                )
            ),
            tied_with=tuple(
                sorted(
                    o.name
                    for o in placed
                    if o is not point and margins[o.name, point.name].low < 0 < margins[o.name, point.name].high
                )
            ),
        )
        for point in placed
    ]
    judged.sort(key=lambda p: (pair.cost.sort_key(p.cost), pair.quality.sort_key(p.quality), p.name))
    unpaired = tuple(sorted((a, b) for (a, b), margin in margins.items() if a < b and not margin.paired))
    return FrontierResult(pair, tuple(judged), tuple(excluded), baseline.name if baseline else None, unpaired)


# --------------------------------------------------------------------------------------
# Settings (embedded in the recipe under `frontier:`)
# --------------------------------------------------------------------------------------


def _check_direction(metric: str, given: bool | None) -> None:
    # lm-eval scores get their direction from lm-eval during the sweep; every other key must be
    # in the contract or given a direction, checked when the recipe loads, not after an hour.
    if given is None and not is_eval_score(metric):
        Axis.of(metric)


class AxisSettings(BaseModel):
    """One frontier plot: a quality metric against a cost metric."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quality: str = Field(min_length=1)
    cost: str = Field(min_length=1)
    quality_higher_is_better: bool | None = None
    cost_higher_is_better: bool | None = None

    @model_validator(mode="after")
    def _directions_are_known(self) -> AxisSettings:
        _check_direction(self.quality, self.quality_higher_is_better)
        _check_direction(self.cost, self.cost_higher_is_better)
        return self

    def to_pair(self, declared: Mapping[str, Declared] | None = None) -> AxisPair:
        return AxisPair(
            Axis.of(self.quality, self.quality_higher_is_better, declared),
            Axis.of(self.cost, self.cost_higher_is_better, declared),
        )


class FrontierSettings(BaseModel):
    """Which frontiers to draw and how to pick; every field has a working default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    axes: list[AxisSettings] | None = None  # None: `default_axis_pairs`
    objective: str = "cost/weight_bytes"
    objective_higher_is_better: bool | None = None
    default_policy: Policy = Field(
        default_factory=Policy
    )  # the report's recommendation: a `quantlab pick` without flags

    @model_validator(mode="after")
    def _objective_direction_is_known(self) -> FrontierSettings:
        _check_direction(self.objective, self.objective_higher_is_better)
        return self

    def objective_axis(self, declared: Mapping[str, Declared] | None = None) -> Axis:
        return Axis.of(self.objective, self.objective_higher_is_better, declared)

    def axis_pairs(
        self, variants: Sequence[VariantSummary], declared: Mapping[str, Declared] | None = None
    ) -> tuple[AxisPair, ...]:
        """The pairs to draw; an explicit axis whose direction is still unknown is left out (and
        its metric named by `compute_frontiers`)."""
        declared = merged_declared(variants) if declared is None else declared
        if self.axes is None:
            return default_axis_pairs(variants, declared)
        pairs = []
        for axis in self.axes:
            try:
                pairs.append(axis.to_pair(declared))
            except UnknownDirectionError:
                continue
        return tuple(pairs)


# --------------------------------------------------------------------------------------
# A whole sweep
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frontiers:
    results: tuple[FrontierResult, ...]
    declared: dict[str, Declared]  # merged over the sweep's variants
    direction_unknown: tuple[str, ...]  # quality scores named, not placed on any frontier
    # variant -> quality metric -> paired comparison with the baseline (variant minus baseline)
    vs_baseline: dict[str, dict[str, PairedComparison]]

    @property
    def on_front(self) -> frozenset[str]:
        """Variants on the front of at least one pair: the `quantlab.on_frontier=true` ones."""
        return on_frontier_names(self.results)

    def scale(self, key: str) -> Scale:
        return metric_spec(key, self.declared).scale


def compute_frontiers(
    variants: Sequence[VariantSummary],
    settings: FrontierSettings | None = None,
    noise: Noise = no_noise,
) -> Frontiers:
    """One `FrontierResult` per axis pair of the settings (defaults when None), the metrics whose
    direction is unknown, and every variant's paired comparison with the baseline."""
    declared = merged_declared(variants)
    pairs = (settings or FrontierSettings()).axis_pairs(variants, declared)
    baseline = find_baseline(variants)
    versus: dict[str, dict[str, PairedComparison]] = {}
    if baseline is not None and baseline.succeeded:
        logged = logged_keys(variants)
        qualities = [*task_scores(variants, declared), *(key for key in DAMAGE_METRICS if key in logged)]
        for variant in variants:
            if variant.succeeded and variant.name != baseline.name:
                found = {metric: noise(metric, baseline.name, variant.name) for metric in qualities}
                versus[variant.name] = {metric: c for metric, c in found.items() if c is not None}
    return Frontiers(
        results=tuple(pareto_front(variants, pair, noise) for pair in pairs),
        declared=declared,
        direction_unknown=tuple(contract_unknown_directions(logged_keys(variants), declared)),
        vs_baseline=versus,
    )


def on_frontier_names(results: Iterable[FrontierResult]) -> frozenset[str]:
    return frozenset(name for result in results for name in result.on_front)


def frontiers_to_dict(frontiers: Frontiers) -> dict[str, Any]:
    """The `frontier.json` artifact."""
    return {
        "on_frontier": sorted(frontiers.on_front),
        "direction_unknown": list(frontiers.direction_unknown),
        "frontiers": [result.to_dict() for result in frontiers.results],
    }
