"""Quality-versus-cost Pareto frontiers of a finished sweep (pure: no MLflow, no I/O).

A sweep yields one `VariantSummary` per variant, keyed by the logged MLflow metric names.
For each `AxisPair` (one quality metric against one cost metric) `pareto_front` says which
variants nobody beats on both axes at once, which are beaten and by whom, and which could
not be placed at all (failed, or missing a metric). Differences against the baseline that
are smaller than their combined standard error are flagged "within noise" so a report
does not call them a loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from collections import Counter
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantlab.metrics import Declared, MetricSpec
from quantlab.metrics import spec as metric_spec

STDERR_SUFFIX = "_stderr"
EVAL_PREFIX = "eval/"


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

    def stderr(self, metric: str) -> float | None:
        return self.value(metric + STDERR_SUFFIX)


# --------------------------------------------------------------------------------------
# What quantlab knows about its metric keys: direction, unit, a readable label
# --------------------------------------------------------------------------------------


class Unit(str, Enum):
    FRACTION = "fraction"  # 0-1, shown as %, differences in percentage points
    BYTES = "bytes"
    TOKENS_PER_S = "tokens_per_s"
    MILLISECONDS = "ms"
    PLAIN = "plain"


@dataclass(frozen=True)
class MetricInfo:
    key: str
    label: str
    higher_is_better: bool | None  # None: unknown, the user must say
    unit: Unit


_EXACT_METRICS: dict[str, tuple[str, bool, Unit]] = {
    "quality/ppl": ("perplexity", False, Unit.PLAIN),
    "quality/kld_mean": ("mean KL divergence", False, Unit.PLAIN),
    "quality/kld_median": ("median KL divergence", False, Unit.PLAIN),
    "quality/kld_p99": ("p99 KL divergence", False, Unit.PLAIN),
    "quality/kld_max": ("max KL divergence", False, Unit.PLAIN),
    "quality/top1_agreement": ("top-1 agreement", True, Unit.FRACTION),
    "cost/weight_bytes": ("weight size", False, Unit.BYTES),
    "cost/peak_memory_bytes": ("peak memory", False, Unit.BYTES),
    "cost/prefill_tokens_per_s": ("prefill throughput", True, Unit.TOKENS_PER_S),
    "cost/decode_tokens_per_s": ("decode throughput", True, Unit.TOKENS_PER_S),
    "cost/ttft_ms_p50": ("time to first token (p50)", False, Unit.MILLISECONDS),
    "cost/ttft_ms_p99": ("time to first token (p99)", False, Unit.MILLISECONDS),
    "cost/ttft_ms_p90": ("time to first token (p90)", False, Unit.MILLISECONDS),
    "cost/itl_ms_p50": ("inter-token latency (p50)", False, Unit.MILLISECONDS),
    "cost/itl_ms_p90": ("inter-token latency (p90)", False, Unit.MILLISECONDS),
    "cost/itl_ms_p99": ("inter-token latency (p99)", False, Unit.MILLISECONDS),
    "cost/weight_bytes_in_memory": ("weights in memory", False, Unit.BYTES),
    "cost/loaded_weight_bytes": ("weights as loaded here", False, Unit.BYTES),
    "cost/process_peak_rss_bytes": ("process peak RSS", False, Unit.BYTES),
    "cost/peak_device_memory_bytes": ("peak device memory", False, Unit.BYTES),
    "cost/bits_per_weight": ("bits per weight", False, Unit.PLAIN),
    "cost/bits_per_parameter": ("bits per parameter", False, Unit.PLAIN),
    "cost/kv_bytes_per_token": ("KV cache per token", False, Unit.BYTES),
    "cost/max_concurrent_sequences": ("concurrent sequences on target", True, Unit.PLAIN),
    "cost/roofline_decode_tokens_per_s": ("decode roofline on target", True, Unit.TOKENS_PER_S),
    "cost/serving_decode_tokens_per_s": ("serving decode on target (modeled)", True, Unit.TOKENS_PER_S),
    "cost/local_roofline_decode_tokens_per_s": ("decode roofline here", True, Unit.TOKENS_PER_S),
    "cost/roofline_efficiency": ("roofline efficiency", True, Unit.FRACTION),
    "cost/usd_per_million_output_tokens": ("USD per million output tokens", False, Unit.PLAIN),
    "cost/energy_joules_per_token": ("energy per output token (J)", False, Unit.PLAIN),
    "cost/load_seconds": ("load time (s)", False, Unit.PLAIN),
    "quality/kld_p90": ("p90 KL divergence", False, Unit.PLAIN),
    "quality/kld_p95": ("p95 KL divergence", False, Unit.PLAIN),
    "quality/kld_p999": ("p99.9 KL divergence", False, Unit.PLAIN),
    "quality/ln_ppl_ratio": ("ln(PPL ratio)", False, Unit.PLAIN),
    "quality/delta_p_rms": ("RMS change in p(correct)", False, Unit.PLAIN),
}

# lm-eval metric names (the last part of `eval/<task>/<metric>`) whose direction is standard.
_EVAL_METRIC_KINDS: dict[str, tuple[bool, Unit]] = {
    "acc": (True, Unit.FRACTION),
    "acc_norm": (True, Unit.FRACTION),
    "exact_match": (True, Unit.FRACTION),
    "f1": (True, Unit.FRACTION),
    "mc1": (True, Unit.FRACTION),
    "mc2": (True, Unit.FRACTION),
    "mcc": (True, Unit.PLAIN),
    "bleu": (True, Unit.PLAIN),
    "perplexity": (False, Unit.PLAIN),
    "word_perplexity": (False, Unit.PLAIN),
    "byte_perplexity": (False, Unit.PLAIN),
    "bits_per_byte": (False, Unit.PLAIN),
}


def metric_info(key: str) -> MetricInfo:
    """Label, direction and unit of a logged metric key; direction None when unknown."""
    if key in _EXACT_METRICS:
        label, higher, unit = _EXACT_METRICS[key]
        return MetricInfo(key, label, higher, unit)
    parts = key.split("/")
    if key.startswith(EVAL_PREFIX) and len(parts) == 3 and not key.endswith(STDERR_SUFFIX):
        _, task, name = parts
        higher, unit = _EVAL_METRIC_KINDS.get(name, (None, Unit.PLAIN))
        return MetricInfo(key, f"{task} {name}", higher, unit)
    if key.startswith("quality/recovery/") and len(parts) == 4:
        return MetricInfo(key, f"{parts[2]} {parts[3]} recovery", True, Unit.FRACTION)
    if key.startswith("quality/flips/") and len(parts) == 3:
        return MetricInfo(key, f"{parts[2]} answer flips", False, Unit.PLAIN)
    return MetricInfo(key, key, None, Unit.PLAIN)


def is_eval_quality_metric(key: str) -> bool:
    """`eval/<task>/<metric>` (not its stderr companion)."""
    return key.startswith(EVAL_PREFIX) and key.count("/") == 2 and not key.endswith(STDERR_SUFFIX)


def format_metric(key: str, value: float | None) -> str:
    """A value in human units: 24.5%, 270.9 MB, 1,234 tok/s, 12.3 ms, 0.0300."""
    if value is None:
        return "n/a"
    unit = metric_info(key).unit
    if unit is Unit.FRACTION:
        return f"{value * 100:.1f}%"
    if unit is Unit.BYTES:
        return format_bytes(value)
    if unit is Unit.TOKENS_PER_S:
        return f"{value:,.1f} tok/s" if value < 100 else f"{value:,.0f} tok/s"
    if unit is Unit.MILLISECONDS:
        return f"{value:,.1f} ms"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def format_bytes(value: float) -> str:
    # Decimal units, as model cards and disk tools print them.
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def format_difference(key: str, difference: float, *, signed: bool = True) -> str:
    """A difference: percentage points for 0-1 metrics, the metric's own units otherwise."""
    sign = ("+" if difference >= 0 else "-") if signed else ""
    if metric_info(key).unit is Unit.FRACTION:
        return f"{sign}{abs(difference) * 100:.1f} pts"
    return sign + format_metric(key, abs(difference))


# --------------------------------------------------------------------------------------
# Axes
# --------------------------------------------------------------------------------------


class UnknownDirectionError(ValueError):
    """A metric whose better direction quantlab does not know and the user did not give."""


def resolve_direction(metric: str, higher_is_better: bool | None = None) -> bool:
    if higher_is_better is not None:
        return higher_is_better
    known = metric_info(metric).higher_is_better
    if known is None:
        raise UnknownDirectionError(
            f"quantlab does not know whether higher or lower {metric!r} is better; "
            "say it explicitly (higher_is_better: true/false)"
        )
    return known


@dataclass(frozen=True)
class Axis:
    metric: str
    higher_is_better: bool

    @classmethod
    def of(cls, metric: str, higher_is_better: bool | None = None) -> Axis:
        """An axis whose direction comes from the known-metric table unless given."""
        return cls(metric, resolve_direction(metric, higher_is_better))

    @property
    def label(self) -> str:
        arrow = "higher is better" if self.higher_is_better else "lower is better"
        return f"{metric_info(self.metric).label} ({arrow})"

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
        return f"{metric_info(self.quality.metric).label} vs {metric_info(self.cost.metric).label}"

    def to_dict(self) -> dict[str, Any]:
        return {"quality": self.quality.to_dict(), "cost": self.cost.to_dict()}


DEFAULT_COST_METRICS: tuple[str, ...] = ("cost/weight_bytes", "cost/decode_tokens_per_s")
DEFAULT_DAMAGE_METRICS: tuple[str, ...] = ("quality/kld_mean",)


def default_axis_pairs(variants: Sequence[VariantSummary]) -> tuple[AxisPair, ...]:
    """Every eval metric of known direction, and mean KL, against weight size and decode speed.

    Only pairs that at least one succeeded variant can be placed on are returned, so a CPU
    sweep without throughput numbers simply has no speed plots.
    """
    succeeded = [variant for variant in variants if variant.succeeded]
    logged = {key for variant in succeeded for key in variant.metrics}
    eval_metrics = sorted(
        key for key in logged
        if is_eval_quality_metric(key) and metric_info(key).higher_is_better is not None
    )
    quality_metrics = [*eval_metrics, *(key for key in DEFAULT_DAMAGE_METRICS if key in logged)]
    pairs = []
    for cost in DEFAULT_COST_METRICS:
        for quality in quality_metrics:
            if any(v.value(quality) is not None and v.value(cost) is not None for v in succeeded):
                pairs.append(AxisPair(Axis.of(quality), Axis.of(cost)))
    return tuple(pairs)


# --------------------------------------------------------------------------------------
# Differences against the baseline, and whether they are noise
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QualityDelta:
    """A variant's quality metric against the baseline's."""

    variant: str
    metric: str
    higher_is_better: bool
    value: float
    baseline_value: float
    combined_stderr: float | None  # None: neither side logged a standard error

    @property
    def difference(self) -> float:
        return self.value - self.baseline_value

    @property
    def within_noise(self) -> bool:
        """Smaller than the standard error of the difference: not evidence of a change."""
        return (
            self.combined_stderr is not None
            and self.difference != 0
            and abs(self.difference) < self.combined_stderr
        )

    @property
    def is_worse(self) -> bool:
        return self.difference < 0 if self.higher_is_better else self.difference > 0

    @property
    def is_loss(self) -> bool:
        """Worse than the baseline by more than the noise."""
        return self.is_worse and not self.within_noise

    def describe(self) -> str:
        text = format_difference(self.metric, self.difference)
        if self.within_noise:
            noise = format_difference(self.metric, self.combined_stderr or 0.0, signed=False)
            text += f", within noise (±{noise})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "metric": self.metric,
            "value": self.value,
            "baseline_value": self.baseline_value,
            "difference": self.difference,
            "combined_stderr": self.combined_stderr,
            "within_noise": self.within_noise,
            "is_loss": self.is_loss,
        }


def combined_stderr(first: float | None, second: float | None) -> float | None:
    """Standard error of a difference of two independent estimates; a missing one counts as 0."""
    present = [error for error in (first, second) if error is not None]
    if not present:
        return None
    return math.sqrt(sum(error * error for error in present))


def quality_delta(
    variant: VariantSummary,
    baseline: VariantSummary,
    metric: str,
    higher_is_better: bool | None = None,
) -> QualityDelta | None:
    """The variant's difference to the baseline on one metric; None if either lacks it."""
    value, baseline_value = variant.value(metric), baseline.value(metric)
    if value is None or baseline_value is None:
        return None
    return QualityDelta(
        variant=variant.name,
        metric=metric,
        higher_is_better=resolve_direction(metric, higher_is_better),
        value=value,
        baseline_value=baseline_value,
        combined_stderr=combined_stderr(variant.stderr(metric), baseline.stderr(metric)),
    )


def quality_deltas(
    variants: Sequence[VariantSummary],
    metrics: Iterable[str],
) -> tuple[QualityDelta, ...]:
    """Every succeeded non-baseline variant against the baseline, on each metric both logged."""
    baseline = find_baseline(variants)
    if baseline is None or not baseline.succeeded:
        return ()
    metric_list = list(metrics)
    found = (
        quality_delta(variant, baseline, metric)
        for variant in variants
        if variant.succeeded and variant.name != baseline.name
        for metric in metric_list
        if metric_info(metric).higher_is_better is not None
    )
    return tuple(delta for delta in found if delta is not None)


def find_baseline(variants: Sequence[VariantSummary]) -> VariantSummary | None:
    """The one variant marked as baseline; None if none is, an error if several are."""
    baselines = [variant for variant in variants if variant.is_baseline]
    if len(baselines) > 1:
        raise ValueError(f"several variants are marked as baseline: {[v.name for v in baselines]}")
    return baselines[0] if baselines else None


# --------------------------------------------------------------------------------------
# The Pareto front
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrontierPoint:
    name: str
    method: str
    quality: float
    cost: float
    dominated_by: tuple[str, ...]  # empty: on the front
    is_baseline: bool = False

    @property
    def on_front(self) -> bool:
        return not self.dominated_by

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "method": self.method,
            "quality": self.quality,
            "cost": self.cost,
            "on_front": self.on_front,
            "dominated_by": list(self.dominated_by),
            "is_baseline": self.is_baseline,
        }


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
    deltas: tuple[QualityDelta, ...]  # on the quality axis, against the baseline

    @property
    def on_front(self) -> tuple[str, ...]:
        return tuple(point.name for point in self.points if point.on_front)

    @property
    def dominated(self) -> dict[str, tuple[str, ...]]:
        return {point.name: point.dominated_by for point in self.points if not point.on_front}

    def point(self, name: str) -> FrontierPoint | None:
        return next((point for point in self.points if point.name == name), None)

    def delta(self, name: str) -> QualityDelta | None:
        return next((delta for delta in self.deltas if delta.variant == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.pair.name,
            **self.pair.to_dict(),
            "baseline": self.baseline,
            "on_front": list(self.on_front),
            "points": [point.to_dict() for point in self.points],
            "excluded": [{"name": e.name, "reason": e.reason} for e in self.excluded],
            "deltas": [delta.to_dict() for delta in self.deltas],
        }


def exclusion_reason(variant: VariantSummary, required_metrics: Iterable[str]) -> str | None:
    """Why a variant cannot be judged on these metrics ("failed", "missing X"), or None."""
    if not variant.succeeded:
        return "failed"
    missing = [metric for metric in required_metrics if variant.value(metric) is None]
    if missing:
        return "missing metric " + ", ".join(missing)
    return None


def dominates(first: FrontierPoint, second: FrontierPoint, pair: AxisPair) -> bool:
    """No worse on both axes and strictly better on one; equal points do not dominate."""
    no_worse = not pair.quality.is_better(second.quality, first.quality) and not pair.cost.is_better(
        second.cost, first.cost
    )
    strictly_better = pair.quality.is_better(first.quality, second.quality) or pair.cost.is_better(
        first.cost, second.cost
    )
    return no_worse and strictly_better


def pareto_front(variants: Sequence[VariantSummary], pair: AxisPair) -> FrontierResult:
    """Place every variant on one quality/cost pair and find the non-dominated ones."""
    ensure_unique_names(variants)
    required = (pair.quality.metric, pair.cost.metric)
    excluded: list[Exclusion] = []
    placed: list[FrontierPoint] = []
    for variant in variants:
        reason = exclusion_reason(variant, required)
        quality, cost = variant.value(pair.quality.metric), variant.value(pair.cost.metric)
        if reason is not None or quality is None or cost is None:
            excluded.append(Exclusion(variant.name, reason or "missing metric"))
            continue
        placed.append(
            FrontierPoint(variant.name, variant.method, quality, cost, (), variant.is_baseline)
        )
    judged = [
        replace(
            point,
            dominated_by=tuple(sorted(o.name for o in placed if dominates(o, point, pair))),
        )
        for point in placed
    ]
    judged.sort(
        key=lambda p: (pair.cost.sort_key(p.cost), pair.quality.sort_key(p.quality), p.name)
    )
    baseline = find_baseline(variants)
    deltas = ()
    if baseline is not None and baseline.succeeded:
        found = (
            quality_delta(variant, baseline, pair.quality.metric, pair.quality.higher_is_better)
            for variant in variants
            if variant.succeeded and variant.name != baseline.name
        )
        deltas = tuple(delta for delta in found if delta is not None)
    return FrontierResult(
        pair=pair,
        points=tuple(judged),
        excluded=tuple(excluded),
        baseline=baseline.name if baseline else None,
        deltas=deltas,
    )


def ensure_unique_names(variants: Sequence[VariantSummary]) -> None:
    counts = Counter(variant.name for variant in variants)
    duplicates = sorted(name for name, count in counts.items() if count > 1)
    if duplicates:
        raise ValueError(f"variant names must be unique; repeated: {duplicates}")


# --------------------------------------------------------------------------------------
# Settings (embedded in the recipe under `frontier:`)
# --------------------------------------------------------------------------------------


class AxisSettings(BaseModel):
    """One frontier plot: a quality metric against a cost metric."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quality: str = Field(min_length=1)
    cost: str = Field(min_length=1)
    quality_higher_is_better: bool | None = None
    cost_higher_is_better: bool | None = None

    @model_validator(mode="after")
    def _directions_are_known(self) -> AxisSettings:
        # Checked when the recipe loads, not after an hour of sweeping.
        self.to_pair()
        return self

    def to_pair(self) -> AxisPair:
        return AxisPair(
            Axis.of(self.quality, self.quality_higher_is_better),
            Axis.of(self.cost, self.cost_higher_is_better),
        )


class PolicySettings(BaseModel):
    """Constraints of the report's recommendation (a `quantlab pick` without flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Percentage points of a 0-1 metric, e.g. {"eval/mmlu_dev/acc": 1.0}.
    max_drop: dict[str, float] = Field(default_factory=dict)
    # Applies to every 0-1 eval metric the baseline logged that `max_drop` does not name.
    max_drop_any_task: float | None = Field(default=1.0, ge=0)
    max_kld: float | None = Field(default=None, ge=0)
    min_top1_agreement: float | None = Field(default=None, ge=0, le=1)
    max_peak_memory_bytes: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _drops_are_non_negative(self) -> PolicySettings:
        negative = sorted(metric for metric, points in self.max_drop.items() if points < 0)
        if negative:
            raise ValueError(f"max_drop must be >= 0 percentage points; negative for {negative}")
        return self


class FrontierSettings(BaseModel):
    """Which frontiers to draw and how to pick; every field has a working default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    axes: list[AxisSettings] | None = None  # None: `default_axis_pairs`
    objective: str = "cost/weight_bytes"
    objective_higher_is_better: bool | None = None
    default_policy: PolicySettings = Field(default_factory=PolicySettings)

    @model_validator(mode="after")
    def _objective_direction_is_known(self) -> FrontierSettings:
        self.objective_axis()
        return self

    def objective_axis(self) -> Axis:
        return Axis.of(self.objective, self.objective_higher_is_better)

    def axis_pairs(self, variants: Sequence[VariantSummary]) -> tuple[AxisPair, ...]:
        if self.axes is None:
            return default_axis_pairs(variants)
        return tuple(axis.to_pair() for axis in self.axes)


# --------------------------------------------------------------------------------------
# A whole sweep
# --------------------------------------------------------------------------------------


def compute_frontiers(
    variants: Sequence[VariantSummary],
    settings: FrontierSettings | None = None,
) -> tuple[FrontierResult, ...]:
    """One `FrontierResult` per axis pair of the settings (defaults when None)."""
    pairs = (settings or FrontierSettings()).axis_pairs(variants)
    return tuple(pareto_front(variants, pair) for pair in pairs)


def on_frontier_names(results: Iterable[FrontierResult]) -> frozenset[str]:
    """Variants on the front of at least one pair: the `quantlab.on_frontier=true` ones."""
    return frozenset(name for result in results for name in result.on_front)


def frontiers_to_dict(results: Sequence[FrontierResult]) -> dict[str, Any]:
    """The `frontier.json` artifact."""
    return {
        "on_frontier": sorted(on_frontier_names(results)),
        "frontiers": [result.to_dict() for result in results],
    }
