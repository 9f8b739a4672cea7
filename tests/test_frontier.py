"""Pareto fronts judged against paired noise, directions from the metric contract, frontier settings.

Noise comes from real per-document scores through `paired.compare` (0/1 answers built so that a
variant flips a chosen number of documents), never from a stand-in.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from pydantic import ValidationError

from quantlab.frontier import (
    Axis,
    AxisPair,
    FrontierPoint,
    FrontierSettings,
    Group,
    Margin,
    UnknownDirectionError,
    VariantSummary,
    compute_frontiers,
    cost_order,
    describe_comparison,
    dominates,
    frontiers_to_dict,
    logged_comparison,
    merged_declared,
    paired_noise,
    pareto_front,
)
from quantlab.metrics import Declared, Scale, paired_key, spec
from quantlab.paired import Aggregation, DocumentScores, compare, paired_binary_non_inferiority

ACC = "eval/mmlu_dev/acc"
GSM = "eval/gsm8k/exact_match:strict-match"
ERRORS = "eval/toxic/rate"  # a 0-1 score lm-eval declares lower-is-better
KLD = "quality/kld_mean"
WEIGHTS = "cost/weight_bytes"
DECODE = "cost/decode_tokens_per_s"
DECLARED = {
    ACC: Declared(True, Scale.FRACTION),
    GSM: Declared(True, Scale.FRACTION),
    ERRORS: Declared(False, Scale.FRACTION),
}

ACC_VS_WEIGHTS = AxisPair(Axis(ACC, True), Axis(WEIGHTS, False))
ERRORS_VS_WEIGHTS = AxisPair(Axis(ERRORS, False), Axis(WEIGHTS, False))
KLD_VS_WEIGHTS = AxisPair(Axis(KLD, False), Axis(WEIGHTS, False))
ACC_VS_DECODE = AxisPair(Axis(ACC, True), Axis(DECODE, True))
N = 1000


def dominated(result):
    return {point.name: point.dominated_by for point in result.points if point.dominated_by}


def ties(result):
    return {point.name: point.tied_with for point in result.points if point.tied_with}


def answers(right_to_wrong: int = 0, wrong_to_right: int = 0, *, n: int = N, right: int = 600) -> dict[int, float]:
    """0/1 scores on n documents: the reference answers the first `right` correctly; this one
    loses `right_to_wrong` of those and gains `wrong_to_right` of the others."""
    scores = {doc: float(doc < right) for doc in range(n)}
    for doc in range(right_to_wrong):
        scores[doc] = 0.0
    for doc in range(right, right + wrong_to_right):
        scores[doc] = 1.0
    return scores


def paired_figures(metric: str, baseline: dict[int, float], variant: dict[int, float]) -> dict[str, float]:
    """The quality/paired/... figures a run logs for `variant` against `baseline`."""
    found = compare(metric, DocumentScores(Aggregation.MEAN, baseline), DocumentScores(Aggregation.MEAN, variant))
    return {paired_key(metric, stat): value for stat, value in found.statistics().items()}


def sweep(pair: AxisPair, *variants: tuple[str, dict[int, float], float], baseline: str | None = None):
    """Variants placed by (name, per-document scores, cost): the logged score is the documents' mean."""
    summaries = [
        VariantSummary(
            name,
            name,
            True,
            {pair.quality.metric: sum(docs.values()) / len(docs), pair.cost.metric: cost},
            is_baseline=name == baseline,
            declared=DECLARED,
        )
        for name, docs, cost in variants
    ]
    documents = {name: {pair.quality.metric: DocumentScores(Aggregation.MEAN, docs)} for name, docs, _ in variants}
    return summaries, paired_noise(summaries, documents, {})


# --------------------------------------------------------------------------------------
# Dominance with paired noise
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pair", "points", "front", "expected_dominated", "expected_ties"),
    [
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(), 100), ("b", answers(25, 5), 200)],
            {"a"},
            {"b": ("a",)},
            {},
            id="cheaper-and-better-beyond-noise-dominates",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(3, 1), 100), ("b", answers(), 200)],
            {"a"},
            {"b": ("a",)},
            {"a": ("b",), "b": ("a",)},
            id="cheaper-slightly-worse-within-noise-dominates-the-dearer-tie",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(1, 3), 100), ("b", answers(), 200)],
            {"a"},
            {"b": ("a",)},
            {"a": ("b",), "b": ("a",)},
            id="cheaper-better-within-noise-dominates",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(12, 0), 100), ("b", answers(), 200)],
            {"a", "b"},
            {},
            {},
            id="cheaper-shown-worse-never-dominates",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(), 100), ("b", answers(30, 0), 100)],
            {"a"},
            {"b": ("a",)},
            {},
            id="equal-cost-better-beyond-noise-dominates",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(), 100), ("b", answers(2, 0), 100)],
            {"a", "b"},
            {},
            {"a": ("b",), "b": ("a",)},
            id="equal-cost-within-noise-is-a-tie",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(), 100), ("b", answers(), 100)],
            {"a", "b"},
            {},
            {"a": ("b",), "b": ("a",)},
            id="identical-documents-equal-cost-a-tie-neither-dominates",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(), 100), ("b", answers(), 150)],
            {"a"},
            {"b": ("a",)},
            {"a": ("b",), "b": ("a",)},
            id="identical-documents-cheaper-dominates",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(n=40, right=20), 100), ("b", answers(n=40, right=20), 150)],
            {"a"},
            {"b": ("a",)},
            {"a": ("b",), "b": ("a",)},
            id="identical-on-40-documents-cheaper-dominates",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(12, 0), 100), ("b", answers(), 200), ("c", answers(), 300)],
            {"a", "b"},
            {"c": ("b",)},
            {"b": ("c",), "c": ("b",)},
            id="dearer-shown-better-keeps-its-place-its-identical-dearer-twin-does-not",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(), 200), ("b", answers(100, 0), 100)],
            {"a", "b"},
            {},
            {},
            id="trade-off-keeps-both",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", answers(), 100), ("b", answers(), 100), ("c", answers(40, 0), 200)],
            {"a", "b"},
            {"c": ("a", "b")},
            {"a": ("b",), "b": ("a",)},
            id="several-dominators-listed",
        ),
        pytest.param(
            ERRORS_VS_WEIGHTS,
            [("a", answers(), 100), ("b", answers(0, 40), 100)],
            {"a"},
            {"b": ("a",)},
            {},
            id="lower-is-better-more-errors-beyond-noise-dominated",
        ),
        pytest.param(
            ERRORS_VS_WEIGHTS,
            [("a", answers(0, 2), 100), ("b", answers(), 200)],
            {"a"},
            {"b": ("a",)},
            {"a": ("b",), "b": ("a",)},
            id="lower-is-better-cheaper-within-noise-dominates",
        ),
        pytest.param(
            ERRORS_VS_WEIGHTS,
            [("a", answers(0, 12), 100), ("b", answers(), 200)],
            {"a", "b"},
            {},
            {},
            id="lower-is-better-cheaper-with-more-errors-beyond-noise-keeps-both",
        ),
        pytest.param(
            ACC_VS_DECODE,
            [("fast", answers(), 50), ("slow", answers(30, 0), 40)],
            {"fast"},
            {"slow": ("fast",)},
            {},
            id="higher-is-better-cost",
        ),
    ],
)
def test_dominance_is_judged_against_paired_noise(pair, points, front, expected_dominated, expected_ties):
    variants, noise = sweep(pair, *points)

    result = pareto_front(variants, pair, noise)

    assert set(result.on_front) == front
    assert dominated(result) == expected_dominated
    assert ties(result) == expected_ties
    assert result.point_compared == ()  # every pair had per-document scores


@pytest.mark.parametrize(
    ("cost", "low", "high", "expected"),
    [
        (1, -0.02, 0.03, True),  # cheaper beyond the noise; the dearer one's quality advantage is not shown
        (1, -0.0876, 0.0876, True),  # cheaper, identical answers on 40 documents (zero flips: Tango's bounds)
        (1, 0.0, 0.0, True),  # cheaper, unpaired and equal
        (1, 0.01, 0.05, True),  # cheaper and shown better
        (1, -0.05, -0.01, False),  # cheaper but shown worse: a trade-off
        (1, -0.01, -0.01, False),  # unpaired, cheaper and worse
        (0, 0.01, 0.05, True),  # costs within noise of each other, shown better
        (0, 0.01, 0.01, True),  # unpaired, better at a cost tie
        (0, -0.02, 0.03, False),  # a tie on both axes
        (0, -0.0876, 0.0876, False),  # identical answers at a cost tie
        (0, 0.0, 0.0, False),  # unpaired, equal on both
        (-1, 0.01, 0.05, False),  # dearer beyond the noise never dominates
        (-1, -0.02, 0.03, False),
    ],
)
def test_dominance_is_shown_better_on_one_axis_and_worse_on_neither(cost, low, high, expected):
    margin = Margin(low, high, paired=low != high)
    assert dominates(cost, margin) is expected
    # Read the other way round (the second over the first), the two never dominate each other
    assert not (dominates(cost, margin) and dominates(-cost, Margin(-high, -low, margin.paired)))


def test_each_pair_is_compared_one_way_and_read_backwards_the_other():
    """Intervals from flips are the verdict's on the metric's direction (here lower is better), and one pair's two
    readings mirror each other; a variant's comparison with the baseline from its logged figures is the same."""
    n = 200
    variants, noise = sweep(
        ERRORS_VS_WEIGHTS,
        ("a", answers(0, 3, n=n, right=100), 100),
        ("b", answers(6, 0, n=n, right=100), 200),
        ("base", answers(n=n, right=100), 300),
        baseline="base",
    )
    for first, second in (("a", "b"), ("base", "a"), ("base", "b")):
        forward, backward = noise(ERRORS, first, second), noise(ERRORS, second, first)
        assert (backward.ci95_low, backward.ci95_high) == pytest.approx((-forward.ci95_high, -forward.ci95_low))
        flips = (forward.correct_to_wrong, forward.wrong_to_correct)
        verdict = paired_binary_non_inferiority(n, *flips, 0.01, higher_is_better=False)
        assert (forward.ci95_low, forward.ci95_high) == pytest.approx((verdict.lower, verdict.upper), rel=1e-12)
    logged = [
        replace(v, metrics=v.metrics | paired_figures(ERRORS, answers(n=n, right=100), answers(0, 3, n=n, right=100)))
        if v.name == "a"
        else v
        for v in variants
    ]
    from_logs = paired_noise(logged, {}, {})
    for first, second in (("base", "a"), ("a", "base")):
        shown, expected = from_logs(ERRORS, first, second), noise(ERRORS, first, second)
        assert (shown.ci95_low, shown.ci95_high) == pytest.approx((expected.ci95_low, expected.ci95_high), rel=1e-12)


def test_the_issue_example_is_a_loss_not_noise():
    """n=1000, 0.60 -> 0.58 with 25 right->wrong and 5 wrong->right: McNemar p = 3e-4."""
    variants, noise = sweep(ACC_VS_WEIGHTS, ("bf16", answers(), 270), ("fp8", answers(25, 5), 270), baseline="bf16")

    result = pareto_front(variants, ACC_VS_WEIGHTS, noise)
    versus = result.point("fp8").vs_baseline

    assert dominated(result) == {"fp8": ("bf16",)}
    assert versus.correct_to_wrong == 25 and versus.wrong_to_correct == 5
    assert describe_comparison(versus, spec(ACC, DECLARED)).startswith("-2.00 pts [-3.")
    assert "p=3e-4, 25 right→wrong / 5 wrong→right" in describe_comparison(versus, spec(ACC, DECLARED))
    low, high = result.point("fp8").interval
    assert low == pytest.approx(0.58 + versus.ci95_low - versus.diff) and high > 0.58 > low
    assert result.point("bf16").interval is None  # the baseline has no difference to itself


def test_without_paired_noise_points_are_compared_and_the_result_says_so():
    variants = [
        VariantSummary(name, name, True, {ACC: acc, WEIGHTS: cost}, declared=DECLARED)
        for name, acc, cost in (("a", 0.60, 100), ("b", 0.59, 200), ("c", 0.55, 50))
    ]

    result = pareto_front(variants, ACC_VS_WEIGHTS)

    assert dominated(result) == {"b": ("a",)}  # a point difference decides, as nothing else is known
    assert ties(result) == {}
    assert result.point_compared == (("a", "b"), ("a", "c"), ("b", "c"))
    assert frontiers_to_dict(compute_frontiers(variants))["frontiers"][0]["no_paired_noise"] == [
        ["a", "b"],
        ["a", "c"],
        ["b", "c"],
    ]


def test_logged_paired_figures_serve_against_the_baseline():
    """Runs without samples.json v2: the variant's own quality/paired/... figures (variant minus baseline)."""
    logged = compare(ACC, DocumentScores(Aggregation.MEAN, answers()), DocumentScores(Aggregation.MEAN, answers(2, 1)))
    figures = paired_figures(ACC, answers(), answers(2, 1))
    base = VariantSummary("bf16", "bf16", True, {ACC: 0.6, WEIGHTS: 270}, is_baseline=True, declared=DECLARED)
    fp8 = VariantSummary("fp8", "fp8", True, {ACC: 0.599, WEIGHTS: 170, **figures}, declared=DECLARED)
    noise = paired_noise([base, fp8], {}, {})

    result = pareto_front([base, fp8], ACC_VS_WEIGHTS, noise)

    assert ties(result) == {"bf16": ("fp8",), "fp8": ("bf16",)}
    assert result.point("fp8").vs_baseline.diff == pytest.approx(logged.diff)
    assert noise(ACC, "fp8", "bf16").diff == pytest.approx(-logged.diff)  # the other way round
    assert noise(ACC, "fp8", "bf16").wrong_to_correct == logged.correct_to_wrong


def test_a_run_logged_with_zero_flips_as_0_0_reads_back_with_the_verdicts_interval():
    """An older run logged zero flips' interval as [0, 0], which no verdict used: read back, it is the flips' own."""
    figures = paired_figures(ACC, answers(n=40, right=20), answers(n=40, right=20))
    low, high = paired_key(ACC, "ci95_low"), paired_key(ACC, "ci95_high")
    older = VariantSummary("fp8", "fp8", True, {ACC: 0.5, **figures, low: 0.0, high: 0.0}, declared=DECLARED)
    found = logged_comparison(older, ACC)
    assert (found.ci95_low, found.ci95_high) == pytest.approx((figures[low], figures[high]), rel=1e-12)
    assert found.ci95_low < 0 < found.ci95_high


def test_group_scores_are_compared_from_their_leaves_with_the_stored_weights():
    group, leaves = "eval/mmlu/acc", ("eval/mmlu_a/acc", "eval/mmlu_b/acc")
    docs = {
        "bf16": (answers(n=500, right=300), answers(n=500, right=300)),
        "int4": (answers(20, 0, n=500, right=300), answers(15, 5, n=500, right=300)),
    }
    declared = {key: Declared(True, Scale.FRACTION) for key in (group, *leaves)}
    variants = [
        VariantSummary(name, name, True, {group: 0.6, WEIGHTS: cost}, is_baseline=name == "bf16", declared=declared)
        for name, cost in (("bf16", 270), ("int4", 100))
    ]
    documents = {
        name: {leaf: DocumentScores(Aggregation.MEAN, d) for leaf, d in zip(leaves, pair)}
        for name, pair in docs.items()
    }

    noise = paired_noise(variants, documents, {group: Group(leaves, (0.5, 0.5))})
    found = noise(group, "bf16", "int4")

    assert found.correct_to_wrong == 35 and found.wrong_to_correct == 5  # flips of the leaves add up
    assert found.diff == pytest.approx(-30 / 1000)
    assert found.test == "mcnemar_exact"  # size weights: one pool of documents


def test_documents_of_different_tasks_versions_give_no_paired_noise():
    variants, _ = sweep(ACC_VS_WEIGHTS, ("a", answers(), 100), ("b", answers(), 200))
    documents = {
        "a": {ACC: DocumentScores(Aggregation.MEAN, answers())},
        "b": {ACC: DocumentScores(Aggregation.MEAN, answers(n=900))},
    }

    result = pareto_front(variants, ACC_VS_WEIGHTS, paired_noise(variants, documents, {}))

    assert result.point_compared == (("a", "b"),)


# --------------------------------------------------------------------------------------
# Failed and incomplete variants
# --------------------------------------------------------------------------------------


def summary(name: str, succeeded: bool = True, baseline: bool = False, **metrics: float) -> VariantSummary:
    keys = {"acc": ACC, "kld": KLD, "weights": WEIGHTS, "decode": DECODE}
    return VariantSummary(
        name, name, succeeded, {keys.get(k, k): v for k, v in metrics.items()}, is_baseline=baseline, declared=DECLARED
    )


@pytest.mark.parametrize(
    ("variants", "expected_reason"),
    [
        pytest.param([summary("x", succeeded=False, acc=0.5, weights=1)], "failed", id="failed"),
        pytest.param([summary("x", weights=1)], f"missing metric {ACC}", id="missing-quality"),
        pytest.param([summary("x", acc=0.5)], f"missing metric {WEIGHTS}", id="missing-cost"),
        pytest.param([summary("x")], f"missing metric {ACC}, {WEIGHTS}", id="missing-both"),
        pytest.param([summary("x", acc=math.nan, weights=1)], f"missing metric {ACC}", id="nan-is-missing"),
        pytest.param([summary("x", acc=0.5, weights=math.inf)], f"missing metric {WEIGHTS}", id="inf-is-missing"),
    ],
)
def test_variants_that_cannot_be_placed_are_excluded_with_a_reason(variants, expected_reason):
    result = pareto_front([summary("placed", acc=0.1, weights=1e9), *variants], ACC_VS_WEIGHTS)

    assert [(e.name, e.reason) for e in result.excluded] == [("x", expected_reason)]
    assert result.on_front == ("placed",)


def test_failed_variant_with_good_numbers_does_not_dominate_and_a_failed_baseline_gives_no_intervals():
    variants = [
        summary("base", succeeded=False, baseline=True, acc=0.9, weights=1),
        summary("ok", acc=0.5, weights=100),
    ]

    result = pareto_front(variants, ACC_VS_WEIGHTS)

    assert result.on_front == ("ok",) and result.point("base") is None
    assert result.point("ok").vs_baseline is None
    assert compute_frontiers(variants).vs_baseline == {}


def test_points_are_ordered_cheapest_first_then_best_quality_then_name():
    variants = [
        summary(n, acc=a, decode=d)
        for n, a, d in (("slow", 0.9, 10), ("fast-b", 0.5, 50), ("fast-a", 0.5, 50), ("fast-good", 0.6, 50))
    ]

    assert [p.name for p in pareto_front(variants, ACC_VS_DECODE).points] == ["fast-good", "fast-a", "fast-b", "slow"]


def test_on_frontier_overall_means_on_the_front_of_at_least_one_pair():
    variants = [
        summary("bf16", baseline=True, acc=0.50, kld=0.0, weights=270),
        summary("fp8", acc=0.49, kld=0.03, weights=170),
        summary("lossy", acc=0.40, kld=0.30, weights=170),
        summary("tiny", acc=0.45, kld=0.50, weights=90),
    ]

    settings = FrontierSettings(axes=[{"quality": ACC, "cost": WEIGHTS}, {"quality": KLD, "cost": WEIGHTS}])

    assert compute_frontiers(variants, settings).on_front == {"bf16", "fp8", "tiny"}


def test_duplicate_names_and_several_baselines_are_errors():
    with pytest.raises(ValueError, match="unique"):
        pareto_front([summary("a", acc=1, weights=1), summary("a", acc=1, weights=1)], ACC_VS_WEIGHTS)
    with pytest.raises(ValueError, match="several variants are marked as baseline"):
        pareto_front(
            [summary("a", baseline=True, acc=1, weights=1), summary("b", baseline=True, acc=1, weights=1)],
            ACC_VS_WEIGHTS,
        )


# --------------------------------------------------------------------------------------
# Directions from the contract and the sweep's declarations
# --------------------------------------------------------------------------------------


def test_default_axes_take_every_declared_score_including_filtered_ones_and_name_the_unknown():
    variants = [
        VariantSummary(
            "bf16",
            "bf16",
            True,
            {
                ACC: 0.5,
                ACC.replace("acc", "acc_stderr"): 0.05,
                GSM: 0.3,
                "eval/custom/score": 3.0,
                KLD: 0.0,
                WEIGHTS: 270,
                DECODE: 40,
            },
            is_baseline=True,
            declared={ACC: DECLARED[ACC], GSM: DECLARED[GSM]},
        )
    ]

    frontiers = compute_frontiers(variants)

    assert [r.pair.name for r in frontiers.results] == [
        f"{GSM} vs {WEIGHTS}",
        f"{ACC} vs {WEIGHTS}",
        f"{KLD} vs {WEIGHTS}",
        f"{GSM} vs {DECODE}",
        f"{ACC} vs {DECODE}",
        f"{KLD} vs {DECODE}",
    ]
    assert frontiers.direction_unknown == ("eval/custom/score",)
    assert frontiers_to_dict(frontiers)["direction_unknown"] == ["eval/custom/score"]
    assert frontiers.results[0].pair.quality.unit is Scale.FRACTION


def test_an_undeclared_score_gets_no_axis_whatever_its_name():
    """`acc` is not guessed: without the sweep's declaration its direction is unknown."""
    variants = [VariantSummary("a", "a", True, {ACC: 0.5, WEIGHTS: 1.0})]

    assert FrontierSettings().axis_pairs(variants, merged_declared(variants)) == ()
    assert compute_frontiers(variants).direction_unknown == (ACC,)


def test_declarations_are_merged_and_a_disagreement_makes_the_direction_unknown():
    lower = Declared(False, Scale.FRACTION)
    variants = [
        VariantSummary("a", "a", True, {}, declared={ACC: DECLARED[ACC]}),
        VariantSummary("b", "b", True, {}, declared={GSM: DECLARED[GSM], ACC: lower}),
    ]

    assert merged_declared(variants) == {ACC: Declared(None, Scale.FRACTION), GSM: DECLARED[GSM]}


def test_default_axis_pairs_skip_speed_when_nobody_measured_it():
    variants = [summary("a", acc=0.5, weights=1), summary("b", succeeded=False, acc=0.5, decode=10)]

    assert [pair.name for pair in FrontierSettings().axis_pairs(variants, merged_declared(variants))] == [
        f"{ACC} vs {WEIGHTS}"
    ]


def test_axis_direction_from_the_contract_or_given():
    assert Axis.of(KLD) == Axis(KLD, False)
    assert Axis.of(GSM, declared=DECLARED) == Axis(GSM, True)
    assert Axis.of("eval/custom/score", True) == Axis("eval/custom/score", True)
    with pytest.raises(UnknownDirectionError, match="eval/custom/score"):
        Axis.of("eval/custom/score")


# --------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        pytest.param({"axes": [{"quality": ACC, "cost": WEIGHTS, "colour": "red"}]}, "extra", id="extra-axis-field"),
        pytest.param({"unknown_key": 1}, "extra", id="extra-top-level-field"),
        pytest.param(
            {"axes": [{"quality": "custom/score", "cost": WEIGHTS}]}, "custom/score", id="not-in-the-contract"
        ),
        pytest.param({"objective": "cost/dollars"}, "cost/dollars", id="unknown-objective-direction"),
        pytest.param({"default_policy": {"max_drop": {ACC: -1}}}, ">= 0", id="negative-drop"),
        pytest.param(
            {"default_policy": {"min_top1_agreement": 90}}, "less than or equal to 1", id="top1-is-a-fraction"
        ),
    ],
)
def test_frontier_settings_reject_bad_input(settings, error):
    with pytest.raises(ValidationError, match=error):
        FrontierSettings.model_validate(settings)


def test_an_lm_eval_axis_loads_before_the_sweep_and_takes_its_direction_from_the_declarations():
    settings = FrontierSettings.model_validate(
        {"axes": [{"quality": GSM, "cost": DECODE}, {"quality": "eval/custom/score", "cost": DECODE}]}
    )
    variants = [VariantSummary("a", "a", True, {GSM: 0.3, "eval/custom/score": 1.0, DECODE: 10.0}, declared=DECLARED)]

    frontiers = compute_frontiers(variants, settings)

    assert [r.pair for r in frontiers.results] == [AxisPair(Axis(GSM, True), Axis(DECODE, True))]
    assert frontiers.direction_unknown == ("eval/custom/score",)


def test_frontier_settings_explicit_directions_and_defaults():
    settings = FrontierSettings.model_validate(
        {
            "axes": [{"quality": "eval/custom/score", "quality_higher_is_better": True, "cost": DECODE}],
            "objective": "cost/dollars_per_mtok",
            "objective_higher_is_better": False,
        }
    )

    (pair,) = settings.axis_pairs([summary("a", decode=10.0, **{"eval/custom/score": 1.0})], DECLARED)
    assert pair == AxisPair(Axis("eval/custom/score", True), Axis(DECODE, True))
    assert settings.objective_axis() == Axis("cost/dollars_per_mtok", False)
    assert FrontierSettings().axes is None and FrontierSettings().objective_axis() == Axis(WEIGHTS, False)


def test_frontiers_to_dict_is_json_with_ties_and_intervals():
    variants, noise = sweep(
        ACC_VS_WEIGHTS, ("bf16", answers(), 270), ("fp8", answers(2, 1), 170), ("gone", answers(), 1), baseline="bf16"
    )
    variants[2] = VariantSummary("gone", "gone", False, {})

    record = json.loads(json.dumps(frontiers_to_dict(compute_frontiers(variants, noise=noise))))

    (frontier,) = record["frontiers"]
    points = {p["name"]: p for p in frontier["points"]}
    # fp8 is cheaper and not shown worse: it dominates, and their quality is a tie within noise
    assert record["on_frontier"] == ["fp8"] and points["bf16"]["dominated_by"] == ["fp8"]
    assert points["fp8"]["tied_with"] == ["bf16"] and points["bf16"]["tied_with"] == ["fp8"]
    assert points["fp8"]["vs_baseline"]["correct_to_wrong"] == 2
    assert points["fp8"]["interval"][0] < points["fp8"]["quality"] < points["fp8"]["interval"][1]
    assert frontier["excluded"] == [{"name": "gone", "reason": "failed"}]
    assert frontier["no_paired_noise"] == []


# --- measured costs with intervals ------------------------------------------------------------------------------

USD = "cost/serving/usd_per_mtok"
KLD_VS_USD = AxisPair(Axis(KLD, False), Axis(USD, False))


def _served(name: str, kld: float, usd: float, ends: tuple[float, float] | None, tags: dict | None = None):
    interval = {} if ends is None else {f"{USD}/ci95_low": ends[0], f"{USD}/ci95_high": ends[1]}
    metrics = {KLD: kld, USD: usd} | interval
    return VariantSummary(name, name, True, metrics, tags or {}, is_baseline=name == "bf16")


def test_a_variant_is_cheaper_only_beyond_the_cost_noise():
    """fp8's dollars overlap bf16's: a tie on cost, where bf16's lower KL dominates it. On the point figures alone
    fp8 would be cheaper, and on the front. int4 is cheaper beyond the noise."""
    with_noise = [
        _served("bf16", 0.0, 3.0, (2.8, 3.2)),
        _served("fp8", 0.02, 2.9, (2.7, 3.1)),
        _served("int4", 0.1, 1.0, (0.9, 1.1)),
    ]
    result = pareto_front(with_noise, KLD_VS_USD)
    assert dominated(result) == {"fp8": ("bf16",)} and result.on_front == ("int4", "bf16")
    assert result.point("fp8").cost_tied_with == ("bf16",) and result.point("int4").cost_tied_with == ()
    assert result.point("fp8").cost_interval == (2.7, 3.1)
    points_only = [_served(v.name, v.metrics[KLD], v.metrics[USD], None) for v in with_noise]
    assert dominated(pareto_front(points_only, KLD_VS_USD)) == {}


def _rounds(usd: tuple[float, ...]) -> dict[str, float]:
    return {f"{USD}/round_{number}": value for number, value in enumerate(usd, 1)}


DRIFT = (1.0, 1.5, 2.0)  # the machine slowed over the rounds: every variant's runs alike


@pytest.mark.parametrize(
    ("first", "second", "order"),
    [
        # 10% dearer in every round: called, though each one's interval over its runs overlaps the other's
        ((2.0, (1.0, 2.0), DRIFT), (2.2, (1.1, 2.2), tuple(1.1 * v for v in DRIFT)), 1),
        ((2.2, (1.1, 2.2), tuple(1.1 * v for v in DRIFT)), (2.0, (1.0, 2.0), DRIFT), -1),
        # the rounds' ratios 0.8, 1.3, 0.9: their interval holds 1, a tie
        ((1.0, (0.9, 1.1), (1.0, 1.0, 1.0)), (1.0, (0.5, 1.5), (0.8, 1.3, 0.9)), 0),
        # rounds on one side only, or in different numbers: the intervals decide (these overlap)
        ((2.0, (1.0, 2.0), DRIFT), (2.2, (1.1, 2.2), ()), 0),
        ((2.0, (1.0, 2.0), DRIFT), (2.2, (1.1, 2.2), (1.1, 1.65)), 0),
        # no rounds: intervals apart are called
        ((1.0, (0.9, 1.1), ()), (2.0, (1.8, 2.2), ()), 1),
    ],
)
def test_costs_measured_in_the_same_rounds_are_compared_round_by_round(first, second, order):
    cheaper = Axis(USD, False)
    a, b = (
        FrontierPoint(name, name, 0.0, cost, cost_interval=ends, cost_rounds=rounds)
        for name, (cost, ends, rounds) in (("a", first), ("b", second))
    )
    assert cost_order(cheaper, a, b) == order and cost_order(cheaper, b, a) == -order


def test_the_frontier_reads_each_variant_s_rounds_and_pairs_them():
    """fp8 costs 10% more than bf16 in each of three rounds that slowed down alike: dearer beyond the noise, where
    without the rounds their intervals overlap, a tie on cost."""
    bf16 = _served("bf16", 0.0, 1.5, (0.3, 2.7))
    fp8 = _served("fp8", 0.02, 1.65, (0.33, 2.97))
    paired = [replace(bf16, metrics=bf16.metrics | _rounds(DRIFT))]
    paired.append(replace(fp8, metrics=fp8.metrics | _rounds(tuple(1.1 * v for v in DRIFT))))
    result = pareto_front(paired, KLD_VS_USD)
    assert dominated(result) == {"fp8": ("bf16",)} and result.point("fp8").cost_rounds == pytest.approx(
        (1.1, 1.65, 2.2)
    )
    assert result.point("fp8").cost_tied_with == () and result.point("bf16").cost_tied_with == ()
    assert pareto_front([bf16, fp8], KLD_VS_USD).point("fp8").cost_tied_with == ("bf16",)


def test_a_cost_resting_on_a_contended_level_is_left_out_of_the_frontier_with_why():
    tags = {"quantlab.serving.contended_levels": "c4", "quantlab.serving.contention.c4": "contended: 1.02 cores"}
    variants = [_served("bf16", 0.0, 3.0, None), _served("fp8", 0.02, 1.0, None, tags)]
    result = pareto_front(variants, KLD_VS_USD)
    assert [point.name for point in result.points] == ["bf16"]
    (exclusion,) = result.excluded
    assert exclusion.name == "fp8" and exclusion.reason.startswith(f"{USD} rests on load level c4")
    # The weight size does not rest on the load: fp8 stays on that frontier
    sized = [replace(v, metrics=v.metrics | {WEIGHTS: 1e6}) for v in variants]
    assert pareto_front(sized, AxisPair(Axis(KLD, False), Axis(WEIGHTS, False))).excluded == ()
