"""Sampled tasks scored in repeats (evals.tasks[].repeats): per-item means, items as clusters, and what would settle
an undecided check, more items or more repeats."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from quantlab.decision import settling_words
from quantlab.paired import (
    Aggregation,
    DocumentScores,
    NotPaired,
    RepeatVariance,
    compare,
    documents_from_json,
    documents_to_json,
    repeat_variance,
    settling,
)

# Four items, two repeats each (0/1 scores): per-repeat differences (-1, 0), (0, -1), (0, 1), (0, 1).
BASELINE = [{0: 1, 1: 1, 2: 0, 3: 1}, {0: 0, 1: 1, 2: 0, 3: 0}]
VARIANT = [{0: 0, 1: 1, 2: 0, 3: 1}, {0: 0, 1: 0, 2: 1, 3: 1}]


def test_a_document_s_value_is_its_mean_over_the_repeats():
    scores = DocumentScores.of_repeats(BASELINE)
    assert scores.aggregation is Aggregation.MEAN
    assert scores.values == {0: 0.5, 1: 1.0, 2: 0.0, 3: 0.5}
    assert scores.repeats == {0: (1.0, 0.0), 1: (1.0, 1.0), 2: (0.0, 0.0), 3: (1.0, 0.0)}
    assert scores.repeat_count == 2
    assert scores.aggregate() == pytest.approx(0.5)  # the mean over items x repeats
    assert documents_from_json(documents_to_json({"k": scores})) == {"k": scores}


def test_repeats_that_scored_different_documents_are_refused():
    with pytest.raises(ValueError, match="same documents"):
        DocumentScores.of_repeats([{0: 1.0, 1: 0.0}, {0: 1.0, 2: 0.0}])


def test_se_by_hand_items_as_clusters():
    """By hand: item mean differences -0.5, -0.5, 0.5, 0.5, diff 0; their sample variance 1/3, se sqrt(1/3 / 4).
    The same from the 8 repeat-level differences with the 4 items as clusters (CR1): cluster sums -1, -1, 1, 1,
    sqrt(4/3 * 4) / 8. Within: each item's two differences are 1 apart, variance 1/2; between: 1/3 - (1/2) / 2."""
    found = compare("t", DocumentScores.of_repeats(BASELINE), DocumentScores.of_repeats(VARIANT))
    assert found.diff == 0.0
    assert found.se == pytest.approx(math.sqrt(1 / 12)) == pytest.approx(math.sqrt(4 / 3 * 4) / 8)
    assert (found.n, found.repeats, found.df, found.test) == (4, 2, 3.0, "repeats_t")
    assert found.variance == RepeatVariance(4, 2, pytest.approx(1 / 12), pytest.approx(0.5))
    half = stats.t.ppf(0.975, 3) * found.se
    assert (found.ci95_low, found.ci95_high) == (pytest.approx(-half), pytest.approx(half))


def _cr1(d: np.ndarray) -> float:
    """The cluster-robust (CR1) se of the mean of an items x repeats array, the items as clusters, written out."""
    g, k = d.shape
    sums = (d - d.mean()).sum(axis=1)
    return math.sqrt(g / (g - 1) * float((sums**2).sum())) / (g * k)


@pytest.mark.parametrize(
    ("items", "repeats", "between", "within"), [(5, 2, 0.0, 1.0), (30, 3, 0.5, 0.2), (12, 8, 1, 1)]
)
def test_the_clustered_se_is_the_se_of_the_item_means_and_holds_the_within_item_variance(
    items, repeats, between, within
):
    rng = np.random.default_rng(items * repeats)
    effect = rng.normal(0, math.sqrt(between), size=(items, 1))
    base = rng.normal(size=(items, repeats))
    variant = base + effect + rng.normal(0, math.sqrt(within), size=(items, repeats))
    runs = [[{i: float(x[i, r]) for i in range(items)} for r in range(repeats)] for x in (base, variant)]
    found = compare("t", DocumentScores.of_repeats(runs[0]), DocumentScores.of_repeats(runs[1]))
    d = variant - base
    assert found.se == pytest.approx(_cr1(d))
    assert found.se == pytest.approx(stats.sem(d.mean(axis=1)))
    assert found.p_value == pytest.approx(stats.ttest_1samp(d.mean(axis=1), 0).pvalue)
    parts = repeat_variance(DocumentScores.of_repeats(runs[0]), DocumentScores.of_repeats(runs[1]))
    # The item means' variance is between + within / k (moments, by construction, up to the floor at 0).
    spread = float(d.mean(axis=1).var(ddof=1))
    assert parts.item_variance(repeats) == pytest.approx(max(spread, parts.within / repeats))
    assert parts.within == pytest.approx(float(d.var(axis=1, ddof=1).mean()))


def test_baseline_and_variant_of_other_repeats_are_not_paired():
    once = DocumentScores(Aggregation.MEAN, {0: 0.5, 1: 1.0, 2: 0.0, 3: 0.5})
    with pytest.raises(NotPaired, match="different repeats"):
        compare("t", DocumentScores.of_repeats(BASELINE), once)
    three = DocumentScores.of_repeats([*BASELINE, BASELINE[0]])
    with pytest.raises(NotPaired, match="2 and 3 per document"):
        compare("t", DocumentScores.of_repeats(BASELINE), three)


# z_0.975 + z_0.8 = 2.80158; at a drop of 0 and a limit of 0.1 the mean difference's variance must reach
# (0.1 / 2.80158)^2 = 0.00127407.
@pytest.mark.parametrize(
    ("variance", "available", "items", "repeats", "by"),
    [
        # Nothing between items: 0.5 / 0.00127407 = 392.4 -> 393 items (706 more scorings), or 1 / (40 * 0.00127407)
        # = 19.6 -> 20 repeats (720 more): items, which cut both parts of the variance.
        (RepeatVariance(40, 2, 0.0, 1.0), None, 393, 20, "items"),
        # The task has 100 items: repeats are the way left.
        (RepeatVariance(40, 2, 0.0, 1.0), 100, None, 20, "repeats"),
        # 0.1 between items is more than 40 items can bring to 0.05096 however often each is repeated.
        (RepeatVariance(40, 2, 0.1, 1.0), 100, None, None, None),
        # One repeat shows no within-item variance: only items.
        (RepeatVariance(40, 1, 0.2, math.nan), None, 157, None, "items"),
    ],
)
def test_more_items_or_more_repeats(variance, available, items, repeats, by):
    found = settling(variance, 0.0, 0.1, alpha=0.025, power=0.8, available=available)
    assert (found.items, found.repeats, found.by) == (items, repeats, by)


@pytest.mark.parametrize(
    ("variance", "available", "words"),
    [
        (
            RepeatVariance(40, 2, 0.0, 1.0),
            100,
            "about 18 more repeats would settle it (40 documents x 20 repeats, 80% power)",
        ),
        (RepeatVariance(40, 2, 0.0, 1.0), None, "about 393 documents would settle it (x 2 repeats, 80% power)"),
        (
            RepeatVariance(40, 2, 0.1, 1.0),
            100,
            "neither more repeats nor the documents the task has would settle it at 80% power: a wider limit would",
        ),
    ],
)
def test_advice_words(variance, available, words):
    assert settling_words(settling(variance, 0.0, 0.1, alpha=0.025, power=0.8, available=available), 0.8) == words


def test_one_more_repeat_is_singular():
    # 0.5 / (40 v) with v at a drop of 0 and a limit of 0.2: 0.5 / 0.2038 = 2.45 -> 3 repeats, one more than 2.
    found = settling(RepeatVariance(40, 2, 0.0, 0.5), 0.0, 0.2, alpha=0.025, power=0.8, available=40)
    assert settling_words(found, 0.8).startswith("about 1 more repeat would settle it (40 documents x 3 repeats")
