"""Paired statistics and non-inferiority, against hand computations and scipy."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from scipy import optimize, special, stats

from quantlab.paired import (
    Aggregation,
    DocumentScores,
    NotPaired,
    Outcome,
    _tango_bound,
    agresti_min_se,
    cluster_robust_se,
    combine,
    compare,
    documents_from_json,
    documents_to_json,
    flip_interval,
    float_slack,
    holm_alphas,
    mcnemar_exact_p,
    non_inferiority,
    over_p,
    paired_binary_non_inferiority,
    paired_binary_over_p,
    tango_restricted_rate,
    tango_statistic,
)


def binary(n: int, correct: int, to_wrong: int, to_right: int) -> tuple[DocumentScores, DocumentScores]:
    """n documents, `correct` right for the baseline; the variant flips the first `to_wrong` of
    those and the first `to_right` of the wrong ones."""
    base = {doc: 1.0 if doc < correct else 0.0 for doc in range(n)}
    variant = dict(base)
    for doc in range(to_wrong):
        variant[doc] = 0.0
    for doc in range(correct, correct + to_right):
        variant[doc] = 1.0
    return DocumentScores(Aggregation.MEAN, base), DocumentScores(Aggregation.MEAN, variant)


def test_the_issue_example_is_a_significant_paired_loss() -> None:
    """n=1000, 0.60 -> 0.58 through 25 right->wrong and 5 wrong->right."""
    result = compare("mmlu", *binary(1000, 600, 25, 5))
    assert (result.baseline, result.variant, result.diff) == pytest.approx((0.60, 0.58, -0.02))
    # Hand: var(d) = (30 - 1000 * 0.02^2) / 999; se = sqrt(var / 1000)
    assert result.se == pytest.approx(math.sqrt((30 - 1000 * 0.0004) / 999 / 1000), rel=1e-12)
    assert result.se * 100 == pytest.approx(0.544, abs=5e-4)  # points, where unpaired noise says 2.2
    # Hand: 2 * sum_{k<=5} C(30, k) / 2^30
    assert result.p_value == pytest.approx(2 * sum(math.comb(30, k) for k in range(6)) / 2**30, rel=1e-9)
    assert result.p_value == pytest.approx(3.2e-4, rel=0.02)
    assert (result.correct_to_wrong, result.wrong_to_correct, result.test) == (25, 5, "mcnemar_exact")
    # The interval is the verdict's: the drop's bounds from the flips, Tango's upper one (where its statistic is
    # -1.96) and as the lower one the smaller of Tango's and the Wald bound 1.96 Agresti-Min se under the drop
    assert tango_statistic(1000, 25, 5, -result.ci95_low) == pytest.approx(-1.959964, rel=1e-6)
    wald = 0.02 - 1.959964 * agresti_min_se(1000, 25, 5)
    tango_lower = optimize.brentq(lambda drop: tango_statistic(1000, 25, 5, drop) - 1.959964, -0.5, 0.02)
    assert -result.ci95_high == pytest.approx(min(wald, tango_lower), rel=1e-6)
    assert result.ci95_low < result.diff < result.ci95_high < 0


@pytest.mark.parametrize("n", [40, 200])
def test_zero_flips_show_the_width_their_documents_leave(n):
    """Identical answers are not [0, 0]: with no flip Tango's bounds are +-z^2 / (n + z^2) (8.76 pts at 40 documents,
    1.88 at 200; Wald's on Agresti and Min's se, z / (n + 2), is inside them), and they are the verdict's."""
    result = compare("task", *binary(n, n // 2, 0, 0))
    z2 = stats.norm.ppf(0.975) ** 2
    assert result.diff == 0 and (result.ci95_low, result.ci95_high) == pytest.approx((-z2 / (n + z2), z2 / (n + z2)))
    verdict = paired_binary_non_inferiority(n, 0, 0, 0.01)
    assert (-result.ci95_high, -result.ci95_low) == pytest.approx((verdict.lower, verdict.upper), rel=1e-12)


FLIP_TABLES = [(40, 0, 0), (40, 3, 0), (40, 0, 3), (40, 2, 5), (100, 3, 1), (200, 0, 0), (300, 0, 4), (1000, 25, 5)]


@pytest.mark.parametrize("higher_is_better", [True, False])
@pytest.mark.parametrize(("n", "correct_to_wrong", "wrong_to_correct"), [*FLIP_TABLES, (1319, 40, 38), (5, 5, 0)])
def test_the_interval_shown_is_the_one_the_verdict_judges_by(n, correct_to_wrong, wrong_to_correct, higher_is_better):
    """Over tables of flips, either direction: the shown interval, as a drop, is the verdict's two bounds at its default
    level, so a limit is shown within exactly where the shown interval's worse end is within it, and shown over exactly
    where its better end is over it."""
    right = max(n // 2, correct_to_wrong)
    shown = compare("task", *binary(n, right, correct_to_wrong, wrong_to_correct)).oriented(higher_is_better)
    assert shown.ci95_low <= shown.diff <= shown.ci95_high
    drop_low, drop_high = (-shown.ci95_high, -shown.ci95_low) if higher_is_better else (shown.ci95_low, shown.ci95_high)
    direction = {"higher_is_better": higher_is_better}
    for limit in (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2):
        verdict = paired_binary_non_inferiority(n, correct_to_wrong, wrong_to_correct, limit, **direction)
        assert (drop_low, drop_high) == pytest.approx((verdict.lower, verdict.upper), rel=1e-12, abs=1e-15)
        assert (verdict.outcome is Outcome.WITHIN) == (drop_high <= limit + float_slack(limit))
        assert (verdict.outcome is Outcome.OVER) == (drop_low > limit + float_slack(limit))
    assert (shown.ci95_low, shown.ci95_high) == pytest.approx(
        flip_interval(n, correct_to_wrong, wrong_to_correct, **direction), rel=1e-12
    )


@pytest.mark.parametrize(
    ("to_wrong", "to_right", "expected"),
    [
        (0, 0, 1.0),
        (1, 0, 1.0),
        (5, 0, 2 / 2**5),
        (3, 3, 1.0),
        (10, 2, stats.binomtest(10, 12).pvalue),
        (2, 10, stats.binomtest(2, 12).pvalue),
        (400, 350, stats.binomtest(400, 750).pvalue),
        (200, 20, stats.binomtest(200, 220).pvalue),
        (10_000, 9_000, stats.binomtest(10_000, 19_000).pvalue),
    ],
)
def test_mcnemar_exact(to_wrong: int, to_right: int, expected: float) -> None:
    assert mcnemar_exact_p(to_wrong, to_right) == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize(("n", "shift", "spread"), [(2, 0.1, 0.3), (50, -0.02, 0.05), (5_000, 0.001, 0.2)])
def test_paired_t_matches_scipy_stats(n: int, shift: float, spread: float) -> None:
    rng = np.random.default_rng(n)
    base = rng.random(n)
    variant = base + shift + rng.normal(0, spread, n)
    result = compare(
        "truthfulqa_mc2",
        DocumentScores(Aggregation.MEAN, dict(enumerate(base))),
        DocumentScores(Aggregation.MEAN, dict(enumerate(variant))),
    )
    assert result.p_value == pytest.approx(stats.ttest_rel(variant, base).pvalue, rel=1e-9)
    assert result.se == pytest.approx(stats.sem(variant - base), rel=1e-12)


def test_the_frontier_statistics_do_not_import_scipy_stats() -> None:
    """Every sweep publishes a frontier, an unchanged re-run too: scipy.stats' 0.7 s import is not on that path."""
    code = (
        "import sys; from quantlab.paired import Aggregation, DocumentScores, compare;"
        "b = DocumentScores(Aggregation.MEAN, {0: 1.0, 1: 0.0, 2: 1.0});"
        "v = DocumentScores(Aggregation.MEAN, {0: 0.0, 1: 0.0, 2: 1.0});"
        "c = DocumentScores(Aggregation.MEAN, {0: 0.5, 1: 0.1, 2: 0.9});"
        "compare('t', b, v); compare('t', c, b);"
        "print('scipy.stats' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_continuous_scores_use_a_paired_t_test() -> None:
    rng = np.random.default_rng(0)
    base = rng.random(50)
    variant = np.clip(base - 0.02 + rng.normal(0, 0.05, 50), 0, 1)
    result = compare(
        "truthfulqa_mc2",
        DocumentScores(Aggregation.MEAN, dict(enumerate(base))),
        DocumentScores(Aggregation.MEAN, dict(enumerate(variant))),
    )
    assert result.test == "paired_t"
    assert result.p_value == pytest.approx(stats.ttest_rel(variant, base).pvalue, rel=1e-12)
    assert result.se == pytest.approx(stats.sem(variant - base), rel=1e-12)
    assert result.correct_to_wrong is None and "correct_to_wrong" not in result.statistics()


def test_rolling_perplexity_is_paired_per_document() -> None:
    """Two documents, lm-eval's weighted perplexity exp(-sum ll / sum words)."""
    words = {0: 5.0, 1: 10.0}
    base = DocumentScores(Aggregation.WEIGHTED_PERPLEXITY, {0: -10.0, 1: -20.0}, words)
    variant = DocumentScores(Aggregation.WEIGHTED_PERPLEXITY, {0: -11.0, 1: -21.0}, words)
    assert base.aggregate() == pytest.approx(math.exp(30 / 15))
    result = compare("wikitext", base, variant)
    assert result.diff == pytest.approx(math.exp(32 / 15) - math.exp(2))
    # Hand: D = 2/15; residuals x - D w = (1/3, -1/3); se_D = sqrt(2/1 * 2/9) / 15
    se_shift = math.sqrt(2 * (2 / 9)) / 15
    assert result.se == pytest.approx(math.exp(32 / 15) * se_shift, rel=1e-12)
    # Two documents: Student's t with 1 degree of freedom (t_0.975,1 = 12.706), not the normal 1.96 (issue 28).
    assert result.df == 1
    assert result.ci95_low == pytest.approx(math.exp(2) * math.expm1(2 / 15 - 12.706205 * se_shift), rel=1e-6)
    assert result.p_value == pytest.approx(2 * stats.t.sf((2 / 15) / se_shift, 1), rel=1e-9)


def test_bits_per_byte_difference_is_linear() -> None:
    weights = {0: 100.0, 1: 300.0, 2: 200.0}
    base = DocumentScores(Aggregation.BITS_PER_BYTE, {0: -50.0, 1: -160.0, 2: -90.0}, weights)
    variant = DocumentScores(Aggregation.BITS_PER_BYTE, {0: -55.0, 1: -170.0, 2: -91.0}, weights)
    assert base.aggregate() == pytest.approx(300 / (600 * math.log(2)))
    result = compare("wikitext", base, variant)
    assert result.diff == pytest.approx(16 / (600 * math.log(2)))
    assert result.ci95_low < result.diff < result.ci95_high


def test_different_documents_are_not_paired() -> None:
    base, variant = binary(10, 5, 1, 1)
    with pytest.raises(NotPaired, match="1 only in baseline"):
        compare("arc", base, DocumentScores(Aggregation.MEAN, {k: v for k, v in variant.values.items() if k != 3}))


def test_a_group_adds_its_leaves_flips_and_pools_by_size() -> None:
    first, second = compare("a", *binary(100, 60, 6, 1)), compare("b", *binary(300, 150, 9, 2))
    pooled_base = DocumentScores(
        Aggregation.MEAN,
        {**binary(100, 60, 6, 1)[0].values, **{k + 100: v for k, v in binary(300, 150, 9, 2)[0].values.items()}},
    )
    pooled_variant = DocumentScores(
        Aggregation.MEAN,
        {**binary(100, 60, 6, 1)[1].values, **{k + 100: v for k, v in binary(300, 150, 9, 2)[1].values.items()}},
    )
    group = combine([first, second], [100 / 400, 300 / 400])
    pooled = compare("group", pooled_base, pooled_variant)
    assert (group.correct_to_wrong, group.wrong_to_correct) == (15, 3)
    assert group.diff == pytest.approx(pooled.diff)
    # One pool, judged by its summed flips: shown with their bounds, as the pooled documents would be
    assert (group.ci95_low, group.ci95_high) == pytest.approx((pooled.ci95_low, pooled.ci95_high), rel=1e-12)
    verdict = paired_binary_non_inferiority(400, 15, 3, 0.01)
    assert (-group.ci95_high, -group.ci95_low) == pytest.approx((verdict.lower, verdict.upper), rel=1e-12)
    assert group.p_value == pytest.approx(pooled.p_value)
    assert group.test == "mcnemar_exact"
    unweighted = combine([first, second], [0.5, 0.5])
    assert unweighted.test == "combined_z"
    # Not one pool: no summed flips, and each 0/1 leaf's Agresti-Min se (issue 28; were plain ones).
    assert (unweighted.correct_to_wrong, unweighted.wrong_to_correct) == (None, None)
    assert unweighted.se == pytest.approx(
        math.sqrt(0.25 * agresti_min_se(100, 6, 1) ** 2 + 0.25 * agresti_min_se(300, 9, 2) ** 2)
    )


@pytest.mark.parametrize(
    ("n", "to_wrong", "to_right", "limit", "alpha", "outcome"),
    [
        (1000, 25, 5, 0.01, 0.05, Outcome.OVER),  # drop 2 pts, one-sided 95% lower bound 2 - 1.645 * 0.544 = 1.1 pts
        (1000, 25, 5, 0.01, 0.025, Outcome.UNSURE),  # at 97.5%: 2 - 1.960 * 0.544 = 0.93 pts, below the limit
        (1000, 25, 5, 0.031, 0.025, Outcome.WITHIN),  # upper bound 2 + 1.960 * 0.544 = 3.07 pts <= 3.1
        (40, 2, 1, 0.05, 0.025, Outcome.UNSURE),  # drop 2.5 pts, upper bound 2.5 + 1.960 * 4.34 = 11.0 pts
        (4000, 200, 100, 0.05, 0.025, Outcome.WITHIN),  # the same flip rates, 100x the documents
        (40, 0, 0, 0.01, 0.025, Outcome.WITHIN),  # identical answers: no drop, no spread
        (40, 4, 0, 0.0, 0.025, Outcome.OVER),  # every flip one way beyond noise
    ],
)
def test_non_inferiority_outcomes(
    n: int, to_wrong: int, to_right: int, limit: float, alpha: float, outcome: Outcome
) -> None:
    result = compare("task", *binary(n, n // 2, to_wrong, to_right))
    verdict = non_inferiority(-result.diff, result.se, result.n, limit, alpha=alpha)
    z = stats.norm.ppf(1 - alpha)
    assert verdict.upper == pytest.approx(-result.diff + z * result.se)
    assert verdict.outcome is outcome, (verdict.lower, verdict.upper)
    assert verdict.lower <= verdict.drop <= verdict.upper
    assert (verdict.documents_needed is None) == (outcome is not Outcome.UNSURE)


def test_documents_needed_at_the_policys_power() -> None:
    result = compare("task", *binary(40, 20, 2, 1))
    spread = result.se * math.sqrt(40)  # Hand: sqrt((3 - 40 * 0.025^2) / 39)
    assert spread == pytest.approx(math.sqrt((3 - 40 * 0.025**2) / 39))
    # The non-inferiority sample size n = ((z_(1-alpha) + z_power) sd / (limit - drop))^2 (e.g. Chow, Shao & Wang,
    # Sample Size Calculations in Clinical Research, 3.2.2): z_0.975 = 1.959964, z_0.8 = 0.841621.
    verdict = non_inferiority(-result.diff, result.se, 40, 0.05)
    # By hand: (2.801585 * 0.276192 / 0.025)^2 = 30.951^2 = 957.97 -> 958.
    assert verdict.documents_needed == math.ceil(((1.959964 + 0.841621) * spread / (0.05 - 0.025)) ** 2) == 958
    # Power 0.5 and alpha 0.05 give the old figure: the size at which the 95% bound merely reaches the limit.
    half = non_inferiority(-result.diff, result.se, 40, 0.05, alpha=0.05, power=0.5)
    assert half.documents_needed == math.ceil((1.644854 * spread / (0.05 - 0.025)) ** 2) == 331
    assert non_inferiority(0.05, result.se, 40, 0.05).documents_needed is None  # on the limit: nothing settles it


def test_documents_needed_at_80_percent_power_settle_it_80_percent_of_the_time() -> None:
    """A simulation of the claim itself: at the size given, the 97.5% upper bound is within the limit in 80% of draws
    (normal per-document differences of the same mean and spread)."""
    drop, sd, limit = 0.004, 0.2, 0.01
    needed = non_inferiority(drop, sd / math.sqrt(100), 100, limit).documents_needed
    assert needed == math.ceil(((1.959964 + 0.841621) * sd / (limit - drop)) ** 2)
    rng = np.random.default_rng(7)
    means = rng.normal(drop, sd / math.sqrt(needed), 20000)
    shown = np.mean(means + stats.norm.ppf(0.975) * sd / math.sqrt(needed) <= limit)
    assert shown == pytest.approx(0.80, abs=0.01)


@pytest.mark.parametrize(
    ("drop", "se", "limit", "available", "best"),
    [
        # Towards within: drop + (z_0.975 + z_0.8) * sd / sqrt(available), sd = se * sqrt(40) = 0.1265.
        (0.0, 0.02, 0.01, 62, 0.0 + (1.959964 + 0.841621) * 0.02 * math.sqrt(40) / math.sqrt(62)),
        # Towards over (lower bound 0.025 - 1.96 * 0.01 = 0.0054 < 0.01; 140 documents needed): the largest
        # limit whose excess 62 documents can show, drop - the same reach = 0.025 - 0.0225 = 0.0025.
        (0.025, 0.01, 0.01, 62, 0.025 - (1.959964 + 0.841621) * 0.01 * math.sqrt(40) / math.sqrt(62)),
        (0.0, 0.02, 0.01, 100_000, None),  # enough documents exist: no best limit
    ],
)
def test_what_the_documents_a_task_has_can_settle(drop, se, limit, available, best) -> None:
    verdict = non_inferiority(drop, se, 40, limit, available=available)
    assert verdict.outcome is Outcome.UNSURE
    assert verdict.best_limit == (None if best is None else pytest.approx(best))


def test_too_few_documents_have_no_interval_and_no_verdict() -> None:
    one = DocumentScores(Aggregation.MEAN, {0: 0.25}), DocumentScores(Aggregation.MEAN, {0: 0.5})
    result = compare("task", *one)
    assert math.isnan(result.se) and set(result.statistics()) == {"diff", "n", "df"}
    assert non_inferiority(-result.diff, result.se, 1, 0.01).outcome is Outcome.UNSURE
    # One 0/1 document: no se, and the interval a verdict on its flips judges by, too wide to settle anything, within
    # the range a difference of proportions has
    flipped = compare("task", *binary(1, 1, 1, 0))
    assert math.isnan(flipped.se) and -1 <= flipped.ci95_low < -0.5 and 0 < flipped.ci95_high <= 1
    assert paired_binary_non_inferiority(1, 1, 0, 0.01).outcome is Outcome.UNSURE


def test_documents_survive_json() -> None:
    scores = {
        "eval/wikitext/word_perplexity": DocumentScores(
            Aggregation.WEIGHTED_PERPLEXITY, {3: -1.5, 7: -2.0}, {3: 2.0, 7: 4.0}
        )
    }
    assert documents_from_json(documents_to_json(scores)) == scores


# --------------------------------------------------------------------------------------
# Several checks: Holm's step-down for "shown over"
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p_values", "levels"),
    [
        # By hand (alpha 0.025): ascending 0.001, 0.004, 0.02 against 0.025/3, 0.025/2, 0.025/1: all rejected.
        ((0.001, 0.02, 0.004), (0.025 / 3, 0.025, 0.025 / 2)),
        # 0.013 > 0.025/2: Holm stops at rank 1, and the rest are held to that rank's level.
        ((0.013, 0.014), (0.025 / 2, 0.025 / 2)),
        ((0.01, 0.012), (0.025 / 2, 0.025)),  # 0.01 <= 0.0125, then 0.012 <= 0.025
        # Rank 2 fails (0.02 > 0.025/2) after rank 1 passed: ranks 2 and 3 both at 0.0125.
        ((0.0001, 0.02, 0.021), (0.025 / 3, 0.025 / 2, 0.025 / 2)),
        ((0.5,), (0.025,)),  # one check: no correction
        ((math.nan, 0.001), (0.025, 0.025)),  # an untested check is not counted in m
    ],
)
def test_holm_levels_by_hand(p_values, levels):
    assert holm_alphas(p_values, 0.025) == pytest.approx(list(levels))


@pytest.mark.parametrize("seed", range(5))
def test_holm_levels_reject_exactly_where_holms_adjusted_p_values_do(seed):
    """Holm's adjusted p-values, p_adj(r) = max over ranks j <= r of min(1, (m - j + 1) p(j)), reject where <= alpha."""
    p = np.random.default_rng(seed).uniform(0, 0.02, 8)
    order = np.argsort(p)
    adjusted = np.empty_like(p)
    adjusted[order] = np.maximum.accumulate(np.minimum(1, (len(p) - np.arange(len(p))) * p[order]))
    levels = holm_alphas(list(p), 0.025)
    assert [bool(pi <= level) for pi, level in zip(p, levels)] == list(adjusted <= 0.025)


@pytest.mark.parametrize(
    ("drop", "se", "limit", "df", "expected"),
    [
        (0.02, 0.005, 0.01, math.inf, stats.norm.sf(2.0)),  # (0.02 - 0.01) / 0.005 = 2 se over the limit
        (0.02, 0.005, 0.01, 11, stats.t.sf(2.0, 11)),
        (0.0, 0.0, 0.01, math.inf, 1.0),  # no spread, within: nothing shows it over
        (0.02, 0.0, 0.01, math.inf, 0.0),
    ],
)
def test_the_p_value_of_shown_over(drop, se, limit, df, expected):
    assert over_p(drop, se, limit, df) == pytest.approx(expected)


def test_a_level_lowered_by_holm_widens_only_the_lower_bound():
    verdict = non_inferiority(0.02, 0.005, 1000, 0.01, alpha=0.025, over_alpha=0.025 / 57)
    assert verdict.upper == pytest.approx(0.02 + stats.norm.ppf(0.975) * 0.005)
    assert verdict.lower == pytest.approx(0.02 - stats.norm.ppf(1 - 0.025 / 57) * 0.005)  # 3.38 se: 0.0031
    assert verdict.outcome is Outcome.UNSURE  # over at 2.5% alone (0.0102 > 0.01), not among 57 checks


# --------------------------------------------------------------------------------------
# Groups averaged without size weights (issue 28: a 50- and a 2,000-document leaf)
# --------------------------------------------------------------------------------------


def test_an_unweighted_group_of_50_and_2000_documents_is_not_shown_within_on_pooled_flips():
    small, large = compare("small", *binary(50, 25, 0, 0)), compare("large", *binary(2000, 1000, 20, 20))
    group = combine([small, large], [0.5, 0.5])  # lm-eval's plain mean of the two leaves

    # By hand: Agresti-Min se of each leaf, sqrt((b + .5) + (c + .5) - (c - b)^2 / (n + 2)) / (n + 2):
    # small sqrt(1) / 52 = 0.01923 (its plain se is 0: no flip), large sqrt(41) / 2002 = 0.003198;
    # group sqrt(0.25 * 0.01923^2 + 0.25 * 0.003198^2) = 0.009748.
    assert group.se == pytest.approx(math.sqrt(0.25 * (1 / 52) ** 2 + 0.25 * (math.sqrt(41) / 2002) ** 2))
    assert group.se == pytest.approx(0.009748, abs=1e-6)
    assert group.correct_to_wrong is None  # no pooled flips for a verdict to misuse
    verdict = non_inferiority(-group.diff, group.se, group.n, 0.01)
    assert verdict.upper == pytest.approx(1.959964 * 0.009748, abs=1e-5)  # 1.91 pts > 1 pt
    assert verdict.outcome is Outcome.UNSURE
    # What the verdict used to do: pool the 40 flips over 2,050 documents, se sqrt(41) / 2052 = 0.00312, 3.1x too
    # small (and the plain combined se, 0.5 * 0.00316, 6x too small): "shown within".
    pooled = non_inferiority(-group.diff, agresti_min_se(2050, 20, 20), 2050, 0.01)
    assert pooled.outcome is Outcome.WITHIN


def test_continuous_leaves_combine_with_welch_satterthwaite_degrees_of_freedom():
    rng = np.random.default_rng(3)
    parts = []
    for size in (12, 30):
        base = rng.random(size)
        parts.append(
            compare(
                "mc2",
                DocumentScores(Aggregation.MEAN, dict(enumerate(base))),
                DocumentScores(Aggregation.MEAN, dict(enumerate(np.clip(base + rng.normal(0, 0.1, size), 0, 1)))),
            )
        )
    group = combine(parts, [0.5, 0.5])
    v = [(0.5 * p.se) ** 2 for p in parts]
    # Welch-Satterthwaite: (v1 + v2)^2 / (v1^2 / 11 + v2^2 / 29).
    assert group.df == pytest.approx((v[0] + v[1]) ** 2 / (v[0] ** 2 / 11 + v[1] ** 2 / 29))
    assert group.test == "combined_t"
    half = stats.t.ppf(0.975, group.df) * group.se
    assert (group.ci95_low, group.ci95_high) == pytest.approx((group.diff - half, group.diff + half))


# --------------------------------------------------------------------------------------
# Correlated tokens: cluster-robust standard errors over windows
# --------------------------------------------------------------------------------------


def ar1_windows(rng: np.random.Generator, windows: int, length: int, phi: float) -> np.ndarray:
    """`windows` independent stationary AR(1) series x_t = phi x_(t-1) + e_t, e ~ N(0, 1), one row each."""
    x = np.empty((windows, length))
    x[:, 0] = rng.normal(0, 1 / math.sqrt(1 - phi**2), windows)
    for t in range(1, length):
        x[:, t] = phi * x[:, t - 1] + rng.normal(0, 1, windows)
    return x


def ar1_variance_of_the_mean(windows: int, length: int, phi: float) -> float:
    """Closed form: gamma_k = phi^k / (1 - phi^2), Var(sum of one window) = sum_(s,t) gamma_|s-t|
    = gamma_0 (L + 2 sum_(k=1..L-1) (L - k) phi^k); the windows are independent, so the mean of all
    N = G L tokens has variance G Var(window sum) / N^2."""
    k = np.arange(1, length)
    window_sum = (length + 2 * np.sum((length - k) * phi**k)) / (1 - phi**2)
    return windows * window_sum / (windows * length) ** 2


@pytest.mark.parametrize(("phi", "design_effect"), [(0.0, 1.0), (0.5, 2.94), (0.8, 8.38)])
def test_the_cluster_robust_se_of_ar1_tokens_matches_the_closed_form(phi, design_effect):
    windows, length, replications = 40, 64, 400
    rng = np.random.default_rng(11)
    true_variance = ar1_variance_of_the_mean(windows, length, phi)
    # The design effect in closed form: Var(mean) over the independent-token variance gamma_0 / N.
    assert true_variance / ((1 / (1 - phi**2)) / (windows * length)) == pytest.approx(design_effect, abs=0.01)
    clusters = np.repeat(np.arange(windows), length)
    robust, naive, covered = [], [], 0
    for _ in range(replications):
        x = ar1_windows(rng, windows, length, phi).reshape(-1)
        se = cluster_robust_se(x - x.mean(), x.size, clusters)
        robust.append(se**2)
        naive.append(stats.sem(x) ** 2)
        covered += abs(x.mean()) <= stats.t.ppf(0.975, windows - 1) * se  # the true mean is 0
    # CR1 is unbiased for the variance of the mean here: its average over 400 draws within 5% (its own
    # Monte Carlo error: sqrt(2 / 39) / sqrt(400) = 1.1%); tokens taken as independent miss by the design effect.
    assert np.mean(robust) / true_variance == pytest.approx(1.0, abs=0.05)
    assert np.mean(naive) / true_variance == pytest.approx(1 / design_effect, rel=0.05)
    assert covered / replications == pytest.approx(0.95, abs=0.03)  # t with G - 1 df covers as it says


def test_compare_with_clusters_uses_windows_as_the_sampled_units():
    rng = np.random.default_rng(5)
    kld = np.abs(ar1_windows(rng, 8, 50, 0.8).reshape(-1))
    clusters = dict(enumerate(np.repeat(np.arange(8), 50).tolist()))
    zeros = DocumentScores(Aggregation.MEAN, dict.fromkeys(range(400), 0.0), clusters=clusters)
    result = compare("kld", zeros, DocumentScores(Aggregation.MEAN, dict(enumerate(kld)), clusters=clusters))

    # By hand: per-window sums of (x - mean), G / (G - 1) * sum of their squares, square root, / N.
    sums = (kld - kld.mean()).reshape(8, 50).sum(axis=1)
    assert result.se == pytest.approx(math.sqrt(8 / 7 * np.sum(sums**2)) / 400)
    assert result.df == 7 and result.test == "cluster_t"
    assert result.design_effect == pytest.approx((result.se / stats.sem(kld)) ** 2)
    assert result.design_effect > 2  # correlated windows: tokens alone would understate the se
    assert result.p_value == pytest.approx(2 * stats.t.sf(kld.mean() / result.se, 7))
    assert result.correct_to_wrong is None  # no McNemar on correlated tokens


def test_clustered_perplexity_is_a_ratio_estimator_over_windows():
    rng = np.random.default_rng(6)
    nll_b = rng.uniform(1, 3, 60)
    nll_v = nll_b + 0.05 + 0.1 * np.repeat(rng.normal(size=6), 10)  # a shift shared within each window
    clusters = dict(enumerate(np.repeat(np.arange(6), 10).tolist()))
    ones = dict.fromkeys(range(60), 1.0)
    result = compare(
        "ppl",
        DocumentScores(Aggregation.WEIGHTED_PERPLEXITY, dict(enumerate(-nll_b)), ones, clusters),
        DocumentScores(Aggregation.WEIGHTED_PERPLEXITY, dict(enumerate(-nll_v)), ones, clusters),
    )
    x = nll_v - nll_b
    sums = (x - x.mean()).reshape(6, 10).sum(axis=1)
    se_shift = math.sqrt(6 / 5 * np.sum(sums**2)) / 60
    assert result.se == pytest.approx(math.exp(nll_v.mean()) * se_shift)
    assert result.df == 5


def test_documents_in_different_clusters_are_not_paired():
    a = DocumentScores(Aggregation.MEAN, {0: 1.0, 1: 0.0}, clusters={0: 0, 1: 0})
    with pytest.raises(NotPaired, match="clusters"):
        compare("x", a, DocumentScores(Aggregation.MEAN, {0: 1.0, 1: 0.0}, clusters={0: 0, 1: 1}))


# --------------------------------------------------------------------------------------
# 0/1 scores of one pool of documents: Tango's score bounds (issue 45)
# --------------------------------------------------------------------------------------


def restricted_log_likelihood(q: float, n: int, worse: int, better: int, delta: float) -> float:
    """The trinomial (worse, better, the rest) with p_better = q and p_worse = q + delta."""
    counts = np.array([worse, better, n - worse - better])
    return float(np.sum(special.xlogy(counts, np.array([q + delta, q, 1 - 2 * q - delta]))))


@pytest.mark.parametrize(
    ("n", "worse", "better", "delta"),
    [
        (10, 3, 1, 0.0),
        (10, 3, 1, 0.05),
        (10, 3, 1, -0.2),
        (10, 1, 4, 0.3),
        (10, 0, 0, 0.01),
        (10, 0, 0, -0.5),
        (40, 2, 2, 0.01),
        (300, 12, 7, 0.01),
        (300, 12, 7, -0.05),
        (1000, 25, 5, 0.01),
        (5, 5, 0, 0.9),
        (5, 0, 5, -0.9),
        (20, 10, 10, 0.5),
    ],
)
def test_tangos_restricted_rate_maximises_the_restricted_likelihood(n, worse, better, delta):
    closed = tango_restricted_rate(n, worse, better, delta)
    # The likelihood is concave in q on its domain, p_better >= max(0, -delta) and p_rest >= 0: a bounded search finds it.
    low, high = max(0.0, -delta), (1 - delta) / 2
    searched = optimize.minimize_scalar(
        lambda q: -restricted_log_likelihood(q, n, worse, better, delta),
        bounds=(low, high),
        method="bounded",
        options={"xatol": 1e-12},
    ).x
    assert low - 1e-12 <= closed <= high + 1e-12
    assert closed == pytest.approx(searched, abs=1e-6)
    assert (
        restricted_log_likelihood(closed, n, worse, better, delta)
        >= restricted_log_likelihood(searched, n, worse, better, delta) - 1e-9
    )
    assert tango_restricted_rate(1, worse / n, better / n, delta) == pytest.approx(closed)  # rates: the same root


@pytest.mark.parametrize("n", [5, 12])
@pytest.mark.parametrize(("alpha", "over_alpha"), [(0.025, 0.025), (0.05, 0.025 / 3)])
def test_tangos_bounds_are_the_ends_of_the_drops_the_score_test_does_not_reject(n, alpha, over_alpha):
    """Every table of n documents: on a grid of null drops, the one-sided score test at 1 - alpha rejects exactly those
    above the upper bound, and at 1 - over_alpha exactly those below Tango's lower bound (the statistic is monotone
    there). The reported lower bound, the one "shown over" needs over the limit, is the lower of Tango's and the Wald
    bound on Agresti and Min's se: the upper bound is Tango's alone."""
    grid = np.linspace(-1, 1, 801)
    z_within, z_over = stats.norm.ppf(1 - alpha), stats.norm.ppf(1 - over_alpha)
    for worse in range(n + 1):
        for better in range(n - worse + 1):
            verdict = paired_binary_non_inferiority(n, worse, better, 0.01, alpha=alpha, over_alpha=over_alpha)
            tango_lower = _tango_bound(n, worse, better, z_over)
            wald_lower = verdict.drop - z_over * agresti_min_se(n, worse, better)
            statistic = np.array([tango_statistic(n, worse, better, delta) for delta in grid])
            assert np.all(np.diff(statistic) <= 1e-12)
            assert np.all((statistic < -z_within) == (grid > verdict.upper + 1e-9)), (worse, better)
            assert np.all((statistic > z_over) == (grid < tango_lower - 1e-9)), (worse, better)
            # no drop is below -1 (every document gained), where Wald's bound may reach
            assert verdict.lower == pytest.approx(min(tango_lower, max(wald_lower, -1)), abs=1e-12), (worse, better)
            # scipy's normal quantile and the standard library's, which quantlab uses, differ in the last bits
            assert verdict.lower <= tango_lower + 1e-12 and tango_lower <= verdict.drop <= verdict.upper
            assert verdict.drop == (worse - better) / n
            for bound, z in ((verdict.upper, -z_within), (tango_lower, z_over)):
                if abs(bound) < 1:  # an inner bound is where the statistic crosses the quantile
                    assert tango_statistic(n, worse, better, bound) == pytest.approx(z, abs=1e-6)


@pytest.mark.parametrize(
    ("n", "limit", "outcome"),
    [
        (5, 0.01, Outcome.UNSURE),
        (40, 0.01, Outcome.UNSURE),
        (40, 0.10, Outcome.WITHIN),  # z^2 / (40 + z^2) = 8.76 pts
        (380, 0.01, Outcome.UNSURE),  # 3.8415 / 383.84 = 1.0008 pts
        (381, 0.01, Outcome.WITHIN),  # 3.8415 / 384.84 = 0.9982 pts
        (10_000, 0.01, Outcome.WITHIN),
    ],
)
def test_zero_flips_show_a_limit_only_with_enough_documents(n, limit, outcome):
    """No flip: the plain paired se is 0, yet a few identical answers must not show a tight limit. Tango's upper
    bound without flips solves n d / (1 - d) = z^2: d = z^2 / (n + z^2), above 0 for any finite n."""
    z = stats.norm.ppf(0.975)
    verdict = paired_binary_non_inferiority(n, 0, 0, limit, available=n)
    assert verdict.drop == 0 and verdict.upper == pytest.approx(z**2 / (n + z**2))
    assert verdict.lower == pytest.approx(-verdict.upper)
    assert verdict.outcome is outcome
    if outcome is Outcome.UNSURE:
        # Without spread the sample size is the bound's own: z^2 (1 - limit) / limit = 380.3 at 1 pt, 381 settles it.
        assert verdict.documents_needed == max(n + 1, math.ceil(z**2 * (1 - limit) / limit))
        assert verdict.best_limit == pytest.approx(verdict.upper)  # n documents settle what their bound shows


@pytest.mark.parametrize(
    ("n", "correct_to_wrong", "wrong_to_correct", "limit", "over_alpha", "outcome"),
    [
        # Tango's p 0.0253, Wald's 0.0350: not shown over at 2.5%, shown over at 5%.
        (1000, 25, 5, 0.01, 0.025, Outcome.UNSURE),
        (1000, 25, 5, 0.01, 0.05, Outcome.OVER),
        (1000, 28, 3, 0.01, 0.025 / 2, Outcome.OVER),  # 0.0014 and 0.0037: both under 1.25%
        # Tango alone would show these over (p 0.0233, 0.0228); Wald's p (0.0752, 0.0253) holds them back.
        (300, 7, 0, 0.01, 0.025, Outcome.UNSURE),
        (40, 4, 0, 0.0, 0.025, Outcome.UNSURE),
        (5, 5, 0, 0.5, 0.025, Outcome.UNSURE),  # here Wald's p is 0.0124 and Tango's, 0.0983, holds it back
        (1000, 3, 3, 0.01, 0.025, Outcome.WITHIN),
    ],
)
def test_the_p_value_of_shown_over_on_both_tests_agrees_with_the_lower_bound(
    n, correct_to_wrong, wrong_to_correct, limit, over_alpha, outcome
):
    """The p of "shown over" is the larger of Tango's and the Wald test's on Agresti and Min's se, as the lower bound is
    the smaller of theirs: under a level exactly where that lower bound is over the limit."""
    p = paired_binary_over_p(n, correct_to_wrong, wrong_to_correct, limit)
    verdict = paired_binary_non_inferiority(n, correct_to_wrong, wrong_to_correct, limit, over_alpha=over_alpha)
    assert (p < over_alpha) == (verdict.lower > limit) == (verdict.outcome is Outcome.OVER)
    assert verdict.outcome is outcome
    tango = stats.norm.sf(tango_statistic(n, correct_to_wrong, wrong_to_correct, limit))
    drop = (correct_to_wrong - wrong_to_correct) / n
    wald = stats.norm.sf((drop - limit) / agresti_min_se(n, correct_to_wrong, wrong_to_correct))
    assert p == pytest.approx(max(tango, wald))


def test_where_lower_is_better_the_flips_trade_places():
    higher = paired_binary_non_inferiority(300, 12, 7, 0.01)
    lower = paired_binary_non_inferiority(300, 7, 12, 0.01, higher_is_better=False)
    assert (lower.drop, lower.lower, lower.upper) == (higher.drop, higher.lower, higher.upper)
    assert lower.documents_needed == higher.documents_needed
    assert paired_binary_over_p(300, 7, 12, 0.01, higher_is_better=False) == paired_binary_over_p(300, 12, 7, 0.01)


def test_no_documents_is_no_verdict_and_flips_beyond_the_documents_are_an_error():
    verdict = paired_binary_non_inferiority(0, 0, 0, 0.01)
    assert verdict.outcome is Outcome.UNSURE and math.isnan(verdict.upper) and verdict.documents_needed is None
    assert math.isnan(paired_binary_over_p(0, 0, 0, 0.01))
    with pytest.raises(ValueError, match="do not fit 10 documents"):
        paired_binary_non_inferiority(10, 8, 3, 0.01)


def exact_sizes(n: int, discordance: float, limit: float) -> dict[str, float]:
    """The probability of each claim at the null boundary, a true drop of exactly `limit` with `discordance` of the
    documents flipping, by enumerating the trinomial (worse, better, the rest): "shown within" and "shown over" by
    Tango's bounds and by the Wald bounds on Agresti and Min's se that came before them (issue 45), and "shown over"
    as `paired_binary_non_inferiority` claims it, where both lower bounds are over the limit. Tables of probability
    under 1e-13 are left out; what they hold in all is checked to be negligible."""
    worse_rate, better_rate = (discordance + limit) / 2, (discordance - limit) / 2
    worse, better = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    possible = worse + better <= n
    rest = np.where(possible, n - worse - better, 0)
    log_p = (
        special.gammaln(n + 1)
        - special.gammaln(worse + 1)
        - special.gammaln(better + 1)
        - special.gammaln(rest + 1)
        + worse * math.log(worse_rate)
        + better * math.log(better_rate)
        + rest * math.log(1 - discordance)
    )
    probability = np.where(possible, np.exp(log_p), 0.0)
    kept = probability > 1e-13
    assert 1 - probability[kept].sum() < 1e-9
    sizes = dict.fromkeys(("wald_within", "tango_within", "wald_over", "tango_over", "combined_over"), 0.0)
    edge, z = limit + float_slack(limit), stats.norm.ppf(0.975)
    for w, b in zip(worse[kept].tolist(), better[kept].tolist()):
        verdict = paired_binary_non_inferiority(n, w, b, limit)  # its upper bound is Tango's alone
        wald = non_inferiority((w - b) / n, agresti_min_se(n, w, b), n, limit).outcome
        tango_over = _tango_bound(n, w, b, z) > edge
        assert (verdict.outcome is Outcome.OVER) == (tango_over and wald is Outcome.OVER), (w, b)
        sizes["wald_within"] += probability[w, b] * (wald is Outcome.WITHIN)
        sizes["tango_within"] += probability[w, b] * (verdict.outcome is Outcome.WITHIN)
        sizes["wald_over"] += probability[w, b] * (wald is Outcome.OVER)
        sizes["tango_over"] += probability[w, b] * tango_over
        sizes["combined_over"] += probability[w, b] * (verdict.outcome is Outcome.OVER)
    return sizes


@pytest.mark.parametrize(
    ("n", "discordance", "limit", "wald_within", "tango_within", "wald_over", "tango_over", "combined_over"),
    [
        # The issue's cells: the Wald bounds showed "within" 3.5% and 4.7% of the time at a 2.5% level.
        (300, 0.02, 0.01, 0.0350, 0.0203, 0.0060, 0.0440, 0.0060),
        (40, 0.10, 0.05, 0.0473, 0.0161, 0.0123, 0.0123, 0.0123),
        (100, 0.06, 0.05, 0.0478, 0.0127, 0.0060, 0.0313, 0.0060),
        (1000, 0.06, 0.05, 0.0327, 0.0228, 0.0181, 0.0286, 0.0181),
        (40, 0.20, 0.10, 0.0323, 0.0176, 0.0165, 0.0261, 0.0157),
        # A 6% discordance at a 1-point limit: both near the level (at n = 40 a point is out of reach).
        (300, 0.06, 0.01, 0.0252, 0.0235, 0.0202, 0.0273, 0.0202),
        (40, 0.06, 0.01, 0.0049, 0.0049, 0.0052, 0.0052, 0.0052),
    ],
)
def test_the_exact_size_of_shown_within_is_near_its_level_on_tangos_bounds(
    n, discordance, limit, wald_within, tango_within, wald_over, tango_over, combined_over
):
    """Issue 45: the one-sided 2.5% claim "shown within", at a true drop of exactly the limit, made by Tango's bounds
    at most 2.6% of the time in these cells, where Wald's on Agresti and Min's se made it up to 4.8%. Tango's own
    "shown over", the claim that rejects a variant, is liberal with few flips (4.4% at n = 300 with 2% flipping,
    against Wald's 0.6%), so the claim made needs both lower bounds over the limit: at most the smaller of the two
    tests' sizes (0.6% there; 1.57% at n = 40 with 20% flipping, under Wald's 1.65% and Tango's 2.61%), never over
    2.5% here."""
    sizes = exact_sizes(n, discordance, limit)
    assert sizes == pytest.approx(
        {
            "wald_within": wald_within,
            "tango_within": tango_within,
            "wald_over": wald_over,
            "tango_over": tango_over,
            "combined_over": combined_over,
        },
        abs=5e-5,
    )
    assert sizes["tango_within"] <= 0.026
    assert sizes["tango_within"] <= sizes["wald_within"]
    assert sizes["combined_over"] <= min(sizes["wald_over"], sizes["tango_over"]) + 1e-15
    assert sizes["combined_over"] <= 0.025
