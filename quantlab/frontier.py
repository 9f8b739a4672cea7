"""Quality-versus-cost Pareto frontiers of a finished sweep, judged against paired noise (pure). Never unpaired
standard errors: variants answer the baseline's documents, and independence overstates the noise several times."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantlab.metrics import (
    PAIRED_PREFIX,
    Declared,
    MetricSpec,
    Scale,
    Shown,
    is_eval_score,
    paired_key,
    rests_on_contention,
    shown_in,
)
from quantlab.metrics import spec as metric_spec
from quantlab.metrics import unknown_directions as contract_unknown_directions
from quantlab.paired import STATISTICS, DocumentScores, Group, NotPaired, PairedComparison, combine, compare
from quantlab.policy import KLD_MEAN, Policy, finite, format_change
from quantlab.repeats import paired_ratio, round_key


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

    def value(self, metric: str) -> float | None:
        """None when not logged or not finite: a diverged measurement must not win a frontier."""
        return finite(self.metrics.get(metric))


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
    repeated = sorted(name for name, count in Counter(variant.name for variant in variants).items() if count > 1)
    if repeated:
        raise ValueError(f"variant names must be unique; repeated: {repeated}")


def format_diff(metric: MetricSpec, comparison: PairedComparison) -> str:
    """ "-2.00 pts [-3.10, -0.90]": variant minus baseline and its paired 95% interval, where it has one."""
    text = format_change(metric, comparison.diff)
    ends = (comparison.ci95_low, comparison.ci95_high)
    if all(map(math.isfinite, ends)):
        low, high = (format_change(metric, end).removesuffix(" pts") for end in ends)
        text += f" [{low}, {high}]"
    return text


def describe_comparison(comparison: PairedComparison, metric: MetricSpec) -> str:
    """ "-2.00 pts [-3.10, -0.90], p=3e-4, 25 right→wrong / 5 wrong→right" (variant minus baseline)."""
    p = comparison.p_value
    shown = f"{p:.0e}".replace("e-0", "e-") if p < 1e-3 else f"{p:.2g}"
    text = f"{format_diff(metric, comparison)}, p={shown if math.isfinite(p) else 'n/a'}"
    if comparison.correct_to_wrong is not None and comparison.wrong_to_correct is not None:
        text += f", {comparison.correct_to_wrong} right→wrong / {comparison.wrong_to_correct} wrong→right"
    return text


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


DEFAULT_COST_METRICS = shown_in(Shown.FRONTIER_COST)
DAMAGE_METRICS = shown_in(Shown.FRONTIER_DAMAGE)  # token-level figures shown beside the task scores


def logged_keys(variants: Iterable[VariantSummary]) -> set[str]:
    return {key for variant in variants if variant.succeeded for key in variant.metrics}


def quality_metrics(variants: Sequence[VariantSummary], declared: Mapping[str, Declared]) -> list[str]:
    """Task scores of declared direction (filtered ones too, sorted), then damage: what a succeeded variant logged."""
    logged = logged_keys(variants)
    scores = sorted(key for key in logged if is_eval_score(key) and metric_spec(key, declared).direction_known)
    return [*scores, *(key for key in DAMAGE_METRICS if key in logged)]


# (metric key, first variant, second variant) -> second minus first, or None without paired figures.
Noise = Callable[[str, str, str], "PairedComparison | None"]


def no_noise(metric: str, first: str, second: str) -> None:
    """Point comparison everywhere (tests, and sweeps that logged no paired figures)."""


def logged_comparison(variant: VariantSummary, metric: str, prefix: str = PAIRED_PREFIX) -> PairedComparison | None:
    """The paired figures its run logged under `<prefix><metric>/...` (default: variant minus baseline)."""
    value = variant.value(metric)
    figures = {name: variant.value(paired_key(metric, name, prefix)) for name in STATISTICS}
    return None if value is None else PairedComparison.logged(value, figures)


def paired_noise(
    variants: Sequence[VariantSummary],
    documents: Mapping[str, Mapping[str, DocumentScores]],
    groups: Mapping[str, Group],
) -> Noise:
    """Paired comparisons between any two variants, each computed once: from both runs' per-document
    scores (`documents`: variant -> metric key -> scores; a group from its leaves with lm-eval's weights)
    when both have them, otherwise, between a variant and the baseline, from what the variant logged. Each interval
    is the one a verdict on the metric judges by (`PairedComparison.oriented`), and each pair is compared one way,
    the baseline (else the first name) as the reference, and read backwards the other way: an interval from flips is
    the verdict's on the other variant against the reference, which is not the mirror of the reverse verdict's."""
    by_name = {variant.name: variant for variant in variants}
    baseline = find_baseline(variants)
    reference = None if baseline is None else baseline.name
    declared = merged_declared(variants)
    cache: dict[tuple[str, str, str], PairedComparison | None] = {}

    def from_documents(metric: str, first: str, second: str) -> PairedComparison | None:
        a, b = documents.get(first, {}), documents.get(second, {})
        group = groups.get(metric)
        leaves = group.leaves if group else (metric,)
        if not all(leaf in a and leaf in b for leaf in leaves):
            return None
        try:
            found = [compare(leaf, a[leaf], b[leaf]) for leaf in leaves]
            return combine(found, group.weights) if group else found[0]
        except NotPaired:
            return None  # other documents (another limit): not comparable pairwise

    def from_logged(metric: str, first: str, second: str) -> PairedComparison | None:
        if first == reference and second in by_name:
            return logged_comparison(by_name[second], metric)
        return None

    def noise(metric: str, first: str, second: str) -> PairedComparison | None:
        key = (metric, first, second)
        if key not in cache:
            forward = first == reference or (second != reference and first <= second)
            one_way = (metric, first, second) if forward else (metric, second, first)
            found = from_documents(*one_way) or from_logged(*one_way)
            # Too few documents leave no interval: such a comparison says nothing about noise.
            usable = found is not None and math.isfinite(found.ci95_low) and math.isfinite(found.ci95_high)
            if found is None or not usable:
                cache[key] = None
            else:
                found = found.oriented(metric_spec(metric, declared).higher_is_better)
                cache[key] = found if forward else found.reversed()
        return cache[key]

    return noise


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
    # A measured cost's 95% interval over its runs (`<cost>/ci95_low`, `/ci95_high`); None: a point figure
    cost_interval: tuple[float, float] | None = None
    # The measured cost run by run where its runs went in rounds across the variants (`<cost>/round_<n>`): `cost_order`
    # pairs them round by round with another variant's
    cost_rounds: tuple[float, ...] = ()
    cost_tied_with: tuple[str, ...] = ()  # neither is cheaper beyond the noise (`cost_order`)

    @property
    def on_front(self) -> bool:
        return not self.dominated_by

    @property
    def interval(self) -> tuple[float, float] | None:
        """The paired 95% interval of the difference to the baseline, placed around this value."""
        c = self.vs_baseline
        return None if c is None else (self.quality + (c.ci95_low - c.diff), self.quality + (c.ci95_high - c.diff))


@dataclass(frozen=True)
class Exclusion:
    name: str
    reason: str  # why it could not be placed on the pair's plot


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

    def point(self, name: str) -> FrontierPoint | None:
        return next((point for point in self.points if point.name == name), None)


def paired_reference(variants: Sequence[VariantSummary]) -> str | None:
    """The baseline's name if it succeeded: every other succeeded variant is compared with it."""
    baseline = find_baseline(variants)
    return baseline.name if baseline is not None and baseline.succeeded else None


class Margin(NamedTuple):
    """How much better the first point is on quality: its paired 95% interval (the point difference if unpaired)."""

    low: float
    high: float
    paired: bool


def quality_margin(pair: AxisPair, first: FrontierPoint, second: FrontierPoint, noise: Noise) -> Margin:
    found = noise(pair.quality.metric, second.name, first.name)  # first minus second
    low, high = (first.quality - second.quality,) * 2 if found is None else (found.ci95_low, found.ci95_high)
    if not pair.quality.higher_is_better:
        low, high = -high, -low
    return Margin(low, high, found is not None)


def cost_interval(variant: VariantSummary, metric: str) -> tuple[float, float] | None:
    """The 95% interval its run logged beside a measured cost (`<metric>/ci95_low`, `/ci95_high`; a missing end is
    unbounded, e.g. dollars at a throughput interval that reaches zero); None where it logged neither."""
    low, high = (variant.value(f"{metric}/{end}") for end in ("ci95_low", "ci95_high"))
    if low is None and high is None:
        return None
    return (-math.inf if low is None else low, math.inf if high is None else high)


def cost_rounds(variant: VariantSummary, metric: str) -> tuple[float, ...]:
    """The cost its run logged round by round (`<metric>/round_1`, `/round_2`, ...; empty where it logged none)."""
    found: list[float] = []
    while (value := variant.value(round_key(metric, len(found) + 1))) is not None:
        found.append(value)
    return tuple(found)


def cost_order(axis: Axis, first: FrontierPoint, second: FrontierPoint) -> int:
    """1 where the first is better on cost beyond the noise, -1 where the second is, 0 for a tie.

    Where both were measured in the same rounds (each round served every variant in turn: serving.interleave), the
    noise is that of their ratio paired round by round (`quantlab.repeats.paired_ratio`): a tie where its 95% interval
    contains 1. A machine that slows over the rounds widens each variant's own interval, but moves both runs of a
    round alike, so only the pairing tells a real difference from the drift. Otherwise a tie where their cost
    intervals overlap (a point figure is an interval of one value, so two points tie only when equal)."""
    if (ratio := paired_ratio(first.cost_rounds, second.cost_rounds)) is not None:
        if ratio.low <= 1 <= ratio.high:
            return 0
        return 1 if axis.is_better(ratio.mean, 1.0) else -1
    a = first.cost_interval or (first.cost, first.cost)
    b = second.cost_interval or (second.cost, second.cost)
    if a[0] <= b[1] and b[0] <= a[1]:
        return 0
    return 1 if axis.is_better(first.cost, second.cost) else -1


def dominates(cost: int, quality: Margin) -> bool:
    """Whether a first point dominates a second, from `cost_order` (1: the first cheaper beyond the noise, 0: a tie
    within it, -1: dearer) and `quality_margin` (first over second): shown worse on neither axis (cost order not -1,
    the margin's interval not wholly below 0), and shown better on one (cheaper beyond the noise, or the margin's
    interval wholly above 0). A difference within the noise, on either axis, counts as none.

    Why this rule: a variant leaves the front only on a difference shown beyond the noise (a 95% interval's one-sided
    2.5%), never on point figures, so two variants equal on both axes are called dominated no more often than that;
    and both axes are read alike, as cost always was (overlapping intervals are a tie, not a worse cost): the dearer
    of two variants keeps its place only by showing the quality its price buys. Asking the cheaper one to be shown at
    least as good on quality (the interval's lower end at or above 0) cannot be met within the noise: identical
    answers leave an interval of some width (zero flips are not [0, 0]), so no variant would ever dominate a dearer
    one it matches. Unpaired points compare their values."""
    not_worse = cost >= 0 and quality.high >= 0
    return not_worse and (cost > 0 or quality.low > 0)


def pareto_front(variants: Sequence[VariantSummary], pair: AxisPair, noise: Noise = no_noise) -> FrontierResult:
    """Place every variant on one quality/cost pair; find the dominated ones and the ties within noise."""
    ensure_unique_names(variants)
    baseline = find_baseline(variants)
    reference = paired_reference(variants)
    excluded: list[Exclusion] = []
    placed: list[FrontierPoint] = []
    metrics = (pair.quality.metric, pair.cost.metric)
    for variant in variants:
        missing = [metric for metric in metrics if variant.value(metric) is None]
        contended = [why for metric in metrics if (why := rests_on_contention(metric, variant.tags)) is not None]
        if not variant.succeeded or missing or contended:
            reason = "missing metric " + ", ".join(missing) if missing else "; ".join(contended)
            excluded.append(Exclusion(variant.name, reason if variant.succeeded else "failed"))
            continue
        quality, cost = (variant.value(metric) for metric in metrics)
        versus = noise(pair.quality.metric, reference, variant.name) if reference not in (None, variant.name) else None
        placed.append(
            FrontierPoint(
                variant.name,
                variant.method,
                quality,
                cost,
                is_baseline=variant.is_baseline,
                vs_baseline=versus,
                cost_interval=cost_interval(variant, pair.cost.metric),
                cost_rounds=cost_rounds(variant, pair.cost.metric),
            )
        )
    margins = {(a.name, b.name): quality_margin(pair, a, b, noise) for a in placed for b in placed if a is not b}

    def judge(point: FrontierPoint) -> FrontierPoint:
        others = [(other, margins[other.name, point.name]) for other in placed if other is not point]
        return replace(
            point,
            dominated_by=tuple(
                sorted(o.name for o, margin in others if dominates(cost_order(pair.cost, o, point), margin))
            ),
            tied_with=tuple(sorted(o.name for o, margin in others if margin.low < 0 < margin.high)),
            cost_tied_with=tuple(
                sorted(o.name for o, _ in others if cost_order(pair.cost, o, point) == 0 and o.cost != point.cost)
            ),
        )

    judged = sorted(
        map(judge, placed), key=lambda p: (pair.cost.sort_key(p.cost), pair.quality.sort_key(p.quality), p.name)
    )
    unpaired = tuple(sorted((a, b) for (a, b), margin in margins.items() if a < b and not margin.paired))
    return FrontierResult(pair, tuple(judged), tuple(excluded), baseline.name if baseline else None, unpaired)


class _Directed(BaseModel):
    """Recipe settings where a metric field `X` has its direction in `X_higher_is_better` (None: the contract's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _directions_are_known(self) -> Self:
        # lm-eval scores get their direction from lm-eval during the sweep; every other key must be
        # in the contract or given a direction, checked when the recipe loads, not after an hour.
        for name, given in self:
            metric = getattr(self, name.removesuffix("_higher_is_better"))
            if name.endswith("_higher_is_better") and given is None and not is_eval_score(metric):
                Axis.of(metric)
        return self


class AxisSettings(_Directed):
    """One frontier plot: a quality metric against a cost metric."""

    quality: str = Field(min_length=1)
    cost: str = Field(min_length=1)
    quality_higher_is_better: bool | None = None
    cost_higher_is_better: bool | None = None


class FrontierSettings(_Directed):
    """Which frontiers to draw and how to pick (the recipe's `frontier:`); every field has a working default."""

    axes: list[AxisSettings] | None = None  # None: the defaults of `axis_pairs`
    objective: str = "cost/weight_bytes"
    objective_higher_is_better: bool | None = None
    default_policy: Policy = Field(default_factory=Policy)  # the report's recommendation: `quantlab pick` bare

    def objective_axis(self, declared: Mapping[str, Declared] | None = None) -> Axis:
        return Axis.of(self.objective, self.objective_higher_is_better, declared)

    def axis_pairs(self, variants: Sequence[VariantSummary], declared: Mapping[str, Declared]) -> tuple[AxisPair, ...]:
        """The pairs to draw, less explicit axes of a still unknown direction (`compute_frontiers` names them).
        By default every lm-eval score of known direction, and mean KL, against weight size, decode speed and served
        dollars per million tokens:
        only pairs some succeeded variant can be placed on (a CPU sweep has no speed plots)."""
        if self.axes is None:
            succeeded = [variant for variant in variants if variant.succeeded]
            return tuple(
                AxisPair(Axis.of(quality, declared=declared), Axis.of(cost, declared=declared))
                for cost in DEFAULT_COST_METRICS
                for quality in quality_metrics(variants, declared)
                if is_eval_score(quality) or quality == KLD_MEAN
                if any(v.value(quality) is not None and v.value(cost) is not None for v in succeeded)
            )
        pairs = []
        for axis in self.axes:
            with contextlib.suppress(UnknownDirectionError):
                quality = Axis.of(axis.quality, axis.quality_higher_is_better, declared)
                pairs.append(AxisPair(quality, Axis.of(axis.cost, axis.cost_higher_is_better, declared)))
        return tuple(pairs)


@dataclass(frozen=True)
class Frontiers:
    results: tuple[FrontierResult, ...]
    declared: dict[str, Declared]  # merged over the sweep's variants
    direction_unknown: tuple[str, ...]  # quality scores named, never placed or dropped in silence
    # variant -> quality metric -> paired comparison with the baseline (variant minus baseline)
    vs_baseline: dict[str, dict[str, PairedComparison]]

    @property
    def on_front(self) -> frozenset[str]:
        """Variants on the front of at least one pair: the `quantlab.on_frontier=true` ones."""
        return frozenset(name for result in self.results for name in result.on_front)


def compute_frontiers(
    variants: Sequence[VariantSummary], settings: FrontierSettings | None = None, noise: Noise = no_noise
) -> Frontiers:
    """A `FrontierResult` per axis pair, the metrics of unknown direction, each variant's comparison to baseline."""
    declared = merged_declared(variants)
    pairs = (settings or FrontierSettings()).axis_pairs(variants, declared)
    reference, qualities = paired_reference(variants), quality_metrics(variants, declared)
    versus = {
        variant.name: {metric: c for metric in qualities if (c := noise(metric, reference, variant.name)) is not None}
        for variant in variants
        if reference is not None and variant.succeeded and variant.name != reference
    }
    return Frontiers(
        results=tuple(pareto_front(variants, pair, noise) for pair in pairs),
        declared=declared,
        direction_unknown=tuple(contract_unknown_directions(logged_keys(variants), declared)),
        vs_baseline=versus,
    )


def frontiers_to_dict(frontiers: Frontiers) -> dict[str, Any]:
    """The `frontier.json` artifact."""
    return {
        "on_frontier": sorted(frontiers.on_front),
        "direction_unknown": list(frontiers.direction_unknown),
        "frontiers": [
            {
                "name": result.pair.name,
                "quality": result.pair.quality.to_dict(),
                "cost": result.pair.cost.to_dict(),
                "baseline": result.baseline,
                "on_front": list(result.on_front),
                "points": [asdict(p) | {"on_front": p.on_front, "interval": p.interval} for p in result.points],
                "excluded": [asdict(exclusion) for exclusion in result.excluded],
                "no_paired_noise": [list(names) for names in result.point_compared],
            }
            for result in frontiers.results
        ],
    }
