"""Pick the variant to ship: the best by the objective among those shown to meet the policy (pure).

Drops are judged by non-inferiority on the paired statistics each variant logged against the
baseline; without them a drop check is undecided. Bounds compare the logged value; a metric a
check needs that a variant did not log rejects it (a missing measurement never counts as a pass).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import Enum
from functools import partial
from typing import Any

from quantlab.candidates import ChoiceControl, SequenceError, control_choice, sequence_order
from quantlab.frontier import Axis, VariantSummary, ensure_unique_names
from quantlab.measure.contention import CONTENDED_TAG, CONTENTION_TAG
from quantlab.metrics import (
    EvalKey,
    Scale,
    adaptive_key,
    paired_key,
    rests_on_contention,
    spec,
    why_unavailable,
)
from quantlab.paired import (
    Group,
    NonInferiority,
    Outcome,
    RepeatVariance,
    Settling,
    flip_se,
    holm_alphas,
    logged_variance,
    non_inferiority,
    over_p,
    paired_binary_non_inferiority,
    paired_binary_over_p,
    quantile,
    selection_adjusted_interval,
    settling,
)
from quantlab.policy import (
    KLD_MEAN,
    Bound,
    DropRule,
    Policy,
    PolicyError,
    format_change,
    format_value,
    unchecked_by_any_task,
)
from quantlab.serving.goodput import NOT_STOCK_TAG, SERVING_TAG


class DecisionError(ValueError):
    """The question cannot be asked as posed (e.g. the named baseline does not exist)."""


# --- One check of one variant ---


class CheckStatus(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    UNDECIDED = "undecided"  # not enough evidence either way: not a pass


_BY_OUTCOME = dict(zip(Outcome, CheckStatus))  # WITHIN -> PASSED, OVER -> FAILED, UNSURE -> UNDECIDED


@dataclass(frozen=True)
class CheckResult:
    constraint: str  # the limit in words
    metric: str
    status: CheckStatus
    detail: str  # the verdict in words, with the bounds it used; the reason when not passed
    # Drop checks only (NonInferiority's fields), in the metric's own units (0-1 for fractions; positive = worse):
    outcome: Outcome | None = None
    drop: float | None = None
    lower: float | None = None  # one-sided (1 - over_alpha) bound: "shown over" when above the limit
    upper: float | None = None  # one-sided (1 - alpha) bound: "shown within" when at or below the limit
    limit: float | None = None  # the largest allowed drop
    n: int | None = None  # documents (or tokens) paired
    documents_needed: int | None = None  # undecided: about how many would settle it, at the policy's power
    # Undecided, a sampled task scored in repeats, where more repeats settle it with fewer scorings than more documents
    # (`documents_needed` is then None): about how many repeats of its documents would
    repeats_needed: int | None = None
    alpha: float | None = None  # the policy's one-sided level
    over_alpha: float | None = None  # the level "shown over" was tested at (Holm: alpha / k for rank k from the end)
    df: float | None = None  # Student's t degrees of freedom of the bounds; None: normal
    best_limit: float | None = None  # undecided, needing more documents than the task has: the limit they can settle
    family: int | None = None  # drop checks of this variant that "shown over" is corrected for (Holm)
    documents_available: int | None = None  # documents the task has, where known
    unit: str = "documents"  # what `n` and `documents_needed` count: per-token figures count scoring windows
    is_drop: bool = False  # a drop limit (paired, against the baseline), not a bound on a logged figure
    # Shown within: the drop's two-sided 95% interval given that it passed (`selection_adjusted_interval`); None: no
    # finite bound that side
    selected_low: float | None = None
    selected_high: float | None = None
    selected_words: str = ""  # "eval/x/acc: drop 1.00 pt [-2.10 pts, 5.40 pts]"


@dataclass(frozen=True)
class _Evidence:
    """A drop check with paired statistics, before the variant's checks are judged together. With `flips`
    (correct_to_wrong, wrong_to_correct: 0/1 scores of one pool of documents) it is judged on Tango's score
    bounds from them ("shown over" also needs the Wald bound on Agresti and Min's se over the limit), else on `se`."""

    rule: DropRule
    drop: float
    se: float
    n: int
    df: float
    available: int | None
    flips: tuple[int, int] | None = None
    # Per-token figures are sampled by scoring window (their se clusters on windows): n and the advice count windows
    windows: int | None = None
    tokens: int | None = None
    # Adaptive evaluation: the nominal level of the stage its task stopped at as a share of the policy's (1: every
    # document scored at once): its claims are tested at the policy's levels times this, as its stages were.
    level_share: float = 1.0
    # A sampled task scored in repeats: its item-mean variance in parts, from which more repeats are weighed against
    # more documents (`settling`)
    variance: RepeatVariance | None = None

    @property
    def unit(self) -> str:
        return "documents" if self.windows is None else "scoring windows"

    @property
    def limit(self) -> float:
        return self.rule.allowed or 0.0

    @property
    def bounds_name(self) -> str:
        return "bounds" if self.flips is None else "bounds from the flips"

    @property
    def p_over(self) -> float:
        if self.flips is None:
            return over_p(self.drop, self.se, self.limit, self.df)
        return paired_binary_over_p(self.n, *self.flips, self.limit, higher_is_better=self.rule.spec.higher_is_better)

    def selected(self, alpha: float) -> dict[str, float | None]:
        """The drop's interval given that its one-sided (1 - alpha) bound was within the limit: on its se, or on 0/1
        scores the se that Tango's interval from the flips implies (`flip_se`), the normal bound on it standing in for
        Tango's. Agresti and Min's Wald se is far narrower where flips are few: on 40 documents without one, +-4.7 pts
        against Tango's +-8.8, and the interval then missed true drops the verdict's own bounds allowed."""
        se = self.se if self.flips is None else flip_se(self.n, *self.flips)
        threshold = self.limit - quantile(1 - alpha, self.df) * se
        low, high = selection_adjusted_interval(self.drop, se, threshold, df=self.df)
        # The true drop of a 0-1 score lies within +-1 (100 pts): an end of the interval at or past that bounds nothing
        # (the interval over the drops a score can have covers the truth as often as the unbounded one).
        reach = 1.0 if self.rule.spec.scale is Scale.FRACTION else math.inf
        bounded = {name: value if abs(value) < reach else None for name, value in (("low", low), ("high", high))}
        return {"selected_low": bounded["low"], "selected_high": bounded["high"]}

    def settling(self, found: NonInferiority, power: float) -> Settling | None:
        """An undecided check of a sampled task scored in repeats: more documents or more repeats, at the level its
        unsettled claim is tested at; None otherwise."""
        if found.outcome is not Outcome.UNSURE or self.variance is None:
            return None
        level = found.alpha if found.drop < found.limit else found.over_alpha
        return settling(self.variance, found.drop, found.limit, alpha=level, power=power, available=self.available)

    def judge(self, policy: Policy, over_alpha: float) -> NonInferiority:
        """The check at the policy's level for "shown within", `over_alpha` (Holm's) for "shown over"."""
        settings = {
            "alpha": policy.one_sided_alpha * self.level_share,
            "over_alpha": over_alpha * self.level_share,
            "power": policy.power,
            "available": self.available,
        }
        if self.flips is None:
            return non_inferiority(self.drop, self.se, self.windows or self.n, self.limit, df=self.df, **settings)
        higher_is_better = self.rule.spec.higher_is_better
        return paired_binary_non_inferiority(
            self.n, *self.flips, self.limit, higher_is_better=higher_is_better, **settings
        )


def _drop_evidence(
    rule: DropRule, baseline: VariantSummary, variant: VariantSummary, documents: Mapping[str, int]
) -> CheckResult | _Evidence:
    """A drop check's paired figures, or its result where there is nothing to judge."""
    metric = rule.metric
    result = partial(CheckResult, rule.constraint, metric, is_drop=True)
    if rule.baseline_value is None or rule.allowed is None:
        return result(CheckStatus.FAILED, f"baseline lacks metric {metric}")
    if variant.name == baseline.name:  # the difference with itself is zero on every document
        itself = _record(non_inferiority(0.0, 0.0, 0, rule.allowed))
        return result(CheckStatus.PASSED, f"{metric}: the baseline itself, no drop by definition", **itself)
    value = variant.value(metric)
    if value is None:
        return result(CheckStatus.FAILED, f"missing metric {metric}")
    diff, se = variant.value(paired_key(metric, "diff")), variant.value(paired_key(metric, "se"))
    if diff is None or se is None:
        shown = f"{format_value(rule.spec, rule.baseline_value)} -> {format_value(rule.spec, value)}"
        detail = f"{metric}: {Outcome.UNSURE.value}: no paired statistics logged ({shown})"
        return result(CheckStatus.UNDECIDED, detail, outcome=Outcome.UNSURE, limit=rule.allowed)
    n = int(variant.value(paired_key(metric, "n")) or 0)
    df = variant.value(paired_key(metric, "df")) or math.inf  # not logged: 0/1 scores (or an older sweep)
    logged_flips = [variant.value(paired_key(metric, name)) for name in ("correct_to_wrong", "wrong_to_correct")]
    # 0/1 scores of one pool of documents (a task, a size-weighted group) are judged on their flips: the plain paired
    # se is 0 without a flip, and five identical answers would "show" any limit; Wald bounds on any se of a difference
    # of matched proportions are liberal at the limit (quantlab.paired). A group weighted otherwise logs no flips, and an se
    # combined from its leaves' own.
    flips = None if None in logged_flips else (int(logged_flips[0]), int(logged_flips[1]))  # type: ignore[arg-type]
    drop = -diff if rule.spec.higher_is_better else diff
    if EvalKey.parse(metric) is None and math.isfinite(df):  # a per-token figure: its df is its windows less one
        windows = int(round(df)) + 1
        return _Evidence(rule, drop, se, windows, df, None, flips, windows=windows, tokens=n)
    parsed = EvalKey.parse(metric)
    share = variant.value(adaptive_key(parsed.task, "level_share")) if parsed is not None else None
    available = documents_available(metric, n, documents)
    repeats, within_sd = (variant.value(paired_key(metric, name)) for name in ("repeats", "within_sd"))
    variance = logged_variance(n, int(repeats or 1), se, within_sd) if flips is None else None
    share = 1.0 if share is None else min(share, 1.0)
    return _Evidence(rule, drop, se, n, df, available, flips, level_share=share, variance=variance)


def documents_available(metric: str, n: int, documents: Mapping[str, int]) -> int | None:
    """The documents an lm-eval score's task has (`documents`: task -> count, groups by their leaves' sum),
    where known; never fewer than the `n` it paired."""
    parsed = EvalKey.parse(metric)
    found = documents.get(parsed.task) if parsed is not None else None
    return None if found is None else max(found, n)


def _drop_checks(evidence: Sequence[CheckResult | _Evidence], policy: Policy) -> list[CheckResult]:
    """Every drop check of one variant judged: "shown within" per check at the policy's one-sided level
    (every limit must be shown within: an intersection-union test, no correction needed), "shown over" at
    Holm's levels over the checks with paired statistics (the variant is rejected if any is over)."""
    tested = [item for item in evidence if isinstance(item, _Evidence)]
    p_values = [item.p_over for item in tested]
    family = sum(math.isfinite(p) for p in p_values)
    levels = dict(zip(map(id, tested), holm_alphas(p_values, policy.one_sided_alpha)))
    judged = []
    for item in evidence:
        if isinstance(item, CheckResult):
            judged.append(item)
            continue
        found = item.judge(policy, levels[id(item)])
        way = item.settling(found, policy.power)
        words = _verdict_words(
            item.rule,
            found,
            item.n,
            family,
            item.available,
            policy.power,
            item.bounds_name,
            item.tokens,
            item.variance,
            way,
        )
        extra = {
            **_record(found),
            "n": item.n,
            "family": family,
            "documents_available": item.available,
            "is_drop": True,
            "unit": item.unit,
        }
        if found.outcome is Outcome.WITHIN:
            extra |= item.selected(found.alpha)
            extra["selected_words"] = _selected_words(
                item.rule, found.drop, extra["selected_low"], extra["selected_high"]
            )
        if way is not None:  # what the summary says would settle it: the cheaper way's own count
            extra["documents_needed"] = way.items if way.by == "items" else None
            extra["repeats_needed"] = way.repeats if way.by == "repeats" else None
        judged.append(CheckResult(item.rule.constraint, item.rule.metric, _BY_OUTCOME[found.outcome], words, **extra))
    return judged


def _selected_words(rule: DropRule, drop: float, low: float | None, high: float | None) -> str:
    def amount(value: float) -> str:
        return format_change(rule.spec, value, signed=value < 0)

    shown_low = "no lower bound" if low is None else amount(low)
    shown_high = "no upper bound" if high is None else amount(high)
    return f"{rule.metric}: drop {amount(drop)} [{shown_low}, {shown_high}]"


def _record(found: NonInferiority) -> dict[str, Any]:
    """NonInferiority's fields as a CheckResult keeps them (an infinite df, the normal quantile, as None: JSON has no inf)."""
    return asdict(found) | {"df": found.df if math.isfinite(found.df) else None}


def confidence(alpha: float) -> str:
    """A one-sided level as a confidence: 0.025 -> '97.5%', 0.025/57 -> '99.96%'."""
    return f"{100 * (1 - alpha):.4g}%"


def _verdict_words(
    rule: DropRule,
    found: NonInferiority,
    n: int,
    family: int,
    available: int | None,
    power: float,
    bounds_name: str = "bounds",
    tokens: int | None = None,
    variance: RepeatVariance | None = None,
    way: Settling | None = None,
) -> str:
    """'eval/x/acc: shown over the limit: drop 2.50 pts, one-sided 97.5% bounds from the flips [1.40 pts, 3.75 pts],
    limit 1 pt (paired, n=1,000)': the bounds the verdict used (the lower one at Holm's level when several checks
    share the variant; `bounds_name` says where they come from: on 0/1 scores, the flips, the upper bound Tango's
    score bound and the lower one the smaller of Tango's and the Wald bound on Agresti and Min's se, here the Wald
    one, under Tango's 1.52 pts), and for an undecided one
    how many documents would settle it, or what the task's documents can; for a sampled task scored in repeats
    (`variance`), more documents or more repeats, whichever adds fewer scorings (`way`, in `settling_words`)."""

    def amount(value: float) -> str:  # a drop is shown unsigned; a negative one (a gain) keeps its sign
        return format_change(rule.spec, value, signed=value < 0)

    if found.over_alpha == found.alpha:
        bounds = f"one-sided {confidence(found.alpha)} {bounds_name} [{amount(found.lower)}, {amount(found.upper)}]"
    else:
        bounds = (
            f"one-sided {bounds_name} [{amount(found.lower)} at {confidence(found.over_alpha)} (Holm, {family} checks), "
            f"{amount(found.upper)} at {confidence(found.alpha)}]"
        )
    t = f", t with {found.df:.3g} df" if math.isfinite(found.df) else ""
    paired = f"n={n:,}" if tokens is None else f"n={tokens:,} tokens in {n:,} scoring windows"
    if variance is not None:
        paired += f" documents x {variance.repeats:,} repeats"
    unit = "documents" if tokens is None else "scoring windows"
    text = f"{rule.metric}: {found.outcome.value}: drop {amount(found.drop)}, {bounds}, limit {rule.words} (paired, {paired}{t})"
    if way is not None:
        return f"{text}; {settling_words(way, power)}"
    if found.outcome is Outcome.UNSURE:
        needed = found.documents_needed
        text += (
            f"; about {needed:,} {unit} would settle it ({power:.0%} power)"
            if needed
            else f"; more {unit} would settle it"
        )
        if found.best_limit is not None and available is not None:
            task = EvalKey.parse(rule.metric)
            name = task.task if task is not None else rule.metric
            # A planning figure, not a bound: the limit a task of this size settles with the policy's power for a drop
            # like this one. The run's own bound, shown before it, is mostly tighter (a bound needs no power): "at best"
            # would contradict it.
            reach = "a limit of" if found.drop < found.limit else "a drop over"
            text += (
                f"; {name} has {available:,} documents: for a drop like this one, a task of that size shows {reach} "
                f"{amount(found.best_limit)} with {power:.0%} power"
            )
    return text


def settling_words(found: Settling, power: float, unit: str = "documents") -> str:
    """How a sampled task's undecided check would be settled, the cheaper way in scorings (`Settling.by`):
    'about 3 more repeats would settle it (40 documents x 5 repeats, 80% power)', 'about 120 documents would settle it
    (x 2 repeats, 80% power)', or why neither can."""
    at = f"{power:.0%} power"
    if found.by == "repeats" and found.repeats is not None:
        more = found.repeats - found.repeats_now
        plural = "repeat" if more == 1 else "repeats"
        return (
            f"about {more:,} more {plural} would settle it "
            f"({found.items_now:,} {unit} x {found.repeats:,} repeats, {at})"
        )
    if found.by == "items" and found.items is not None:
        return f"about {found.items:,} {unit} would settle it (x {found.repeats_now:,} repeats, {at})"
    return f"neither more repeats nor the {unit} the task has would settle it at {at}: a wider limit would"


def _bound_check(bound: Bound, variant: VariantSummary) -> CheckResult:
    metric = bound.metric
    result = partial(CheckResult, bound.constraint, metric)
    value = variant.value(metric)
    if value is None:
        why = why_unavailable(metric, variant.tags)
        return result(CheckStatus.FAILED, f"missing metric {metric}" + (f" ({why})" if why else ""))
    if (failed := bound.failed_by(value, variant.declared)) is not None:
        return result(CheckStatus.FAILED, failed)
    return result(CheckStatus.PASSED, f"{metric} is {format_value(spec(metric, variant.declared), value)}")


@dataclass(frozen=True)
class Checks:
    """The checks of a policy, made concrete against the baseline."""

    constraints: tuple[str, ...]  # the policy's limits in words, as checked (CheckResult.constraint)
    judge: Callable[[VariantSummary], tuple[CheckResult, ...]]  # every verdict on one variant


# --- The decision ---


class Status(str, Enum):  # in the order verdicts are listed
    CHOSEN = "chosen"
    COSTS_MORE = "costs_more"  # shown within every limit, but another is better by the objective
    UNDECIDED = "undecided"  # no limit shown exceeded, but not every one shown met: not enough evidence
    REJECTED = "rejected"
    FAILED = "failed"

    @property
    def words(self) -> str:
        """The status as the report and `pick` say it."""
        return _STATUS_WORDS.get(self, self.value)


_STATUS_WORDS = {Status.COSTS_MORE: "passes every limit, costs more", Status.UNDECIDED: "not enough evidence"}
_RANK = {status: rank for rank, status in enumerate(Status)}


@dataclass(frozen=True)
class Verdict:
    name: str
    status: Status
    reasons: tuple[str, ...]  # empty for the chosen variant
    objective_value: float | None
    checks: tuple[CheckResult, ...]
    # UNDECIDED: about how many documents would settle its undecided checks (None: none says;
    # checks without paired statistics need those first).
    documents_needed: int | None = None
    needed_unit: str = "documents"  # what documents_needed counts (per-token checks: scoring windows)
    # A measured objective's 95% bound on the unfavourable side (`objective_bound`): what it is ranked by
    objective_bound: float | None = None

    @property
    def ranked_by(self) -> float | None:
        return self.objective_value if self.objective_bound is None else self.objective_bound

    @property
    def basis(self) -> str:
        """What the verdict rests on: '3 checks: 2 paired drop limits ("over" Holm-corrected for 2), 1 bound'."""
        if not self.checks:
            return "no checks"
        drops = [check for check in self.checks if check.is_drop]
        family = max((check.family or 0 for check in drops), default=0)
        parts = [f"{len(drops)} drop limit{'s' * (len(drops) != 1)}"] if drops else []
        if family > 1:
            parts[0] += f' ("over" Holm-corrected for {family})'
        if bounds := len(self.checks) - len(drops):
            parts.append(f"{bounds} bound{'s' * (bounds != 1)}")
        return f"{len(self.checks)} check{'s' * (len(self.checks) != 1)}: {', '.join(parts) or 'none'}"


@dataclass(frozen=True)
class Decision:
    chosen: str | None
    baseline: str
    objective: Axis
    policy: Policy
    checks: tuple[str, ...]  # the limits as checked, after expansion against the baseline
    verdicts: tuple[Verdict, ...]  # chosen first, then by status and objective
    unchecked: tuple[str, ...] = ()  # lm-eval scores max_drop_any_task could not check, with why
    warnings: tuple[str, ...] = ()  # cost figures measured while other work competed (cost_warnings)
    grouped: tuple[str, ...] = ()  # groups max_drop_any_task checked as one score, with how many scores they hold
    control: ChoiceControl | None = None  # how the candidates were tested together: the choice's error rate

    def verdict(self, name: str) -> Verdict:
        return next(v for v in self.verdicts if v.name == name)

    @property
    def summary(self) -> str:
        direction = "higher" if self.objective.higher_is_better else "lower"
        objective = f"{self.objective.metric} ({direction} is better)"
        best = self.verdict(self.chosen).objective_value if self.chosen else None
        undecided = [  # those that would have beaten the choice, had they been shown within the limits
            v
            for v in self.verdicts
            if v.status is Status.UNDECIDED
            and (best is None or v.objective_value is None or self.objective.is_better(v.objective_value, best))
        ]
        if self.chosen is None:
            head = "No variant shown within the limits" if undecided else "No variant satisfies every constraint"
            return f"{head}; nothing chosen (objective: {objective}).{_would_need(undecided)}"
        passing = sum(v.status in (Status.CHOSEN, Status.COSTS_MORE) for v in self.verdicts)
        better = " Better by the objective but not shown within the limits:" if undecided else ""
        bound = self.verdict(self.chosen).objective_bound
        side = "lower" if self.objective.higher_is_better else "upper"
        ranked = "" if bound is None else f" (ranked by its 95% {side} bound, {_shown(self.objective, bound)})"
        return (
            f"Chosen: {self.chosen}, the best by {objective} at {_shown(self.objective, best)}{ranked} among "
            f"{passing} of {len(self.verdicts)} variants {self.passing_words}.{better}{_would_need(undecided)}"
        )

    @property
    def selection_words(self) -> str:
        """What passing did to the chosen variant's drops, with their intervals given that they passed; "" when
        nothing was chosen or it has no drop shown within (the baseline, bounds alone)."""
        if self.chosen is None:
            return ""
        shown = [check.selected_words for check in self.verdict(self.chosen).checks if check.selected_words]
        if not shown:
            return ""
        return (
            f"{self.chosen}'s figures are selected: it was chosen for passing its checks, which favours draws that "
            "came out low, so its observed drops flatter it. Its drops with 95% intervals given that they passed "
            "(conditional inference on the normal approximation, truncated where the check passes): "
            + "; ".join(shown)
            + "."
        )

    @property
    def passing_words(self) -> str:
        """What passing the policy means: a drop limit is shown within (a claim at the policy's level), a bound on a
        logged figure is met (a plain comparison)."""
        kinds = {check.is_drop for verdict in self.verdicts for check in verdict.checks}
        if kinds == {False}:
            return "meeting every limit"
        if kinds == {True, False}:
            return "shown within every drop limit and meeting every bound"
        return "shown within every limit"

    def to_dict(self) -> dict[str, Any]:
        """The JSON decision record."""
        return {
            "chosen": self.chosen,
            "summary": self.summary,
            "baseline": self.baseline,
            "objective": self.objective.to_dict(),
            "policy": self.policy.model_dump(mode="json"),
            "checks": list(self.checks),
            "unchecked": list(self.unchecked),
            "grouped": list(self.grouped),
            "warnings": list(self.warnings),
            "error_control": self.control.to_dict() if self.control else None,
            "selection": self.selection_words,
            "variants": [asdict(verdict) for verdict in self.verdicts],  # str enums: their values in JSON
        }


def _shown(objective: Axis, value: float | None) -> str:
    return format_value(spec(objective.metric), value)


def _would_need(undecided: Sequence[Verdict]) -> str:
    """' int4 would need ~2,053 documents and has no paired statistics for quality/ppl.'"""
    words = []
    for verdict in undecided:
        unpaired = [c.metric for c in verdict.checks if c.status is CheckStatus.UNDECIDED and c.drop is None]
        parts = (
            [f"would need ~{verdict.documents_needed:,} {verdict.needed_unit}{_more_than_it_has(verdict)}"]
            if verdict.documents_needed
            else []
        )
        parts += [
            f"would need {check.metric}'s documents scored ~{check.repeats_needed:,} times each"
            for check in verdict.checks
            if check.status is CheckStatus.UNDECIDED and check.repeats_needed
        ]
        parts += [f"has no paired statistics for {', '.join(unpaired)}"] if unpaired else []
        words.append(f"{verdict.name} {' and '.join(parts) or 'is not shown within the limits'}")
    return f" {'; '.join(words)}." if words else ""


def _more_than_it_has(verdict: Verdict) -> str:
    """' (its task has 1,172: more are needed, or a wider limit)' where the documents needed exceed the task's."""
    neediest = max(
        (check for check in verdict.checks if check.documents_needed is not None),
        key=lambda check: check.documents_needed or 0,
        default=None,
    )
    available = neediest.documents_available if neediest is not None else None
    if available is None or verdict.documents_needed is None or verdict.documents_needed <= available:
        return ""
    task = EvalKey.parse(neediest.metric) if neediest is not None else None
    return f" ({task.task if task else 'its task'} has {available:,}: more documents, or a wider limit)"


def objective_bound(variant: VariantSummary, objective: Axis) -> float | None:
    """The end of a measured objective's logged 95% interval that is worse for the variant (the upper end of a cost,
    the lower end of a throughput): a variant ranks ahead on its bound, not on one lucky draw. None where the run
    logged no interval; infinity for an interval unbounded on that side."""
    end = "ci95_low" if objective.higher_is_better else "ci95_high"
    low, high = (variant.value(f"{objective.metric}/{name}") for name in ("ci95_low", "ci95_high"))
    if low is None and high is None:
        return None
    found = variant.value(f"{objective.metric}/{end}")
    return found if found is not None else (-math.inf if objective.higher_is_better else math.inf)


def _ranked_value(variant: VariantSummary, objective: Axis) -> float | None:
    bound = objective_bound(variant, objective)
    return variant.value(objective.metric) if bound is None else bound


def left_out(variants: Sequence[VariantSummary], rests_on: Sequence[str]) -> tuple[str, ...]:
    """One line per variant left out of the decision because a figure it `rests_on` was timed on a load level other
    work competed with, after the serve stage's re-runs."""
    lines = []
    for variant in variants:
        reasons = [why for metric in dict.fromkeys(rests_on) if (why := rests_on_contention(metric, variant.tags))]
        if variant.succeeded and reasons:
            lines.append(f"{variant.name}: left out of the decision: {'; '.join(reasons)}")
    return tuple(lines)


def contended(variant: VariantSummary) -> bool:
    """Whether the variant's speed figures were measured while other work competed for its cores."""
    return variant.succeeded and variant.tags.get(CONTENDED_TAG) == "true"


def cost_warnings(variants: Sequence[VariantSummary], rests_on: Sequence[str] = ()) -> tuple[str, ...]:
    """One line per variant whose speed was timed under contention, naming it and the load it saw; first, when
    a metric the decision `rests_on` (its objective, its bounds) is a timing, that the choice rests on it."""
    flagged = [variant for variant in variants if contended(variant)]
    lines = [
        f"{variant.name}: speed figures measured while other work competed for its cores "
        f"({variant.tags.get(CONTENTION_TAG, 'no details recorded').removeprefix('contended: ')})"
        for variant in flagged
    ]
    timings = list(dict.fromkeys(metric for metric in rests_on if spec(metric).timed))
    lines += left_out(variants, timings)
    if flagged and timings:
        names = ", ".join(variant.name for variant in flagged)
        lines.insert(
            0,
            f"the decision rests on {', '.join(timings)}, timed under contention for {names}: "
            "rerun the sweep with --force on a quiet machine before a release rests on this choice",
        )
    elif flagged:
        lines.append("rerun the sweep with --force on a quiet machine before a release rests on these speed figures")
    return tuple(lines) + served_as_notes(variants)


def served_as_notes(variants: Sequence[VariantSummary]) -> tuple[str, ...]:
    """One line per variant its engine ran as another format than the one stored (a weight-only fallback, an
    emulation: the method's declaration for that engine and device, `quantlab.quantize.base.Support.served_as`)."""
    served_as = tuple(
        f"{variant.name}: served as {label} by {variant.tags.get(SERVING_TAG + 'engine', 'its engine')} on this "
        f"hardware; its serving figures describe that format, not {variant.method} as stored"
        for variant in variants
        if (label := variant.tags.get(SERVING_TAG + "served_as"))
    )
    not_stock = tuple(
        f"{variant.name}: served with quantlab's engine plugin {plugins}, not the stock "
        f"{variant.tags.get(SERVING_TAG + 'engine', 'engine')}: its serving figures are not what users get, and no "
        "cost decision rests on them"
        for variant in variants
        if (plugins := variant.tags.get(NOT_STOCK_TAG))
    )
    return served_as + not_stock


def pick(
    variants: Sequence[VariantSummary],
    baseline_name: str,
    policy: Policy,
    objective: Axis,
    *,
    groups: Mapping[str, Group] | None = None,
    documents: Mapping[str, int] | None = None,
) -> Decision:
    """The best variant by `objective` among those shown within every limit of `policy`; ties go to the smaller use of
    the drop limits (sum of drop / limit), then the lower mean KL, then the name: same inputs, same answer.
    `groups`: the sweep's lm-eval groups (group score key -> leaves and weights), each checked as one score by
    `max_drop_any_task`; `documents`: lm-eval task -> the documents it has, where known (what more can settle)."""
    ensure_unique_names(variants)
    baseline = next((v for v in variants if v.name == baseline_name), None)
    if baseline is None:
        names = ", ".join(v.name for v in variants) or "none"
        raise DecisionError(f"baseline {baseline_name!r} is not among the variants ({names})")
    groups, documents = groups or {}, dict(documents or {})
    # A group has the documents of its leaves.
    for key, group in groups.items():
        leaves = [EvalKey.parse(leaf) for leaf in group.leaves]
        counts = [documents.get(leaf.task) if leaf is not None else None for leaf in leaves]
        parsed = EvalKey.parse(key)
        if parsed is not None and counts and None not in counts:
            documents.setdefault(parsed.task, sum(counts))  # type: ignore[arg-type]
    bounds = policy.bounds()
    candidates = {v.name: _ranked_value(v, objective) for v in variants if v.succeeded and v.name != baseline.name}
    try:
        order = sequence_order(candidates, policy.sequence, objective.higher_is_better)
    except SequenceError as error:
        refused = PolicyError(str(error))
        refused.field, refused.recipe_field = "sequence", "frontier.default_policy.sequence"
        raise refused from None
    # Bonferroni's level for every candidate's claims, or the policy's (the fixed sequence keeps it).
    level = ChoiceControl(policy.candidates, order, policy.one_sided_alpha).candidate_alpha
    judging = policy if level == policy.one_sided_alpha else policy.model_copy(update={"one_sided_alpha": level})
    if (policy.max_drop or policy.max_drop_any_task is not None) and not baseline.succeeded:
        # Drops need a baseline that ran: when it failed, no variant can pass them.
        usable = f"baseline {baseline.name} succeeded (drops are measured against it)"
        failed = CheckResult(
            usable,
            "",
            CheckStatus.FAILED,
            f"baseline {baseline.name} failed, so drops against it cannot be measured",
            is_drop=True,
        )
        rules: tuple[DropRule, ...] = ()
        constraints = (usable,)

        def drop_results(variant: VariantSummary) -> list[CheckResult]:
            return [failed]
    else:  # raises PolicyError for a limit that does not fit its metric as the sweep declared it
        rules = policy.drop_rules(baseline.metrics, baseline.declared, groups)
        constraints = tuple(rule.constraint for rule in rules)

        def drop_results(variant: VariantSummary) -> list[CheckResult]:
            return _drop_checks([_drop_evidence(rule, baseline, variant, documents) for rule in rules], judging)

    def evaluate(variant: VariantSummary) -> tuple[CheckResult, ...]:
        return (*drop_results(variant), *(_bound_check(bound, variant) for bound in bounds))

    checks = Checks((*constraints, *(bound.constraint for bound in bounds)), evaluate)
    # Timed figures: a server's load, and the batch-1 timing the serve stage takes from its single-stream level.
    timed = [metric for metric in (objective.metric, *(bound.metric for bound in bounds)) if spec(metric).timed]
    judged = {variant.name: _judge(variant, checks, objective, timed) for variant in variants}
    within = {name: _shown_within_every_drop_limit(judged[name]) for name in order}
    control = control_choice(policy.candidates, order, within, policy.one_sided_alpha, has_drop_limits=bool(rules))
    for name in control.untested:
        if judged[name].status is Status.COSTS_MORE:
            judged[name] = replace(judged[name], status=Status.UNDECIDED, reasons=(control.untested_reason(name),))

    by_name = {variant.name: variant for variant in variants}
    satisfying = sorted(
        (verdict for verdict in judged.values() if verdict.status is Status.COSTS_MORE),
        key=lambda v: (objective.sort_key(v.ranked_by), *_quality_tie_break(v, by_name[v.name]), v.name),  # type: ignore[arg-type]
    )
    chosen = satisfying[0] if satisfying else None
    if chosen is not None:
        judged[chosen.name] = replace(chosen, status=Status.CHOSEN)
        for runner_up in satisfying[1:]:
            judged[runner_up.name] = replace(runner_up, reasons=(_costs_more_reason(runner_up, chosen, objective),))

    def listed(v: Verdict) -> tuple[int, float, str]:
        return _RANK[v.status], math.inf if v.objective_value is None else objective.sort_key(v.objective_value), v.name

    any_task = policy.max_drop_any_task is not None and baseline.succeeded
    checked = {rule.metric for rule in rules}
    return Decision(
        chosen=chosen.name if chosen else None,
        baseline=baseline.name,
        objective=objective,
        policy=policy,
        checks=checks.constraints,
        verdicts=tuple(sorted(judged.values(), key=listed)),
        unchecked=tuple(unchecked_by_any_task(baseline.metrics, baseline.declared, groups) if any_task else ()),
        warnings=cost_warnings(variants, [objective.metric, *(bound.metric for bound in bounds)]),
        grouped=tuple(
            f"{key} (one check for its {len(group.leaves)} leaves; name a leaf in max_drop to check it alone)"
            for key, group in sorted(groups.items())
            if key in checked and key not in policy.max_drop and any_task
        ),
        control=control,
    )


def _shown_within_every_drop_limit(verdict: Verdict) -> bool:
    drops = [check for check in verdict.checks if check.is_drop]
    return verdict.status is not Status.FAILED and all(check.status is CheckStatus.PASSED for check in drops)


def _judge(variant: VariantSummary, checks: Checks, objective: Axis, timed: Sequence[str] = ()) -> Verdict:
    if not variant.succeeded:
        return Verdict(variant.name, Status.FAILED, ("failed",), None, ())
    results = checks.judge(variant)
    failed = [result.detail for result in results if result.status is CheckStatus.FAILED]
    if timed and (plugins := variant.tags.get(NOT_STOCK_TAG)):
        failed.append(
            f"served with quantlab's engine plugin {plugins} (not the stock engine): kept out of a decision on "
            + ", ".join(timed)
        )
    failed += [f"left out: {why}" for metric in timed if (why := rests_on_contention(metric, variant.tags))]
    undecided = [result for result in results if result.status is CheckStatus.UNDECIDED]
    objective_value = variant.value(objective.metric)
    if objective_value is None:
        failed.append(f"missing metric {objective.metric} (the objective)")
    # Undecided checks are reasons too: the reader sees everything that stands in the way.
    reasons = (*failed, *(result.detail for result in undecided))
    if failed:
        return Verdict(variant.name, Status.REJECTED, reasons, objective_value, results)
    neediest = max(
        (r for r in undecided if r.documents_needed is not None), key=lambda r: r.documents_needed or 0, default=None
    )
    needed = neediest.documents_needed if neediest is not None else None
    # Passing every check is COSTS_MORE until ranked (the best becomes CHOSEN).
    status = Status.UNDECIDED if undecided else Status.COSTS_MORE
    unit = neediest.unit if neediest is not None else "documents"
    bound = objective_bound(variant, objective)
    return Verdict(variant.name, status, reasons, objective_value, results, needed, unit, bound)


def _quality_tie_break(verdict: Verdict, variant: VariantSummary) -> tuple[float, float]:
    """(share of the drop limits used, mean KL): smaller is better."""
    drops = [(r.drop, r.limit) for r in verdict.checks if r.drop is not None and r.limit is not None]
    used = sum((drop / limit if limit > 0 else drop for drop, limit in drops), 0.0)
    kld = variant.value(KLD_MEAN)
    return used, math.inf if kld is None else kld


def _costs_more_reason(verdict: Verdict, chosen: Verdict, objective: Axis) -> str:
    if verdict.objective_bound is not None or chosen.objective_bound is not None:
        side = "lower" if objective.higher_is_better else "upper"
        value, best = _shown(objective, verdict.ranked_by), _shown(objective, chosen.ranked_by)
        if verdict.ranked_by == chosen.ranked_by:
            return f"ties {chosen.name} on the 95% {side} bound of {objective.metric} ({value}) and loses the tie-break"
        return f"ranks after {chosen.name} by the 95% {side} bound of {objective.metric}: {value} vs {best}"
    value, best = _shown(objective, verdict.objective_value), _shown(objective, chosen.objective_value)
    if verdict.objective_value == chosen.objective_value:
        return (
            f"ties {chosen.name} on {objective.metric} ({value}) "
            "and loses the tie-break (more of the drop limits used, higher KL, or later name)"
        )
    return f"costs more: {objective.metric} {value} vs {best} for {chosen.name}"
