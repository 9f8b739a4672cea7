"""The release policy (pure): one pydantic model for the recipe's `frontier.default_policy` and `quantlab pick`'s flags.
Drop limits are judged by non-inferiority in `quantlab.decision`; bounds cap measured figures."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, field_validator
from pydantic_core import PydanticCustomError

from quantlab.metrics import PAIRED_PREFIX, STDERR_SUFFIX, Declared, EvalKey, MetricSpec, Scale, is_eval_score, spec
from quantlab.paired import Group, float_slack

KLD_MEAN = "quality/kld_mean"


# --- A drop limit as written: "1", "1 pts", "+2%" ---


class LimitKind(str, Enum):
    """How a drop limit is written (`max_drop`, METRIC=LIMIT); `limit_problem` says which kind fits which metric."""

    OWN = "own"  # the metric's own unit; percentage points for a 0-1 metric
    POINTS = "points"  # explicit percentage points: 0-1 metrics only
    RELATIVE = "relative"  # percent of the baseline's value: metrics that are not 0-1


@dataclass(frozen=True)
class Limit:
    amount: float  # as written: points, the metric's unit, or percent of the baseline
    kind: LimitKind
    text: str = field(compare=False)  # as the user wrote it, for messages and the record ("1" == "1.0")


_UNIT = re.compile(r"^(?P<number>.*?)\s*(?P<unit>%|pts?|points?)?$", re.IGNORECASE)


def parse_limit(value: Any) -> Limit:
    """A number, or a string "N", "N pts" or "+N%" -> Limit. Raises a ValueError saying what is wrong: pydantic's
    own (it is the model's validator), which a validation error shows without a "Value error, " prefix."""
    if isinstance(value, Limit):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise PydanticCustomError("drop_limit", f"a limit is a number, 'N pts' or '+N%', got {value!r}")
    text = str(value).strip()
    match = _UNIT.match(text)
    try:
        amount = float(match["number"]) if match else math.nan
    except ValueError:
        message = f"limit {text!r} is not a number, 'N pts' or '+N%' (e.g. 1, 0.5, +2%)"
        raise PydanticCustomError("drop_limit", message) from None
    if not math.isfinite(amount):
        raise PydanticCustomError("drop_limit", f"limit {text!r} must be a finite number")
    if amount < 0:
        raise PydanticCustomError("drop_limit", f"limit {text!r} must be >= 0 (it is the largest drop allowed)")
    unit = (match["unit"] or "").lower()
    kind = LimitKind.RELATIVE if unit == "%" else LimitKind.POINTS if unit else LimitKind.OWN
    return Limit(amount, kind, text)


DropLimit = Annotated[
    Limit,
    PlainValidator(parse_limit, json_schema_input_type=float | str),
    # Plain numbers stay numbers in a dumped recipe; "1 pts" and "+2%" stay as written.
    PlainSerializer(lambda limit: limit.amount if limit.kind is LimitKind.OWN else limit.text),
]


def limit_problem(key: str, limit: Limit, metric: MetricSpec | None = None) -> str | None:
    """Why `limit` cannot bound the drop of `key`, or None. Without `metric` (the contract entry
    as the sweep declared it) only what the key alone shows is checked."""
    if not key:
        return "the metric name is empty"
    if key.startswith(PAIRED_PREFIX):
        return "is a paired statistic; name the quality metric itself (its paired figures are read from the runs)"
    parsed = EvalKey.parse(key)
    if (parsed is not None and parsed.stderr) or key.endswith(STDERR_SUFFIX):
        return "is a standard error, not a quality metric"
    if key.startswith(("cost/", "time/")):
        return "is a cost, not a quality metric: bound it with at_most/at_least or choose it as the objective"
    if metric is None:
        if is_eval_score(key):
            return None  # direction and scale come with the sweep's runs: checked by Policy.drop_rules
        metric = spec(key)
    if not metric.entry:
        return "is not in quantlab's metric contract, so its better direction is unknown"
    if metric.higher_is_better is None:
        return "has no known better direction, so a drop cannot be told from a gain"
    if metric.scale is Scale.FRACTION and limit.kind is LimitKind.RELATIVE:
        return (
            f"is a 0-1 metric, whose limits are percentage points: write {key}={limit.amount:g} "
            f"for {limit.amount:g} pts ('%' could mean points or a share of the score)"
        )
    if metric.scale is not Scale.FRACTION and limit.kind is LimitKind.POINTS:
        return (
            f"is not a 0-1 metric ({metric.scale.value}), so points do not apply: give its own unit "
            f"({key}={limit.amount:g}) or a limit relative to the baseline ({key}=+{limit.amount:g}%)"
        )
    return None


# --- The policy ---

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
MetricName = Annotated[str, Field(min_length=1)]


class CandidateControl(str, Enum):
    """How the error rate of the choice is kept when several candidates could be shipped: each candidate shown
    within its limits at the policy's level would let the chance of shipping some variant truly over its limits
    grow with their number (with K candidates at their limits, about K times the level)."""

    # Candidates tested one after another, each at the full level, stopping at the first not shown within every
    # drop limit (later ones are not tested): the error rate stays the level, and the least aggressive are tested
    # first, where the evidence is likeliest to hold.
    FIXED_SEQUENCE = "fixed_sequence"
    BONFERRONI = "bonferroni"  # every candidate's claims at level / K
    NONE = "none"  # every candidate at the level: the choice's error rate is up to K times it


class Policy(BaseModel):
    """What a variant must meet to be shipped. Every field is optional."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # METRIC -> largest allowed drop against the baseline (units: see LimitKind),
    # e.g. {"eval/mmlu_dev/acc": 1, "quality/ppl": "+2%"}.
    max_drop: dict[str, DropLimit] = Field(default_factory=dict)
    # Percentage points; applies to every 0-1 lm-eval score of known direction the baseline logged that
    # `max_drop` does not name and that is not part of a group: a group (e.g. mmlu) is checked as one score,
    # its lm-eval aggregate, and its subjects only where `max_drop` names them.
    max_drop_any_task: float | None = Field(default=1.0, ge=0, allow_inf_nan=False)
    # The one-sided error rate of each drop claim (2.5%: the non-inferiority convention). "Shown within" is
    # claimed per limit at this level, and a variant needs every limit shown within (an intersection-union
    # test: its error rate is this level, whatever the number of limits). "Shown over" is claimed at this
    # family-wise rate over the variant's drop checks (Holm's step-down).
    one_sided_alpha: float = Field(default=0.025, gt=0, lt=0.5)
    # How the choice among several candidates keeps that error rate (CandidateControl).
    candidates: CandidateControl = CandidateControl.FIXED_SEQUENCE
    # fixed_sequence: the candidates tested first, in this order; the rest follow by the objective, the one it
    # rates worst (the least compressed, as a rule) first. The order must not come from the quality figures.
    sequence: list[str] = Field(default_factory=list)
    # The power "about N documents would settle it" is given at.
    power: float = Field(default=0.8, ge=0.5, lt=1)
    max_kld: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # bounds quality/kld_mean
    min_top1_agreement: float | None = Field(default=None, ge=0, le=1)  # 0-1, bounds quality/top1_agreement
    max_peak_memory_bytes: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # Any other logged figure, e.g. {"cost/ttft_ms_p50": 200}; a key here overrides the named
    # field for the same metric.
    at_most: dict[MetricName, FiniteFloat] = Field(default_factory=dict)
    at_least: dict[MetricName, FiniteFloat] = Field(default_factory=dict)

    @field_validator("max_drop")
    @classmethod
    def _limits_fit_their_metrics(cls, drops: dict[str, Limit]) -> dict[str, Limit]:
        for key, limit in drops.items():
            if problem := limit_problem(key, limit):
                raise PydanticCustomError(
                    "drop_limit", "{subject}: {problem}", {"subject": f"{key}={limit.text}", "problem": problem}
                )
        return drops

    def drop_rules(
        self, baseline: Mapping[str, float], declared: Mapping[str, Declared], groups: Mapping[str, Group] | None = None
    ) -> tuple[DropRule, ...]:
        """The drop limits made concrete against the baseline's logged metrics: `max_drop_any_task`
        expands to its 0-1 lm-eval scores of known direction that `max_drop` does not name and that are not
        part of one of `groups` (group score key -> its leaves). Raises PolicyError for a named limit that
        does not fit its metric as the sweep declared it, or that is relative to a baseline value of 0."""
        rules = []
        for key, limit in self.max_drop.items():
            metric = spec(key, declared)
            value = finite(baseline.get(key))
            # A metric the baseline lacks is reported per variant, not bad input.
            if value is not None and (problem := limit_problem(key, limit, metric) or _relative_to_zero(limit, value)):
                raise PolicyError(f"{key}={limit.text}: {problem}")
            rules.append(DropRule(key, metric, limit, value))
        if self.max_drop_any_task is not None:
            limit = Limit(self.max_drop_any_task, LimitKind.POINTS, f"{self.max_drop_any_task:g}")
            inside = grouped_scores(groups or {})
            rules += [
                DropRule(key, spec(key, declared), limit, value)
                for key, value in sorted(baseline.items())
                if is_eval_score(key) and key not in self.max_drop and key not in inside and finite(value) is not None
                if not _any_task_problem(spec(key, declared))
            ]
        return tuple(rules)

    def bounds(self) -> tuple[Bound, ...]:
        """Upper bounds, then lower; `at_most`/`at_least` override a named field on the same metric."""
        upper = {KLD_MEAN: self.max_kld, "cost/peak_memory_bytes": self.max_peak_memory_bytes}
        lower = {"quality/top1_agreement": self.min_top1_agreement}
        return tuple(
            Bound(key, limit, is_upper)
            for is_upper, named, extra in ((True, upper, self.at_most), (False, lower, self.at_least))
            for key, limit in ({key: limit for key, limit in named.items() if limit is not None} | extra).items()
        )

    def check_logged(self, logged: Collection[str]) -> None:
        """PolicyError for a `max_drop` metric that no run logged (a typo, most likely)."""
        candidates = sorted(
            key for key in logged if not key.endswith(STDERR_SUFFIX) and not key.startswith(PAIRED_PREFIX)
        )
        for key, limit in self.max_drop.items():
            if key not in logged:
                close = difflib.get_close_matches(key, candidates, n=1)
                scores = [name for name in candidates if is_eval_score(name)]
                hint = f"did you mean {close[0]}?" if close else f"logged: {', '.join(scores or candidates) or 'none'}"
                raise PolicyError(f"{key}={limit.text}: no variant logged this metric; {hint}")


@dataclass(frozen=True)
class DropRule:
    """One drop limit made concrete against the baseline."""

    metric: str
    spec: MetricSpec  # as the sweep declared it
    limit: Limit
    baseline_value: float | None

    @property
    def allowed(self) -> float | None:
        """The largest allowed drop in the metric's own units (0-1 for fractions); None when a
        relative limit has no baseline value to be relative to."""
        if self.spec.scale is Scale.FRACTION:
            return self.limit.amount / 100
        if self.limit.kind is LimitKind.RELATIVE:
            return None if self.baseline_value is None else self.limit.amount / 100 * abs(self.baseline_value)
        return self.limit.amount

    @property
    def constraint(self) -> str:
        return f"{self.metric} at most {self.words} worse than the baseline"

    @property
    def words(self) -> str:
        """'1 pt', '0.5', '+2% of the baseline (0.2)'."""
        amount = self.limit.amount
        if self.spec.scale is Scale.FRACTION:
            return f"{amount:g} pt" if amount == 1 else f"{amount:g} pts"
        if self.limit.kind is LimitKind.RELATIVE:
            allowed = "" if self.allowed is None else f" ({format_value(self.spec, self.allowed)})"
            return f"+{amount:g}% of the baseline{allowed}"
        return format_value(self.spec, amount)


@dataclass(frozen=True)
class Bound:
    """A plain limit on a logged figure: at most `limit` when `upper`, else at least."""

    metric: str
    limit: float
    upper: bool

    @property
    def constraint(self) -> str:
        return f"{self.metric} {'at most' if self.upper else 'at least'} {format_value(spec(self.metric), self.limit)}"

    def holds(self, value: float) -> bool:
        """Whether `value` meets the bound (float error of a limit's size forgiven: `float_slack`)."""
        slack = float_slack(self.limit)
        return value <= self.limit + slack if self.upper else value >= self.limit - slack

    def failed_by(self, value: float, declared: Declared | None = None) -> str | None:
        """None where `value` meets the bound, else the words that say it does not."""
        if self.holds(value):
            return None
        contract = spec(self.metric, declared)
        side = "above the maximum" if self.upper else "below the minimum"
        return f"{self.metric} is {format_value(contract, value)}, {side} of {format_value(contract, self.limit)}"


class PolicyError(ValueError):
    """A `max_drop` limit that cannot be applied to the sweep as written: the CLI names the flag of
    its policy `field`, the recipe its `recipe_field`."""

    field = "max_drop"
    recipe_field = "frontier.default_policy.max_drop"


def grouped_scores(groups: Mapping[str, Group]) -> set[str]:
    """The scores that are part of a group: every group's leaves, and each group whose leaves all lie in
    a larger one (mmlu_stem within mmlu). What is left is checked by `max_drop_any_task`."""
    leaves = {key: set(group.leaves) for key, group in groups.items()}
    nested = {key for key, mine in leaves.items() if any(mine < theirs for theirs in leaves.values())}
    return {leaf for mine in leaves.values() for leaf in mine} | nested


def _relative_to_zero(limit: Limit, baseline_value: float) -> str | None:
    if limit.kind is LimitKind.RELATIVE and baseline_value == 0:
        return (
            "is relative to the baseline, whose value is 0, so it would allow no change at all: "
            "give the limit in the metric's own unit"
        )
    return None


def unchecked_by_any_task(
    baseline: Mapping[str, float], declared: Mapping[str, Declared], groups: Mapping[str, Group] | None = None
) -> list[str]:
    """The baseline's lm-eval scores outside `groups` that `max_drop_any_task` cannot check, with why: to be named."""
    inside = grouped_scores(groups or {})
    problems = {
        key: _any_task_problem(spec(key, declared))
        for key in sorted(baseline)
        if is_eval_score(key) and key not in inside
    }
    return [f"{key} ({problem})" for key, problem in problems.items() if problem]


def _any_task_problem(metric: MetricSpec) -> str | None:
    if metric.higher_is_better is None:
        return "better direction unknown"
    if metric.scale is not Scale.FRACTION:
        return f"not a 0-1 score: {metric.scale.value}; give it its own max_drop"
    return None


# --- Command-line text: METRIC=LIMIT ---


def parse_max_drops(texts: Iterable[str]) -> dict[str, Limit]:
    """`METRIC=LIMIT` texts -> {metric: limit}; ValueError saying what is wrong."""
    drops: dict[str, Limit] = {}
    for text in texts:
        metric, separator, limit_text = (part.strip() for part in text.partition("="))
        if not separator:
            raise ValueError(f"{text!r}: expected METRIC=LIMIT, e.g. eval/mmlu_dev/acc=1 or quality/ppl=+2%")
        if not metric:
            raise ValueError(f"{text!r}: the metric name before '=' is missing")
        if not limit_text:
            raise ValueError(f"{text!r}: the limit after '=' is missing")
        try:
            limit = parse_limit(limit_text)
        except ValueError as error:
            raise ValueError(f"{metric}={limit_text}: {error}") from None
        if metric in drops:
            raise ValueError(f"{metric} given twice ({drops[metric].text} and {limit.text})")
        drops[metric] = limit
    return drops


# --- Values in the metric's own terms ---


def format_value(metric: MetricSpec, value: float | None) -> str:
    """58.0%, 270.9 MB, 1,234 tok/s, 12.3 ms, 0.03."""
    if value is None or not math.isfinite(value):
        return "n/a"
    if metric.scale is Scale.FRACTION:
        return f"{value * 100:.1f}%"
    if metric.scale is Scale.BYTES:
        for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(value) >= size:
                return f"{value / size:.1f} {unit}"
        return f"{value:.0f} B"
    if metric.scale is Scale.TOKENS_PER_S:
        return f"{value:,.1f} tok/s" if value < 100 else f"{value:,.0f} tok/s"
    if metric.scale is Scale.MILLISECONDS:
        return f"{value:,.1f} ms"
    if metric.scale is Scale.REQUESTS_PER_S:
        return f"{value:.3g} req/s"
    if metric.scale is Scale.USD:
        return f"${value:.3g}" if abs(value) < 1000 else f"${value:,.0f}"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def format_change(metric: MetricSpec, change: float, *, signed: bool = True) -> str:
    """A difference or a drop: percentage points for 0-1 metrics, the metric's own units otherwise."""
    sign = ("+" if change >= 0 else "-") if signed else ""
    if metric.scale is Scale.FRACTION:
        return f"{sign}{abs(change) * 100:.2f} pts"
    return sign + format_value(metric, abs(change))


def finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)
