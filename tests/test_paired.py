"""Paired statistics and non-inferiority, against hand computations and scipy."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from quantlab.paired import (
    Aggregation,
    DocumentScores,
    NotPaired,
    Outcome,
    agresti_min_se,
    cluster_robust_se,
    combine,
    compare,
    documents_from_json,
    documents_to_json,
    holm_alphas,
    mcnemar_exact_p,
    non_inferiority,
    over_p,
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
    assert result.ci95_low == pytest.approx(-0.02 - 1.959964 * result.se, rel=1e-6)
    assert result.ci95_high < 0


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
    result = compare("task", *binary(1, 1, 1, 0))
    assert math.isnan(result.se) and set(result.statistics()) == {
        "diff",
        "p_value",
        "n",
        "correct_to_wrong",
        "wrong_to_correct",
    }
    assert non_inferiority(-result.diff, result.se, 1, 0.01).outcome is Outcome.UNSURE


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
