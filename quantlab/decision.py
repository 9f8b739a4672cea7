"""Pick the variant to ship: the cheapest one that meets every constraint (pure).

Constraints are what a release manager says out loud: "at most 1 point lost on any task,
mean KL under 0.05, fits in 16 GB". `pick` checks every variant against every constraint
and returns a `Decision` that names the chosen variant and, for each other variant, the
reasons it was not chosen. A metric that a constraint needs and a variant did not log
rejects that variant with that reason: a missing measurement never counts as a pass.

Drops are judged on the point estimate. A drop over the limit but smaller than its
standard error is still rejected (a small eval set must not wave every variant through),
and the reason says it is within noise so the reader can weigh it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Union

from quantlab.frontier import (
    STDERR_SUFFIX,
    Axis,
    PolicySettings,
    Unit,
    VariantSummary,
    ensure_unique_names,
    format_difference,
    format_metric,
    is_eval_quality_metric,
    metric_info,
    quality_delta,
)

KLD_MEAN = "quality/kld_mean"
TOP1_AGREEMENT = "quality/top1_agreement"
PEAK_MEMORY = "cost/peak_memory_bytes"

# Float arithmetic turns a 1.0-point drop into 1.0000000000000009 points: forgive that much.
_RELATIVE_TOLERANCE = 1e-9


class ConstraintParseError(ValueError):
    """A constraint given on the command line that cannot be understood."""


class DecisionError(ValueError):
    """The question cannot be asked as posed (e.g. the named baseline does not exist)."""


# --------------------------------------------------------------------------------------
# Constraints and the checks they expand to
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckResult:
    constraint: str  # the constraint in words
    metric: str
    passed: bool
    detail: str  # what was measured; the rejection reason when not passed
    within_noise: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "constraint": self.constraint,
            "metric": self.metric,
            "passed": self.passed,
            "detail": self.detail,
            "within_noise": self.within_noise,
        }


def _missing(metric: str, constraint: str) -> CheckResult:
    return CheckResult(constraint, metric, False, f"missing metric {metric}")


def _within(value: float, limit: float, *, upper: bool) -> bool:
    slack = _RELATIVE_TOLERANCE * max(1.0, abs(limit))
    return value <= limit + slack if upper else value >= limit - slack


@dataclass(frozen=True)
class MaxDrop:
    """Lose at most `max_points` percentage points of `metric` against the baseline."""

    metric: str
    max_points: float
    higher_is_better: bool

    def describe(self) -> str:
        return f"{self.metric} at most {self.max_points:g} pts worse than the baseline"

    def evaluate(self, variant: VariantSummary, baseline: VariantSummary) -> CheckResult:
        if baseline.value(self.metric) is None:
            return CheckResult(
                self.describe(), self.metric, False, f"baseline lacks metric {self.metric}"
            )
        delta = quality_delta(variant, baseline, self.metric, self.higher_is_better)
        if delta is None:
            return _missing(self.metric, self.describe())
        worsening = -delta.difference if self.higher_is_better else delta.difference
        drop_points = worsening * 100
        passed = _within(drop_points, self.max_points, upper=True)
        if passed:
            change = format_difference(self.metric, delta.difference)
            detail = f"{self.metric} {change} vs the baseline (limit: {self.max_points:g} pts lost)"
        else:
            detail = (
                f"{self.metric} dropped {drop_points:.2f} pts, over the {self.max_points:g} pts limit"
            )
        if delta.within_noise:
            noise = format_difference(self.metric, delta.combined_stderr or 0.0, signed=False)
            detail += f", within noise (±{noise})"
        return CheckResult(self.describe(), self.metric, passed, detail, delta.within_noise)


@dataclass(frozen=True)
class Bound:
    """An absolute limit on a metric: at most `limit` when `upper`, else at least."""

    metric: str
    limit: float
    upper: bool

    def describe(self) -> str:
        relation = "at most" if self.upper else "at least"
        return f"{self.metric} {relation} {format_metric(self.metric, self.limit)}"

    def evaluate(self, variant: VariantSummary, baseline: VariantSummary) -> CheckResult:
        value = variant.value(self.metric)
        if value is None:
            return _missing(self.metric, self.describe())
        passed = _within(value, self.limit, upper=self.upper)
        shown, limit = format_metric(self.metric, value), format_metric(self.metric, self.limit)
        if passed:
            detail = f"{self.metric} is {shown}"
        else:
            side = "above the maximum" if self.upper else "below the minimum"
            detail = f"{self.metric} is {shown}, {side} of {limit}"
        return CheckResult(self.describe(), self.metric, passed, detail)


@dataclass(frozen=True)
class BaselineUsable:
    """Drops need a baseline that ran: when it failed, no variant can pass them."""

    baseline: str

    def describe(self) -> str:
        return f"baseline {self.baseline} succeeded (drops are measured against it)"

    def evaluate(self, variant: VariantSummary, baseline: VariantSummary) -> CheckResult:
        detail = f"baseline {self.baseline} failed, so drops against it cannot be measured"
        return CheckResult(self.describe(), "", False, detail)


Check = Union[MaxDrop, Bound, BaselineUsable]


def _check_limits(name: str, limits: Mapping[str, float], *, non_negative: bool) -> None:
    for metric, limit in limits.items():
        if not metric:
            raise ValueError(f"{name}: empty metric name")
        if not math.isfinite(limit):
            raise ValueError(f"{name}: limit for {metric} must be a finite number, got {limit}")
        if non_negative and limit < 0:
            raise ValueError(f"{name}: limit for {metric} must be >= 0, got {limit}")


@dataclass(frozen=True)
class Constraints:
    """What a variant must meet to be shippable. Every field is optional."""

    # Percentage points of a 0-1 metric, e.g. {"eval/mmlu_dev/acc": 1.0}.
    max_drop_points: Mapping[str, float] = field(default_factory=dict)
    # Applies to every 0-1 `eval/<task>/<metric>` the baseline logged and max_drop_points omits.
    max_drop_points_any_task: float | None = None
    max_kld_mean: float | None = None
    min_top1_agreement: float | None = None
    max_peak_memory_bytes: float | None = None
    # Any other logged metric, e.g. {"cost/ttft_ms_p99": 200.0}; a key here overrides the
    # named field for the same metric.
    at_most: Mapping[str, float] = field(default_factory=dict)
    at_least: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_limits("max drop", self.max_drop_points, non_negative=True)
        if self.max_drop_points_any_task is not None:
            _check_limits("max drop (any task)", {"*": self.max_drop_points_any_task}, non_negative=True)
        _check_limits("at most", self._upper_bounds(), non_negative=False)
        _check_limits("at least", self._lower_bounds(), non_negative=False)

    @classmethod
    def from_policy(cls, policy: PolicySettings) -> Constraints:
        return cls(
            max_drop_points=dict(policy.max_drop),
            max_drop_points_any_task=policy.max_drop_any_task,
            max_kld_mean=policy.max_kld,
            min_top1_agreement=policy.min_top1_agreement,
            max_peak_memory_bytes=policy.max_peak_memory_bytes,
        )

    def _upper_bounds(self) -> dict[str, float]:
        named = {KLD_MEAN: self.max_kld_mean, PEAK_MEMORY: self.max_peak_memory_bytes}
        return {**{k: v for k, v in named.items() if v is not None}, **self.at_most}

    def _lower_bounds(self) -> dict[str, float]:
        named = {TOP1_AGREEMENT: self.min_top1_agreement}
        return {**{k: v for k, v in named.items() if v is not None}, **self.at_least}

    @property
    def measures_drops(self) -> bool:
        return bool(self.max_drop_points) or self.max_drop_points_any_task is not None

    def checks_for(self, baseline: VariantSummary) -> tuple[Check, ...]:
        """The concrete checks: the any-task limit expands to the baseline's 0-1 eval metrics."""
        checks: list[Check] = []
        if self.measures_drops and not baseline.succeeded:
            checks.append(BaselineUsable(baseline.name))
        drops = dict(self.max_drop_points)
        if self.max_drop_points_any_task is not None:
            for metric in sorted(baseline.metrics):
                if _is_task_fraction(metric) and metric not in drops:
                    drops[metric] = self.max_drop_points_any_task
        checks += [
            MaxDrop(metric, points, _drop_direction(metric)) for metric, points in drops.items()
        ]
        checks += [Bound(metric, limit, upper=True) for metric, limit in self._upper_bounds().items()]
        checks += [Bound(metric, limit, upper=False) for metric, limit in self._lower_bounds().items()]
        return tuple(checks)

    def describe(self) -> tuple[str, ...]:
        """The constraints in words, before expansion against a baseline."""
        lines = [
            MaxDrop(metric, points, _drop_direction(metric)).describe()
            for metric, points in self.max_drop_points.items()
        ]
        if self.max_drop_points_any_task is not None:
            others = "every other" if self.max_drop_points else "every"
            lines.append(
                f"{others} 0-1 eval metric at most {self.max_drop_points_any_task:g} pts worse "
                "than the baseline"
            )
        lines += [Bound(m, v, upper=True).describe() for m, v in self._upper_bounds().items()]
        lines += [Bound(m, v, upper=False).describe() for m, v in self._lower_bounds().items()]
        return tuple(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_drop_points": dict(self.max_drop_points),
            "max_drop_points_any_task": self.max_drop_points_any_task,
            "max_kld_mean": self.max_kld_mean,
            "min_top1_agreement": self.min_top1_agreement,
            "max_peak_memory_bytes": self.max_peak_memory_bytes,
            "at_most": dict(self.at_most),
            "at_least": dict(self.at_least),
        }


def _is_task_fraction(metric: str) -> bool:
    info = metric_info(metric)
    return is_eval_quality_metric(metric) and info.unit is Unit.FRACTION and info.higher_is_better is not None


def _drop_direction(metric: str) -> bool:
    # A "drop" is a loss in the metric's known direction; an unknown metric (a custom task's
    # score) is taken to be higher-is-better, as the word "drop" implies.
    known = metric_info(metric).higher_is_better
    return True if known is None else known


# --------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------


class Status(str, Enum):
    CHOSEN = "chosen"
    COSTS_MORE = "costs_more"  # satisfies every constraint, but another is cheaper
    REJECTED = "rejected"
    FAILED = "failed"


@dataclass(frozen=True)
class Verdict:
    name: str
    status: Status
    reasons: tuple[str, ...]  # empty for the chosen variant
    objective_value: float | None
    checks: tuple[CheckResult, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "reasons": list(self.reasons),
            "objective_value": self.objective_value,
            "checks": [check.to_dict() for check in self.checks],
        }


@dataclass(frozen=True)
class Decision:
    chosen: str | None
    baseline: str
    objective: Axis
    constraints: Constraints
    checks: tuple[str, ...]  # the constraints as checked, after expansion
    verdicts: tuple[Verdict, ...]  # chosen first, then cheapest first

    @property
    def reasons(self) -> dict[str, tuple[str, ...]]:
        """Why each variant other than the chosen one was not chosen."""
        return {v.name: v.reasons for v in self.verdicts if v.status is not Status.CHOSEN}

    def verdict(self, name: str) -> Verdict:
        return next(v for v in self.verdicts if v.name == name)

    @property
    def summary(self) -> str:
        direction = "higher" if self.objective.higher_is_better else "lower"
        objective = f"{self.objective.metric} ({direction} is better)"
        if self.chosen is None:
            return f"No variant satisfies every constraint; nothing chosen (objective: {objective})."
        passing = sum(v.status in (Status.CHOSEN, Status.COSTS_MORE) for v in self.verdicts)
        value = format_metric(self.objective.metric, self.verdict(self.chosen).objective_value)
        return (
            f"Chosen: {self.chosen}, the best by {objective} at {value} among "
            f"{passing} of {len(self.verdicts)} variants that satisfy every constraint."
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON decision record."""
        return {
            "chosen": self.chosen,
            "summary": self.summary,
            "baseline": self.baseline,
            "objective": self.objective.to_dict(),
            "constraints": self.constraints.to_dict(),
            "checks": list(self.checks),
            "variants": [verdict.to_dict() for verdict in self.verdicts],
        }


def pick(
    variants: Sequence[VariantSummary],
    baseline_name: str,
    constraints: Constraints,
    objective: Axis,
) -> Decision:
    """The best variant by `objective` among those that satisfy every constraint.

    Ties on the objective go to the smaller total drop over the checked eval metrics, then
    the lower mean KL, then the name, so the same inputs always give the same answer.
    """
    ensure_unique_names(variants)
    baseline = next((v for v in variants if v.name == baseline_name), None)
    if baseline is None:
        names = ", ".join(v.name for v in variants) or "none"
        raise DecisionError(f"baseline {baseline_name!r} is not among the variants ({names})")
    checks = constraints.checks_for(baseline)
    judged = {variant.name: _judge(variant, baseline, checks, objective) for variant in variants}

    satisfying = [v for v in variants if judged[v.name].status is Status.COSTS_MORE]
    satisfying.sort(key=lambda v: (objective.sort_key(judged[v.name].objective_value),  # type: ignore[arg-type]
                                   *_quality_tie_break(v, baseline, checks), v.name))
    chosen = judged[satisfying[0].name] if satisfying else None
    if chosen is not None:
        judged[chosen.name] = _with_status(chosen, Status.CHOSEN, ())
        for variant in satisfying[1:]:
            runner_up = judged[variant.name]
            judged[variant.name] = _with_status(
                runner_up, Status.COSTS_MORE, (_costs_more_reason(runner_up, chosen, objective),)
            )

    rank = {Status.CHOSEN: 0, Status.COSTS_MORE: 1, Status.REJECTED: 2, Status.FAILED: 3}
    ordered = sorted(
        judged.values(),
        key=lambda v: (
            rank[v.status],
            math.inf if v.objective_value is None else objective.sort_key(v.objective_value),
            v.name,
        ),
    )
    return Decision(
        chosen=chosen.name if chosen else None,
        baseline=baseline.name,
        objective=objective,
        constraints=constraints,
        checks=tuple(check.describe() for check in checks),
        verdicts=tuple(ordered),
    )


def _judge(
    variant: VariantSummary,
    baseline: VariantSummary,
    checks: Sequence[Check],
    objective: Axis,
) -> Verdict:
    if not variant.succeeded:
        return Verdict(variant.name, Status.FAILED, ("failed",), None, ())
    results = tuple(check.evaluate(variant, baseline) for check in checks)
    reasons = [result.detail for result in results if not result.passed]
    objective_value = variant.value(objective.metric)
    if objective_value is None:
        reasons.append(f"missing metric {objective.metric} (the objective)")
    status = Status.REJECTED if reasons else Status.COSTS_MORE  # provisional until ranked
    return Verdict(variant.name, status, tuple(reasons), objective_value, results)


def _quality_tie_break(
    variant: VariantSummary, baseline: VariantSummary, checks: Sequence[Check]
) -> tuple[float, float]:
    """(total drop over the checked eval metrics, mean KL): smaller is better."""
    total_drop = 0.0
    for check in checks:
        if isinstance(check, MaxDrop):
            delta = quality_delta(variant, baseline, check.metric, check.higher_is_better)
            if delta is not None:
                total_drop += -delta.difference if check.higher_is_better else delta.difference
    kld = variant.value(KLD_MEAN)
    return total_drop, math.inf if kld is None else kld


def _with_status(verdict: Verdict, status: Status, reasons: tuple[str, ...]) -> Verdict:
    return Verdict(verdict.name, status, reasons, verdict.objective_value, verdict.checks)


def _costs_more_reason(verdict: Verdict, chosen: Verdict, objective: Axis) -> str:
    value = format_metric(objective.metric, verdict.objective_value)
    best = format_metric(objective.metric, chosen.objective_value)
    if verdict.objective_value == chosen.objective_value:
        return (
            f"satisfies constraints but ties {chosen.name} on {objective.metric} ({value}) "
            "and loses the tie-break (larger drop, higher KL, or later name)"
        )
    return f"satisfies constraints but costs more: {objective.metric} {value} vs {best} for {chosen.name}"


# --------------------------------------------------------------------------------------
# Command-line strings
# --------------------------------------------------------------------------------------

_EXAMPLE = "eval/mmlu_dev/acc=1.0"


def parse_max_drop(text: str) -> tuple[str, float]:
    """`METRIC=POINTS` (percentage points of a 0-1 metric) -> (metric, points)."""
    metric, separator, points_text = text.partition("=")
    metric, points_text = metric.strip(), points_text.strip()
    if not separator:
        raise ConstraintParseError(f"max drop {text!r}: expected METRIC=POINTS, e.g. {_EXAMPLE}")
    if not metric:
        raise ConstraintParseError(f"max drop {text!r}: the metric name before '=' is missing")
    if not points_text:
        raise ConstraintParseError(f"max drop {text!r}: the points after '=' are missing")
    if metric.endswith(STDERR_SUFFIX):
        raise ConstraintParseError(
            f"max drop {text!r}: {metric} is a standard error, not a quality metric"
        )
    if points_text.endswith("%"):
        raise ConstraintParseError(
            f"max drop {text!r}: POINTS is a plain number of percentage points; "
            f"write {metric}={points_text.rstrip('%').strip()}"
        )
    try:
        points = float(points_text)
    except ValueError:
        raise ConstraintParseError(
            f"max drop {text!r}: POINTS must be a number of percentage points, got {points_text!r}"
        ) from None
    if not math.isfinite(points):
        raise ConstraintParseError(f"max drop {text!r}: POINTS must be a finite number")
    if points < 0:
        raise ConstraintParseError(f"max drop {text!r}: POINTS must be >= 0, got {points:g}")
    return metric, points


def parse_max_drops(
    texts: Iterable[str],
    known_metrics: Collection[str] | None = None,
) -> dict[str, float]:
    """Several `METRIC=POINTS`; with `known_metrics`, an unknown metric is an error."""
    drops: dict[str, float] = {}
    for text in texts:
        metric, points = parse_max_drop(text)
        if metric in drops:
            raise ConstraintParseError(
                f"max drop for {metric} given twice ({drops[metric]:g} and {points:g})"
            )
        if known_metrics is not None and metric not in known_metrics:
            raise ConstraintParseError(_unknown_metric_message(metric, known_metrics))
        drops[metric] = points
    return drops


def _unknown_metric_message(metric: str, known_metrics: Collection[str]) -> str:
    candidates = sorted(m for m in known_metrics if not m.endswith(STDERR_SUFFIX))
    close = difflib.get_close_matches(metric, candidates, n=1)
    if close:
        return f"no variant logged metric {metric}; did you mean {close[0]}?"
    evals = [m for m in candidates if is_eval_quality_metric(m)]
    listing = ", ".join(evals or candidates) or "none"
    return f"no variant logged metric {metric}; logged: {listing}"
