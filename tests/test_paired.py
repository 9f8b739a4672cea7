"""Paired statistics and non-inferiority, against hand computations and scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from quantlab.paired import (
    Aggregation,
    DocumentScores,
    NotPaired,
    Outcome,
    combine,
    compare,
    documents_from_json,
    documents_to_json,
    mcnemar_exact_p,
    non_inferiority,
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
    [(0, 0, 1.0), (1, 0, 1.0), (5, 0, 2 / 2**5), (3, 3, 1.0), (10, 2, stats.binomtest(10, 12).pvalue)],
)
def test_mcnemar_exact(to_wrong: int, to_right: int, expected: float) -> None:
    assert mcnemar_exact_p(to_wrong, to_right) == pytest.approx(expected, rel=1e-12)


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
    assert result.ci95_low == pytest.approx(math.exp(2) * math.expm1(2 / 15 - 1.959964 * se_shift), rel=1e-6)
    assert result.p_value == pytest.approx(2 * stats.norm.sf((2 / 15) / se_shift), rel=1e-9)


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
    assert unweighted.se == pytest.approx(math.sqrt(0.25 * first.se**2 + 0.25 * second.se**2))


@pytest.mark.parametrize(
    ("n", "to_wrong", "to_right", "limit", "outcome"),
    [
        (1000, 25, 5, 0.01, Outcome.OVER),  # drop 2 pts, one-sided lower bound 1.1 pts
        (1000, 25, 5, 0.03, Outcome.WITHIN),  # upper bound 2.9 pts
        (40, 2, 1, 0.05, Outcome.UNSURE),  # drop 2.5 pts, upper bound 9.7 pts
        (4000, 200, 100, 0.05, Outcome.WITHIN),  # the same flip rates, 100x the documents
        (40, 0, 0, 0.01, Outcome.WITHIN),  # identical answers: no drop, no spread
        (40, 4, 0, 0.0, Outcome.OVER),  # every flip one way beyond noise
    ],
)
def test_non_inferiority_outcomes(n: int, to_wrong: int, to_right: int, limit: float, outcome: Outcome) -> None:
    result = compare("task", *binary(n, n // 2, to_wrong, to_right))
    verdict = non_inferiority(-result.diff, result.se, result.n, limit)
    assert verdict.outcome is outcome
    assert verdict.lower <= verdict.drop <= verdict.upper
    assert (verdict.documents_needed is None) == (outcome is not Outcome.UNSURE)


def test_documents_needed_is_the_size_that_settles_the_same_spread() -> None:
    result = compare("task", *binary(40, 20, 2, 1))
    verdict = non_inferiority(-result.diff, result.se, 40, 0.05)
    spread = result.se * math.sqrt(40)  # Hand: sqrt((3 - 40 * 0.025^2) / 39)
    assert spread == pytest.approx(math.sqrt((3 - 40 * 0.025**2) / 39))
    assert verdict.documents_needed == math.ceil((1.644854 * spread / (0.05 - 0.025)) ** 2) == 331
    # At that size and spread the upper bound reaches the limit.
    assert 0.025 + 1.644854 * spread / math.sqrt(verdict.documents_needed) <= 0.05 + 1e-6
    assert non_inferiority(0.05, result.se, 40, 0.05).documents_needed is None  # on the limit: nothing settles it


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
