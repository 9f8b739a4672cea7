"""Picking under constraints: every rejection reason, no winner, tie-breaks, CLI parsing."""

from __future__ import annotations

import itertools
import json

import pytest

from quantlab.decision import (
    ConstraintParseError,
    Constraints,
    DecisionError,
    Status,
    parse_max_drop,
    parse_max_drops,
    pick,
)
from quantlab.frontier import Axis, PolicySettings, VariantSummary

ACC = "eval/mmlu_dev/acc"
CLOZE = "eval/cloze/acc"
KLD = "quality/kld_mean"
TOP1 = "quality/top1_agreement"
WEIGHTS = "cost/weight_bytes"
PEAK = "cost/peak_memory_bytes"
DECODE = "cost/decode_tokens_per_s"
TTFT = "cost/ttft_ms_p99"

BY_SIZE = Axis(WEIGHTS, higher_is_better=False)
BY_SPEED = Axis(DECODE, higher_is_better=True)

BASELINE_METRICS = {ACC: 0.50, CLOZE: 0.60, KLD: 0.0, TOP1: 1.0, WEIGHTS: 270e6, PEAK: 1.2e9, DECODE: 40.0, TTFT: 100.0}


def baseline(**overrides: float) -> VariantSummary:
    return VariantSummary("bf16", "bf16", True, {**BASELINE_METRICS, **overrides}, is_baseline=True)


def candidate(name: str = "fp8", *, drop: tuple[str, ...] = (), succeeded: bool = True, **overrides: float) -> VariantSummary:
    """A cheaper variant close to the baseline; `drop` removes metrics, overrides change them."""
    metrics = {**BASELINE_METRICS, KLD: 0.03, TOP1: 0.9, WEIGHTS: 170e6, **overrides}
    return VariantSummary(name, name, succeeded, {k: v for k, v in metrics.items() if k not in drop})


def decide(variants, constraints: Constraints, objective: Axis = BY_SIZE):
    return pick(variants, "bf16", constraints, objective)


# --------------------------------------------------------------------------------------
# Rejection reasons
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("constraints", "variant", "expected_reason"),
    [
        pytest.param(
            Constraints(max_drop_points={ACC: 1.0}), candidate(**{ACC: 0.48}),
            f"{ACC} dropped 2.00 pts, over the 1 pts limit", id="task-drop",
        ),
        pytest.param(
            Constraints(max_drop_points_any_task=1.0), candidate(**{CLOZE: 0.55}),
            f"{CLOZE} dropped 5.00 pts, over the 1 pts limit", id="any-task-drop",
        ),
        pytest.param(
            Constraints(max_drop_points={ACC: 1.0}), candidate(drop=(ACC,)),
            f"missing metric {ACC}", id="missing-task-metric",
        ),
        pytest.param(
            Constraints(max_drop_points_any_task=1.0), candidate(drop=(CLOZE,)),
            f"missing metric {CLOZE}", id="missing-metric-of-any-task-limit",
        ),
        pytest.param(
            Constraints(max_kld_mean=0.1), candidate(**{KLD: 0.18}),
            f"{KLD} is 0.18, above the maximum of 0.1", id="kld",
        ),
        pytest.param(
            Constraints(max_kld_mean=0.1), candidate(drop=(KLD,)), f"missing metric {KLD}", id="missing-kld",
        ),
        pytest.param(
            Constraints(min_top1_agreement=0.95), candidate(**{TOP1: 0.9}),
            f"{TOP1} is 90.0%, below the minimum of 95.0%", id="top1",
        ),
        pytest.param(
            Constraints(max_peak_memory_bytes=1e9), candidate(**{PEAK: 1.1e9}),
            f"{PEAK} is 1.1 GB, above the maximum of 1.0 GB", id="peak-memory",
        ),
        pytest.param(
            Constraints(max_peak_memory_bytes=1e9), candidate(drop=(PEAK,)), f"missing metric {PEAK}", id="missing-peak-memory",
        ),
        pytest.param(
            Constraints(at_most={TTFT: 50.0}), candidate(), f"{TTFT} is 100.0 ms, above the maximum of 50.0 ms", id="generic-upper",
        ),
        pytest.param(
            Constraints(at_least={DECODE: 60.0}), candidate(), f"{DECODE} is 40.0 tok/s, below the minimum of 60.0 tok/s", id="generic-lower",
        ),
        pytest.param(
            Constraints(), candidate(drop=(WEIGHTS,)), f"missing metric {WEIGHTS} (the objective)", id="missing-objective",
        ),
        pytest.param(Constraints(), candidate(succeeded=False), "failed", id="failed"),
    ],
)
def test_each_rejection_reason(constraints, variant, expected_reason):
    decision = decide([baseline(), variant], constraints)

    verdict = decision.verdict(variant.name)
    assert verdict.status in (Status.REJECTED, Status.FAILED)
    assert expected_reason in verdict.reasons
    assert decision.chosen != variant.name


def test_every_failed_constraint_is_listed_not_only_the_first():
    variant = candidate(**{ACC: 0.40, KLD: 0.5, TOP1: 0.5})

    decision = decide([baseline(), variant], Constraints(max_drop_points={ACC: 1.0}, max_kld_mean=0.1, min_top1_agreement=0.8))

    assert len(decision.verdict("fp8").reasons) == 3


def test_drop_over_the_limit_but_within_noise_is_rejected_and_says_so():
    base = baseline(**{ACC + "_stderr": 0.05})
    variant = candidate(**{ACC: 0.47, ACC + "_stderr": 0.05})

    decision = decide([base, variant], Constraints(max_drop_points={ACC: 1.0}))

    (reason,) = decision.verdict("fp8").reasons
    assert "over the 1 pts limit" in reason and "within noise" in reason
    assert decision.verdict("fp8").checks[0].within_noise


def test_a_drop_of_exactly_the_limit_passes_despite_float_rounding():
    # 0.50 - 0.49 is 0.010000000000000009 in binary floating point.
    decision = decide([baseline(), candidate(**{ACC: 0.49})], Constraints(max_drop_points={ACC: 1.0}))

    assert decision.chosen == "fp8"


def test_improvements_pass_drop_limits():
    decision = decide([baseline(), candidate(**{ACC: 0.7})], Constraints(max_drop_points={ACC: 0.0}))

    assert decision.chosen == "fp8"


def test_satisfying_but_more_expensive_variants_say_so():
    decision = decide([baseline(), candidate()], Constraints(max_drop_points_any_task=1.0))

    assert decision.chosen == "fp8"
    (reason,) = decision.reasons["bf16"]
    assert reason.startswith("satisfies constraints but costs more")
    assert decision.verdict("bf16").status is Status.COSTS_MORE


def test_no_variant_satisfying_gives_no_choice_and_reasons_for_all():
    variants = [baseline(**{PEAK: 2e9}), candidate(**{PEAK: 3e9}), candidate("broken", succeeded=False)]

    decision = decide(variants, Constraints(max_peak_memory_bytes=1e9))

    assert decision.chosen is None
    assert set(decision.reasons) == {"bf16", "fp8", "broken"}
    assert all(decision.reasons.values())
    assert decision.summary.startswith("No variant satisfies")


def test_baseline_that_failed_cannot_vouch_for_drops():
    variants = [baseline(), candidate()]
    failed_baseline = VariantSummary("bf16", "bf16", False, {}, is_baseline=True)

    decision = decide([failed_baseline, variants[1]], Constraints(max_drop_points_any_task=1.0))

    assert decision.chosen is None
    assert any("baseline bf16 failed" in reason for reason in decision.reasons["fp8"])


def test_baseline_that_failed_is_irrelevant_without_drop_limits():
    failed_baseline = VariantSummary("bf16", "bf16", False, {}, is_baseline=True)

    assert decide([failed_baseline, candidate()], Constraints(max_kld_mean=0.1)).chosen == "fp8"


def test_baseline_lacking_the_metric_rejects_instead_of_passing():
    decision = decide([baseline(), candidate()], Constraints(max_drop_points={"eval/mmlu/acc": 1.0}))

    assert decision.chosen is None
    assert decision.reasons["fp8"] == ("baseline lacks metric eval/mmlu/acc",)


def test_unknown_baseline_name_is_an_error():
    with pytest.raises(DecisionError, match="'fp16' is not among the variants"):
        pick([baseline(), candidate()], "fp16", Constraints(), BY_SIZE)


# --------------------------------------------------------------------------------------
# Choice and tie-breaks
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variants", "objective", "expected"),
    [
        pytest.param(
            [candidate("int4", **{WEIGHTS: 90e6}), candidate("fp8", **{WEIGHTS: 170e6})], BY_SIZE, "int4",
            id="smallest-weights",
        ),
        pytest.param(
            [candidate("a", **{DECODE: 50.0}), candidate("b", **{DECODE: 80.0})], BY_SPEED, "b",
            id="fastest-when-higher-is-better",
        ),
        pytest.param(
            [candidate("a", **{ACC: 0.495}), candidate("b", **{ACC: 0.50})], BY_SIZE, "b",
            id="tie-on-cost-smaller-drop-wins",
        ),
        pytest.param(
            [candidate("a", **{KLD: 0.05}), candidate("b", **{KLD: 0.02})], BY_SIZE, "b",
            id="tie-on-cost-and-drop-lower-kld-wins",
        ),
        pytest.param([candidate("b"), candidate("a")], BY_SIZE, "a", id="full-tie-name-wins"),
    ],
)
def test_pick_chooses_the_best_satisfying_variant(variants, objective, expected):
    constraints = Constraints(max_drop_points_any_task=1.0)

    for order in itertools.permutations([baseline(), *variants]):
        assert pick(list(order), "bf16", constraints, objective).chosen == expected


def test_tie_loser_is_told_it_lost_the_tie_break():
    decision = decide([baseline(), candidate("b"), candidate("a")], Constraints())

    (reason,) = decision.reasons["b"]
    assert "ties a" in reason


def test_verdicts_are_ordered_chosen_then_cheapest():
    variants = [
        baseline(), candidate("int4", **{WEIGHTS: 90e6, ACC: 0.3}), candidate("fp8"), candidate("x", succeeded=False),
    ]

    decision = decide(variants, Constraints(max_drop_points_any_task=1.0))

    assert [(v.name, v.status) for v in decision.verdicts] == [
        ("fp8", Status.CHOSEN), ("bf16", Status.COSTS_MORE), ("int4", Status.REJECTED), ("x", Status.FAILED),
    ]


def test_decision_record_is_json():
    decision = decide([baseline(), candidate()], Constraints(max_drop_points={ACC: 1.0}, max_kld_mean=0.1))

    record = json.loads(json.dumps(decision.to_dict()))

    assert record["chosen"] == "fp8"
    assert record["objective"] == {"metric": WEIGHTS, "higher_is_better": False}
    assert record["constraints"]["max_drop_points"] == {ACC: 1.0}
    assert [v["status"] for v in record["variants"]] == ["chosen", "costs_more"]
    assert record["checks"] == [f"{ACC} at most 1 pts worse than the baseline", f"{KLD} at most 0.1"]


def test_constraints_from_policy_expand_against_the_baseline():
    policy = PolicySettings(max_drop={ACC: 2.0}, max_drop_any_task=0.5, max_kld=0.1)

    checks = Constraints.from_policy(policy).checks_for(baseline())

    described = [check.describe() for check in checks]
    assert described == [
        f"{ACC} at most 2 pts worse than the baseline",
        f"{CLOZE} at most 0.5 pts worse than the baseline",
        f"{KLD} at most 0.1",
    ]


@pytest.mark.parametrize(
    "arguments",
    [
        {"max_drop_points": {ACC: -1.0}},
        {"max_drop_points": {ACC: float("nan")}},
        {"max_drop_points_any_task": -0.5},
        {"max_kld_mean": float("inf")},
        {"at_most": {"": 1.0}},
    ],
)
def test_constraints_reject_nonsense_limits(arguments):
    with pytest.raises(ValueError):
        Constraints(**arguments)


# --------------------------------------------------------------------------------------
# METRIC=POINTS
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"{ACC}=1.0", (ACC, 1.0)),
        (f"{ACC}=1", (ACC, 1.0)),
        (f" {ACC} = 0.5 ", (ACC, 0.5)),
        (f"{ACC}=0", (ACC, 0.0)),
    ],
)
def test_parse_max_drop(text, expected):
    assert parse_max_drop(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(ACC, "expected METRIC=POINTS", id="no-equals"),
        pytest.param("=1.0", "metric name before '=' is missing", id="no-metric"),
        pytest.param(f"{ACC}=", "points after '=' are missing", id="no-points"),
        pytest.param(f"{ACC}=one", "must be a number", id="not-a-number"),
        pytest.param(f"{ACC}=1%", f"write {ACC}=1", id="percent-sign"),
        pytest.param(f"{ACC}=-1", "must be >= 0", id="negative"),
        pytest.param(f"{ACC}=nan", "finite", id="nan"),
        pytest.param(f"{ACC}=inf", "finite", id="inf"),
        pytest.param(f"{ACC}_stderr=1", "standard error", id="stderr-key"),
    ],
)
def test_parse_max_drop_errors(text, message):
    with pytest.raises(ConstraintParseError, match=message):
        parse_max_drop(text)


def test_parse_max_drops_collects_several():
    assert parse_max_drops([f"{ACC}=1", f"{CLOZE}=2.5"]) == {ACC: 1.0, CLOZE: 2.5}


def test_parse_max_drops_rejects_repeats():
    with pytest.raises(ConstraintParseError, match="given twice"):
        parse_max_drops([f"{ACC}=1", f"{ACC}=2"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("eval/mmlu_dev/ac=1", f"did you mean {ACC}"),
        ("eval/zzz/qqq=1", f"logged: {CLOZE}, {ACC}"),
    ],
)
def test_parse_max_drops_checks_known_metrics(text, message):
    known = set(BASELINE_METRICS) | {ACC + "_stderr"}

    with pytest.raises(ConstraintParseError, match=message):
        parse_max_drops([text], known_metrics=known)
