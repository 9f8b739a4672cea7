"""Pareto fronts, exclusions, within-noise differences and frontier settings."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from quantlab.frontier import (
    Axis,
    AxisPair,
    FrontierSettings,
    QualityDelta,
    UnknownDirectionError,
    VariantSummary,
    combined_stderr,
    compute_frontiers,
    default_axis_pairs,
    format_metric,
    frontiers_to_dict,
    metric_info,
    on_frontier_names,
    pareto_front,
    quality_delta,
)

ACC = "eval/mmlu_dev/acc"
KLD = "quality/kld_mean"
WEIGHTS = "cost/weight_bytes"
DECODE = "cost/decode_tokens_per_s"

ACC_VS_WEIGHTS = AxisPair(Axis(ACC, True), Axis(WEIGHTS, False))
KLD_VS_WEIGHTS = AxisPair(Axis(KLD, False), Axis(WEIGHTS, False))
ACC_VS_DECODE = AxisPair(Axis(ACC, True), Axis(DECODE, True))
KLD_VS_DECODE = AxisPair(Axis(KLD, False), Axis(DECODE, True))


def variant(name: str, succeeded: bool = True, baseline: bool = False, **metrics: float) -> VariantSummary:
    """Metrics as keyword arguments: `acc=` etc. map to the logged keys below."""
    keys = {"acc": ACC, "acc_stderr": ACC + "_stderr", "kld": KLD, "weights": WEIGHTS, "decode": DECODE}
    return VariantSummary(
        name=name,
        method=name,
        succeeded=succeeded,
        metrics={keys.get(key, key): value for key, value in metrics.items()},
        is_baseline=baseline,
    )


def on_pair(pair: AxisPair, *points: tuple[str, float, float]) -> list[VariantSummary]:
    """Variants placed directly by (name, quality, cost) on the pair's metrics."""
    return [
        VariantSummary(name, name, True, {pair.quality.metric: quality, pair.cost.metric: cost})
        for name, quality, cost in points
    ]


# --------------------------------------------------------------------------------------
# Pareto set
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pair", "points", "expected_front", "expected_dominated"),
    [
        pytest.param(
            ACC_VS_WEIGHTS, [("a", 0.5, 100), ("b", 0.4, 200)], {"a"}, {"b": ("a",)},
            id="cheaper-and-better-dominates",
        ),
        pytest.param(
            ACC_VS_WEIGHTS, [("a", 0.5, 200), ("b", 0.4, 100)], {"a", "b"}, {},
            id="trade-off-keeps-both",
        ),
        pytest.param(
            ACC_VS_WEIGHTS, [("a", 0.5, 100), ("b", 0.5, 100)], {"a", "b"}, {},
            id="exact-tie-keeps-both",
        ),
        pytest.param(
            ACC_VS_WEIGHTS, [("a", 0.5, 100), ("b", 0.4, 100)], {"a"}, {"b": ("a",)},
            id="same-cost-better-quality-dominates",
        ),
        pytest.param(
            ACC_VS_WEIGHTS, [("a", 0.5, 100), ("b", 0.5, 150)], {"a"}, {"b": ("a",)},
            id="same-quality-cheaper-dominates",
        ),
        pytest.param(
            ACC_VS_WEIGHTS,
            [("a", 0.6, 100), ("b", 0.6, 100), ("c", 0.5, 200)],
            {"a", "b"},
            {"c": ("a", "b")},
            id="several-dominators-listed",
        ),
        pytest.param(
            KLD_VS_WEIGHTS, [("a", 0.03, 100), ("b", 0.18, 100)], {"a"}, {"b": ("a",)},
            id="lower-is-better-quality",
        ),
        pytest.param(
            ACC_VS_DECODE, [("fast", 0.5, 50), ("slow", 0.5, 40)], {"fast"}, {"slow": ("fast",)},
            id="higher-is-better-cost",
        ),
        pytest.param(
            KLD_VS_DECODE,
            [("a", 0.01, 30), ("b", 0.2, 60), ("c", 0.3, 50)],
            {"a", "b"},
            {"c": ("b",)},
            id="both-directions-flipped",
        ),
        pytest.param(ACC_VS_WEIGHTS, [("only", 0.5, 100)], {"only"}, {}, id="single-variant"),
    ],
)
def test_pareto_front(pair, points, expected_front, expected_dominated):
    result = pareto_front(on_pair(pair, *points), pair)

    assert set(result.on_front) == expected_front
    assert result.dominated == expected_dominated
    assert result.excluded == ()


@pytest.mark.parametrize(
    ("variants", "expected_reason"),
    [
        pytest.param([variant("x", succeeded=False, acc=0.5, weights=1)], "failed", id="failed"),
        pytest.param([variant("x", weights=1)], f"missing metric {ACC}", id="missing-quality"),
        pytest.param([variant("x", acc=0.5)], f"missing metric {WEIGHTS}", id="missing-cost"),
        pytest.param([variant("x")], f"missing metric {ACC}, {WEIGHTS}", id="missing-both"),
        pytest.param([variant("x", acc=math.nan, weights=1)], f"missing metric {ACC}", id="nan-is-missing"),
        pytest.param([variant("x", acc=0.5, weights=math.inf)], f"missing metric {WEIGHTS}", id="inf-is-missing"),
    ],
)
def test_variants_that_cannot_be_placed_are_excluded_with_a_reason(variants, expected_reason):
    placed = variant("placed", acc=0.1, weights=1e9)
    result = pareto_front([placed, *variants], ACC_VS_WEIGHTS)

    assert [(e.name, e.reason) for e in result.excluded] == [("x", expected_reason)]
    assert result.on_front == ("placed",)


def test_failed_variant_with_good_numbers_does_not_dominate():
    failed = variant("failed", succeeded=False, acc=0.9, weights=1)
    ok = variant("ok", acc=0.5, weights=100)

    result = pareto_front([failed, ok], ACC_VS_WEIGHTS)

    assert result.on_front == ("ok",)
    assert result.point("failed") is None


def test_points_are_ordered_cheapest_first_then_best_quality_then_name():
    pair = ACC_VS_DECODE  # higher decode speed is the better cost
    variants = on_pair(pair, ("slow", 0.9, 10), ("fast-b", 0.5, 50), ("fast-a", 0.5, 50), ("fast-good", 0.6, 50))

    names = [point.name for point in pareto_front(variants, pair).points]

    assert names == ["fast-good", "fast-a", "fast-b", "slow"]


def test_on_frontier_overall_means_on_the_front_of_at_least_one_pair():
    variants = [
        variant("bf16", baseline=True, acc=0.50, kld=0.0, weights=270),
        variant("fp8", acc=0.49, kld=0.03, weights=170),
        variant("lossy", acc=0.40, kld=0.30, weights=170),  # dominated by fp8 everywhere
        variant("tiny", acc=0.45, kld=0.50, weights=90),
    ]
    results = [pareto_front(variants, ACC_VS_WEIGHTS), pareto_front(variants, KLD_VS_WEIGHTS)]

    assert on_frontier_names(results) == {"bf16", "fp8", "tiny"}


def test_duplicate_names_and_several_baselines_are_errors():
    with pytest.raises(ValueError, match="unique"):
        pareto_front([variant("a", acc=1, weights=1), variant("a", acc=1, weights=1)], ACC_VS_WEIGHTS)
    with pytest.raises(ValueError, match="several variants are marked as baseline"):
        pareto_front(
            [variant("a", baseline=True, acc=1, weights=1), variant("b", baseline=True, acc=1, weights=1)],
            ACC_VS_WEIGHTS,
        )


# --------------------------------------------------------------------------------------
# Within noise
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "baseline_value", "value_stderr", "baseline_stderr", "within_noise", "is_loss"),
    [
        pytest.param(0.49, 0.50, 0.05, 0.05, True, False, id="small-drop-within-noise"),
        pytest.param(0.40, 0.50, 0.05, 0.05, False, True, id="drop-beyond-combined-stderr"),
        pytest.param(0.25, 0.50, None, 0.25, False, True, id="drop-equal-to-combined-stderr-is-a-loss"),
        pytest.param(0.49, 0.50, None, None, False, True, id="no-stderr-no-noise-judgement"),
        pytest.param(0.49, 0.50, None, 0.02, True, False, id="only-baseline-stderr"),
        pytest.param(0.60, 0.50, 0.01, 0.01, False, False, id="gain-is-never-a-loss"),
        pytest.param(0.50, 0.50, 0.05, 0.05, False, False, id="no-difference"),
    ],
)
def test_within_noise(value, baseline_value, value_stderr, baseline_stderr, within_noise, is_loss):
    def summary(name: str, acc: float, stderr: float | None, is_baseline: bool) -> VariantSummary:
        metrics = {ACC: acc} | ({ACC + "_stderr": stderr} if stderr is not None else {})
        return VariantSummary(name, name, True, metrics, is_baseline=is_baseline)

    delta = quality_delta(
        summary("v", value, value_stderr, False), summary("base", baseline_value, baseline_stderr, True), ACC
    )

    assert delta is not None
    assert delta.within_noise is within_noise
    assert delta.is_loss is is_loss


def test_within_noise_for_lower_is_better_metric():
    worse = QualityDelta("v", "eval/wiki/word_perplexity", False, 12.0, 11.0, combined_stderr=0.5)
    noisy = QualityDelta("v", "eval/wiki/word_perplexity", False, 11.2, 11.0, combined_stderr=0.5)

    assert worse.is_loss and not worse.within_noise
    assert noisy.within_noise and not noisy.is_loss


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [(3.0, 4.0, 5.0), (None, 2.0, 2.0), (2.0, None, 2.0), (None, None, None), (0.0, 0.0, 0.0)],
)
def test_combined_stderr(first, second, expected):
    assert combined_stderr(first, second) == expected


def test_frontier_result_reports_deltas_against_the_baseline():
    variants = [
        variant("bf16", baseline=True, acc=0.50, acc_stderr=0.05, weights=270),
        variant("fp8", acc=0.49, acc_stderr=0.05, weights=170),
        variant("int4", acc=0.30, acc_stderr=0.05, weights=90),
    ]
    result = pareto_front(variants, ACC_VS_WEIGHTS)

    assert result.baseline == "bf16"
    assert result.delta("fp8").within_noise
    assert result.delta("int4").is_loss
    assert result.delta("bf16") is None
    assert "within noise" in result.delta("fp8").describe()


# --------------------------------------------------------------------------------------
# Default axes and settings
# --------------------------------------------------------------------------------------


def test_default_axis_pairs_cover_each_task_metric_and_kld_against_size_and_speed():
    variants = [
        VariantSummary("bf16", "bf16", True, {
            ACC: 0.5, ACC + "_stderr": 0.05, "eval/cloze/acc_norm": 0.6, "eval/custom/score": 3.0,
            KLD: 0.0, WEIGHTS: 270, DECODE: 40,
        }, is_baseline=True),
    ]

    names = [pair.name for pair in default_axis_pairs(variants)]

    assert names == [
        f"eval/cloze/acc_norm vs {WEIGHTS}", f"{ACC} vs {WEIGHTS}", f"{KLD} vs {WEIGHTS}",
        f"eval/cloze/acc_norm vs {DECODE}", f"{ACC} vs {DECODE}", f"{KLD} vs {DECODE}",
    ]


def test_default_axis_pairs_skip_speed_when_nobody_measured_it():
    variants = [variant("a", acc=0.5, weights=1), variant("b", succeeded=False, acc=0.5, decode=10)]

    assert [pair.name for pair in default_axis_pairs(variants)] == [f"{ACC} vs {WEIGHTS}"]


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        pytest.param({"axes": [{"quality": ACC, "cost": WEIGHTS, "colour": "red"}]}, "extra", id="extra-axis-field"),
        pytest.param({"unknown_key": 1}, "extra", id="extra-top-level-field"),
        pytest.param({"axes": [{"quality": "eval/custom/score", "cost": WEIGHTS}]}, "eval/custom/score", id="unknown-quality-direction"),
        pytest.param({"objective": "cost/dollars"}, "cost/dollars", id="unknown-objective-direction"),
        pytest.param({"default_policy": {"max_drop": {ACC: -1}}}, ">= 0", id="negative-drop"),
        pytest.param({"default_policy": {"min_top1_agreement": 90}}, "less than or equal to 1", id="top1-is-a-fraction"),
    ],
)
def test_frontier_settings_reject_bad_input(settings, error):
    with pytest.raises(ValidationError, match=error):
        FrontierSettings.model_validate(settings)


def test_frontier_settings_explicit_axes_and_directions():
    settings = FrontierSettings.model_validate({
        "axes": [{"quality": "eval/custom/score", "quality_higher_is_better": True, "cost": DECODE}],
        "objective": "cost/dollars_per_mtok",
        "objective_higher_is_better": False,
    })
    variants = [variant("a", **{"eval/custom/score": 1.0, "decode": 10.0})]

    (pair,) = settings.axis_pairs(variants)
    assert pair == AxisPair(Axis("eval/custom/score", True), Axis(DECODE, True))
    assert settings.objective_axis() == Axis("cost/dollars_per_mtok", False)
    assert [r.pair for r in compute_frontiers(variants, settings)] == [pair]


def test_frontier_settings_defaults():
    settings = FrontierSettings()

    assert settings.axes is None
    assert settings.objective_axis() == Axis(WEIGHTS, False)
    assert settings.default_policy.max_drop_any_task == 1.0


def test_axis_direction_must_be_known_or_given():
    assert Axis.of(KLD) == Axis(KLD, False)
    assert Axis.of("eval/custom/score", True) == Axis("eval/custom/score", True)
    with pytest.raises(UnknownDirectionError, match="eval/custom/score"):
        Axis.of("eval/custom/score")


def test_frontiers_to_dict_is_json():
    variants = [variant("bf16", baseline=True, acc=0.5, kld=0.0, weights=270), variant("x", succeeded=False)]

    record = json.loads(json.dumps(frontiers_to_dict(compute_frontiers(variants))))

    assert record["on_frontier"] == ["bf16"]
    assert record["frontiers"][0]["excluded"] == [{"name": "x", "reason": "failed"}]


# --------------------------------------------------------------------------------------
# Metric catalogue
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "text"),
    [
        (ACC, 0.245, "24.5%"),
        (WEIGHTS, 270_900_000, "270.9 MB"),
        ("cost/peak_memory_bytes", 1.5e9, "1.5 GB"),
        (DECODE, 1234.4, "1,234 tok/s"),
        (DECODE, 41.25, "41.2 tok/s"),
        ("cost/ttft_ms_p50", 12.34, "12.3 ms"),
        (KLD, 0.03, "0.03"),
        ("quality/ppl", 11.531, "11.53"),
        (ACC, None, "n/a"),
    ],
)
def test_format_metric_uses_human_units(key, value, text):
    assert format_metric(key, value) == text


@pytest.mark.parametrize(
    ("key", "higher_is_better"),
    [
        (ACC, True), ("eval/hellaswag/acc_norm", True), ("eval/wikitext/word_perplexity", False),
        (KLD, False), ("quality/top1_agreement", True), ("quality/recovery/mmlu_dev/acc", True),
        (WEIGHTS, False), (DECODE, True), ("cost/ttft_ms_p99", False),
        ("eval/custom/score", None), (ACC + "_stderr", None), ("something/else", None),
    ],
)
def test_known_directions(key, higher_is_better):
    assert metric_info(key).higher_is_better is higher_is_better
