"""Pick the variant to ship: the best by the objective among those shown to meet the policy (pure).

Drops are judged by non-inferiority on the paired statistics each variant logged against the
baseline; without them a drop check is undecided. Bounds compare the logged value; a metric a
check needs that a variant did not log rejects it (a missing measurement never counts as a pass).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from enum import Enum
from functools import partial
from typing import Any

from quantlab.frontier import Axis, VariantSummary, ensure_unique_names
from quantlab.measure.contention import CONTENDED_TAG, CONTENTION_TAG, is_timing_metric
from quantlab.metrics import paired_key, spec
from quantlab.paired import NonInferiority, Outcome, agresti_min_se, float_slack, non_inferiority
from quantlab.policy import KLD_MEAN, Bound, DropRule, Policy, format_change, format_value, unchecked_by_any_task


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
    detail: str  # the verdict in words, with the interval; the reason when not passed
    # Drop checks only (NonInferiority's fields), in the metric's own units (0-1 for fractions; positive = worse):
    outcome: Outcome | None = None
    drop: float | None = None
    lower: float | None = None  # one-sided 95% bounds of the drop
    upper: float | None = None
    limit: float | None = None  # the largest allowed drop
    n: int | None = None  # documents (or tokens) paired
    documents_needed: int | None = None  # undecided: about how many would settle it


def _drop_check(rule: DropRule, baseline: VariantSummary, variant: VariantSummary) -> CheckResult:
    """Lose at most `rule.allowed` of `rule.metric` against the baseline, shown by non-inferiority."""
    metric = rule.metric
    result = partial(CheckResult, rule.constraint, metric)
    if rule.baseline_value is None or rule.allowed is None:
        return result(CheckStatus.FAILED, f"baseline lacks metric {metric}")
    if variant.name == baseline.name:  # the difference with itself is zero on every document
        itself = asdict(non_inferiority(0.0, 0.0, 0, rule.allowed))
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
    flips = [variant.value(paired_key(metric, name)) for name in ("correct_to_wrong", "wrong_to_correct")]
    if None not in flips:
        # 0/1 scores: with no flip the plain paired se is 0, and five identical answers would
        # "show" any limit; Agresti and Min's adjusted se says how little they show.
        se = agresti_min_se(n, int(flips[0]), int(flips[1]))
    drop = -diff if rule.spec.higher_is_better else diff
    found = non_inferiority(drop, se, n, rule.allowed)
    return result(_BY_OUTCOME[found.outcome], _verdict_words(rule, found, n), n=n, **asdict(found))


def _verdict_words(rule: DropRule, found: NonInferiority, n: int) -> str:
    """'eval/x/acc: shown over the limit: drop 2.00 pts, one-sided 95% bounds [1.09 pts, 2.91 pts], limit 1 pt
    (paired, n=1,000)', and for an undecided one how many documents would settle it."""

    def amount(value: float) -> str:  # a drop is shown unsigned; a negative one (a gain) keeps its sign
        return format_change(rule.spec, value, signed=value < 0)

    text = (
        f"{rule.metric}: {found.outcome.value}: drop {amount(found.drop)}, one-sided 95% bounds "
        f"[{amount(found.lower)}, {amount(found.upper)}], limit {rule.words} (paired, n={n:,})"
    )
    if found.outcome is Outcome.UNSURE:
        needed = found.documents_needed
        text += f"; about {needed:,} documents would settle it" if needed else "; more documents would settle it"
    return text


def _bound_check(bound: Bound, variant: VariantSummary) -> CheckResult:
    metric, limit, upper = bound.metric, bound.limit, bound.upper
    result = partial(CheckResult, bound.constraint, metric)
    value = variant.value(metric)
    if value is None:
        return result(CheckStatus.FAILED, f"missing metric {metric}")
    passed = value <= limit + float_slack(limit) if upper else value >= limit - float_slack(limit)
    contract = spec(metric, variant.declared)
    shown = f"{metric} is {format_value(contract, value)}"
    if not passed:
        side = "above the maximum" if upper else "below the minimum"
        shown += f", {side} of {format_value(contract, limit)}"
    return result(CheckStatus.PASSED if passed else CheckStatus.FAILED, shown)


# A check: its limit in words (CheckResult.constraint), and its verdict on one variant.
Check = tuple[str, Callable[[VariantSummary], CheckResult]]


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


_STATUS_WORDS = {Status.COSTS_MORE: "shown within every limit, costs more", Status.UNDECIDED: "not enough evidence"}
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
        return (
            f"Chosen: {self.chosen}, the best by {objective} at {_shown(self.objective, best)} among "
            f"{passing} of {len(self.verdicts)} variants shown within every limit.{better}{_would_need(undecided)}"
        )

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
            "warnings": list(self.warnings),
            "variants": [asdict(verdict) for verdict in self.verdicts],  # str enums: their values in JSON
        }


def _shown(objective: Axis, value: float | None) -> str:
    return format_value(spec(objective.metric), value)


def _would_need(undecided: Sequence[Verdict]) -> str:
    """' int4 would need ~2,053 documents and has no paired statistics for quality/ppl.'"""
    words = []
    for verdict in undecided:
        unpaired = [c.metric for c in verdict.checks if c.status is CheckStatus.UNDECIDED and c.drop is None]
        parts = [f"would need ~{verdict.documents_needed:,} documents"] if verdict.documents_needed else []
        parts += [f"has no paired statistics for {', '.join(unpaired)}"] if unpaired else []
        words.append(f"{verdict.name} {' and '.join(parts) or 'is not shown within the limits'}")
    return f" {'; '.join(words)}." if words else ""


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
    timings = list(dict.fromkeys(metric for metric in rests_on if is_timing_metric(metric)))
    if flagged and timings:
        names = ", ".join(variant.name for variant in flagged)
        lines.insert(
            0,
            f"the decision rests on {', '.join(timings)}, timed under contention for {names}: "
            "rerun the sweep with --force on a quiet machine before a release rests on this choice",
        )
    elif flagged:
        lines.append("rerun the sweep with --force on a quiet machine before a release rests on these speed figures")
    return tuple(lines)


def pick(variants: Sequence[VariantSummary], baseline_name: str, policy: Policy, objective: Axis) -> Decision:
    """The best variant by `objective` among those shown within every limit of `policy`; ties go to the smaller use of
    the drop limits (sum of drop / limit), then the lower mean KL, then the name: same inputs, same answer."""
    ensure_unique_names(variants)
    baseline = next((v for v in variants if v.name == baseline_name), None)
    if baseline is None:
        names = ", ".join(v.name for v in variants) or "none"
        raise DecisionError(f"baseline {baseline_name!r} is not among the variants ({names})")
    checks: list[Check]
    if (policy.max_drop or policy.max_drop_any_task is not None) and not baseline.succeeded:
        # Drops need a baseline that ran: when it failed, no variant can pass them.
        usable = f"baseline {baseline.name} succeeded (drops are measured against it)"
        failed = CheckResult(
            usable, "", CheckStatus.FAILED, f"baseline {baseline.name} failed, so drops against it cannot be measured"
        )
        checks = [(usable, lambda variant: failed)]
    else:  # raises PolicyError for a limit that does not fit its metric as the sweep declared it
        rules = policy.drop_rules(baseline.metrics, baseline.declared)
        checks = [(rule.constraint, partial(_drop_check, rule, baseline)) for rule in rules]
    checks += [(bound.constraint, partial(_bound_check, bound)) for bound in policy.bounds()]
    judged = {variant.name: _judge(variant, checks, objective) for variant in variants}

    by_name = {variant.name: variant for variant in variants}
    satisfying = sorted(
        (verdict for verdict in judged.values() if verdict.status is Status.COSTS_MORE),
        key=lambda v: (objective.sort_key(v.objective_value), *_quality_tie_break(v, by_name[v.name]), v.name),  # type: ignore[arg-type]
    )
    chosen = satisfying[0] if satisfying else None
    if chosen is not None:
        judged[chosen.name] = replace(chosen, status=Status.CHOSEN)
        for runner_up in satisfying[1:]:
            judged[runner_up.name] = replace(runner_up, reasons=(_costs_more_reason(runner_up, chosen, objective),))

    def listed(v: Verdict) -> tuple[int, float, str]:
        return _RANK[v.status], math.inf if v.objective_value is None else objective.sort_key(v.objective_value), v.name

    any_task = policy.max_drop_any_task is not None and baseline.succeeded
    return Decision(
        chosen=chosen.name if chosen else None,
        baseline=baseline.name,
        objective=objective,
        policy=policy,
        checks=tuple(constraint for constraint, _ in checks),
        verdicts=tuple(sorted(judged.values(), key=listed)),
        unchecked=tuple(unchecked_by_any_task(baseline.metrics, baseline.declared) if any_task else ()),
        warnings=cost_warnings(variants, [objective.metric, *(bound.metric for bound in policy.bounds())]),
    )


def _judge(variant: VariantSummary, checks: Sequence[Check], objective: Axis) -> Verdict:
    if not variant.succeeded:
        return Verdict(variant.name, Status.FAILED, ("failed",), None, ())
    results = tuple(evaluate(variant) for _, evaluate in checks)
    failed = [result.detail for result in results if result.status is CheckStatus.FAILED]
    undecided = [result for result in results if result.status is CheckStatus.UNDECIDED]
    objective_value = variant.value(objective.metric)
    if objective_value is None:
        failed.append(f"missing metric {objective.metric} (the objective)")
    # Undecided checks are reasons too: the reader sees everything that stands in the way.
    reasons = (*failed, *(result.detail for result in undecided))
    if failed:
        return Verdict(variant.name, Status.REJECTED, reasons, objective_value, results)
    needed = max((r.documents_needed for r in undecided if r.documents_needed is not None), default=None)
    # Passing every check is COSTS_MORE until ranked (the best becomes CHOSEN).
    status = Status.UNDECIDED if undecided else Status.COSTS_MORE
    return Verdict(variant.name, status, reasons, objective_value, results, needed)


def _quality_tie_break(verdict: Verdict, variant: VariantSummary) -> tuple[float, float]:
    """(share of the drop limits used, mean KL): smaller is better."""
    drops = [(r.drop, r.limit) for r in verdict.checks if r.drop is not None and r.limit is not None]
    used = sum((drop / limit if limit > 0 else drop for drop, limit in drops), 0.0)
    kld = variant.value(KLD_MEAN)
    return used, math.inf if kld is None else kld


def _costs_more_reason(verdict: Verdict, chosen: Verdict, objective: Axis) -> str:
    value, best = _shown(objective, verdict.objective_value), _shown(objective, chosen.objective_value)
    if verdict.objective_value == chosen.objective_value:
        return (
            f"ties {chosen.name} on {objective.metric} ({value}) "
            "and loses the tie-break (more of the drop limits used, higher KL, or later name)"
        )
    return f"costs more: {objective.metric} {value} vs {best} for {chosen.name}"
