"""Paired statistics against the baseline, and non-inferiority verdicts (pure: numbers in, numbers out).

Baseline and variant answer the same documents, so their difference is judged from the per-document
pairs, never from two independent standard errors (25 right-to-wrong and 5 wrong-to-right flips in
1,000 questions: paired se 0.54 points, McNemar p = 3e-4, where unpaired noise would say 2.2 points).
Intervals, verdicts and sample sizes use one quantile per comparison: Student's t on the degrees of freedom
of its standard error (documents or clusters less one) where the scores are continuous or clustered, the normal one
for a group of 0/1 leaves not pooled by size, so the logged interval and a verdict at the default level (2.5%
one-sided, the non-inferiority convention) agree. 0/1 scores of one pool of documents are judged on Tango's score
bounds from their flips (`paired_binary_non_inferiority`: Wald bounds on a difference of matched proportions are
liberal), and their logged interval is those bounds (`flip_interval`): there too the interval shown is the one the
verdict judges by, and zero flips show the width their documents leave, not [0, 0].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from statistics import NormalDist

import numpy as np
from pydantic import TypeAdapter

_TAIL_95 = 0.025  # each tail of a two-sided 95% interval: the one-sided level of a verdict by default
Z_TWO_SIDED_95 = NormalDist().inv_cdf(1 - _TAIL_95)


class Aggregation(str, Enum):
    """How lm-eval aggregates a metric over documents."""

    MEAN = "mean"
    WEIGHTED_PERPLEXITY = "weighted_perplexity"  # exp(-sum ll / sum words)
    BITS_PER_BYTE = "bits_per_byte"  # -sum ll / (sum bytes * ln 2)


@dataclass(frozen=True)
class DocumentScores:
    """One metric of one task, per document: the score (MEAN) or the loglikelihood (ratio
    shapes, with the document's words or bytes in `weights`). `clusters`: document -> the cluster it
    was drawn in (per-token figures: the scoring window), when documents of one cluster are correlated;
    empty when each document is its own. `repeats`: document -> its score in each repeat of a sampled task (the same
    seeds, in order, for every variant), whose mean is its value; empty when the task ran once."""

    aggregation: Aggregation
    values: Mapping[int, float]
    weights: Mapping[int, float] = field(default_factory=dict)
    clusters: Mapping[int, int] = field(default_factory=dict)
    repeats: Mapping[int, tuple[float, ...]] = field(default_factory=dict)

    @classmethod
    def of_repeats(cls, runs: Sequence[Mapping[int, float]]) -> DocumentScores:
        """A MEAN score from each repeat's per-document scores: each document's value is its mean over the repeats.
        ValueError where the repeats scored different documents (they would not be one item each)."""
        if not runs or any(run.keys() != runs[0].keys() for run in runs):
            raise ValueError("every repeat must score the same documents")
        per_item = {doc: tuple(float(run[doc]) for run in runs) for doc in runs[0]}
        return cls(
            Aggregation.MEAN,
            {doc: math.fsum(scores) / len(scores) for doc, scores in per_item.items()},
            {},
            {},
            per_item,
        )

    @property
    def repeat_count(self) -> int:
        """Repeats per document (1: the task ran once)."""
        return len(next(iter(self.repeats.values()))) if self.repeats else 1

    def aggregate(self) -> float:
        """The task-level figure, computed as lm-eval computes it."""
        values = np.array(list(self.values.values()), dtype=np.float64)
        if self.aggregation is Aggregation.MEAN:
            return float(values.mean())
        nll = -float(values.sum()) / float(sum(self.weights[doc] for doc in self.values))  # per word or byte
        return math.exp(nll) if self.aggregation is Aggregation.WEIGHTED_PERPLEXITY else nll / math.log(2)


@dataclass(frozen=True)
class PairedComparison:
    """variant - baseline on one metric, from its per-document pairs."""

    n: int
    baseline: float
    variant: float
    diff: float
    se: float  # nan with fewer than two pairs
    ci95_low: float
    ci95_high: float
    p_value: float
    test: str  # "mcnemar_exact", "paired_t", "cluster_t", "ratio_t", "combined_t" or "none"
    correct_to_wrong: int | None = None  # 0/1 scores of independent documents only
    wrong_to_correct: int | None = None
    df: float = math.inf  # degrees of freedom of se (Student's t); inf: the normal quantile (0/1 scores)
    # se^2 over what it would be were every document its own cluster (clustered documents only; 1: no correlation).
    design_effect: float | None = None
    repeats: int = 1  # a sampled task's repeats per document: n documents (items) x repeats scored
    # Repeats > 1: the two parts of the per-item mean difference's variance (`repeat_variance`)
    variance: RepeatVariance | None = None

    def statistics(self) -> dict[str, float]:
        """The finite figures, by the statistic names of `quantlab.metrics.PAIRED_STATISTICS`."""
        figures = {name: getattr(self, name) for name in STATISTICS}
        if self.repeats == 1:  # a task run once logs what it logged before repeats existed
            figures = {name: value for name, value in figures.items() if name not in _REPEATS}
        return {name: float(value) for name, value in figures.items() if value is not None and math.isfinite(value)}

    @property
    def within_sd(self) -> float | None:
        """Repeats > 1: the standard deviation of one repeat's difference around its item's (`RepeatVariance.within`)."""
        within = self.variance.within if self.variance is not None else math.nan
        return math.sqrt(within) if math.isfinite(within) else None

    @classmethod
    def logged(cls, variant: float, figures: Mapping[str, float | None]) -> PairedComparison | None:
        """Back from `statistics()` as a run logged them (None: not logged) and the variant's value. Where flips were
        logged (0/1 scores of one pool) the interval is the one their verdict judges by, `flip_interval`: what a run
        logs today, and what a run logged before showed as an interval that a verdict did not use."""
        if None in (figures["diff"], figures["ci95_low"], figures["ci95_high"]):
            return None
        found = {name: math.nan if value is None else value for name, value in figures.items() if name not in _REPEATS}
        counts = {name: None if figures[name] is None else int(figures[name]) for name in _FLIPS}
        found |= counts | {"n": int(figures["n"] or 0), "df": math.inf if figures["df"] is None else figures["df"]}
        if None not in counts.values() and found["n"] >= 1:
            found["ci95_low"], found["ci95_high"] = flip_interval(found["n"], *counts.values())
        repeats = int(figures.get("repeats") or 1)
        variance = logged_variance(found["n"], repeats, found["se"], figures.get("within_sd"))
        return cls(
            baseline=variant - found["diff"],
            variant=variant,
            test="logged",
            repeats=repeats,
            variance=variance,
            **found,
        )

    def oriented(self, higher_is_better: bool | None) -> PairedComparison:
        """The comparison with the interval a verdict on a metric of this direction judges by. Only 0/1 scores of one
        pool differ: their bounds come from the flips, and which flips count as losses depends on the direction
        (`compare` takes 1, a right answer, as better). Orient before `reversed`, which keeps the interval's ends."""
        if higher_is_better is not False or self.correct_to_wrong is None or self.wrong_to_correct is None:
            return self
        low, high = flip_interval(self.n, self.correct_to_wrong, self.wrong_to_correct, higher_is_better=False)
        return replace(self, ci95_low=low, ci95_high=high)

    def reversed(self) -> PairedComparison:
        """baseline minus variant."""
        return replace(
            self,
            baseline=self.variant,
            variant=self.baseline,
            diff=-self.diff,
            ci95_low=-self.ci95_high,
            ci95_high=-self.ci95_low,
            correct_to_wrong=self.wrong_to_correct,
            wrong_to_correct=self.correct_to_wrong,
        )


_FLIPS = ("correct_to_wrong", "wrong_to_correct")
_REPEATS = ("repeats", "within_sd")  # logged where a sampled task ran in repeats
STATISTICS = ("diff", "se", "ci95_low", "ci95_high", "p_value", "n", "df", *_FLIPS, *_REPEATS)


class NotPaired(ValueError):
    """Baseline and variant scored different documents (another limit, another task version)."""


def compare(task: str, baseline: DocumentScores, variant: DocumentScores) -> PairedComparison:
    """The paired comparison of one metric; raises NotPaired when the documents differ.

    MEAN: the mean of per-document differences, se from their spread; on 0/1 scores p from the exact
    McNemar test and the interval a verdict on their flips judges by (`flip_interval`), else a paired
    t-test. Ratio shapes rest on D = sum(ll_b - ll_v) / sum w (documents as the sampled units);
    perplexity maps D's interval through exp, p is a t test on D.
    With `clusters` the clusters are the sampled units: se is cluster-robust, t has clusters - 1 degrees
    of freedom, and 0/1 scores get no McNemar test (it assumes independent documents).
    """
    if baseline.values.keys() != variant.values.keys() or baseline.aggregation is not variant.aggregation:
        only_base = len(baseline.values.keys() - variant.values.keys())
        only_variant = len(variant.values.keys() - baseline.values.keys())
        raise NotPaired(
            f"task {task!r}: baseline and variant scored different documents "
            f"({only_base} only in baseline, {only_variant} only in variant)"
        )
    if baseline.clusters != variant.clusters:
        raise NotPaired(f"task {task!r}: baseline and variant were scored in different clusters (windows)")
    if baseline.repeat_count != variant.repeat_count or baseline.repeats.keys() != variant.repeats.keys():
        raise NotPaired(
            f"task {task!r}: baseline and variant were scored with different repeats "
            f"({baseline.repeat_count} and {variant.repeat_count} per document)"
        )
    if baseline.repeats:
        return _compare_repeats(baseline, variant)
    docs = sorted(baseline.values)
    b, v = (np.array([scores.values[d] for d in docs], dtype=np.float64) for scores in (baseline, variant))
    clusters = _cluster_codes([baseline.clusters[d] for d in docs]) if baseline.clusters else None
    if baseline.aggregation is Aggregation.MEAN:
        return _compare_means(b, v, clusters)
    w = np.array([baseline.weights[d] for d in docs], dtype=np.float64)
    return _compare_ratio(b, v, w, baseline.aggregation, baseline.aggregate(), variant.aggregate(), clusters)


@dataclass(frozen=True)
class RepeatVariance:
    """The variance of one item's mean difference (variant - baseline over its repeats) in two parts: `between`, of the
    items' true differences, and `within`, of one repeat's difference around its item's (the sampling); an item mean
    of k repeats varies by between + within / k. Estimated from `items` items of `repeats` each (one-way ANOVA
    moments): within the pooled variance of the repeats around their item's mean, between the items' means' variance
    less within / k, at least 0."""

    items: int
    repeats: int
    between: float
    within: float

    def item_variance(self, repeats: int) -> float:
        """The variance of one item's mean difference over `repeats` repeats. Measured on one repeat (within nan,
        `between` then holds both parts), only at that one."""
        return self.between if math.isnan(self.within) else self.between + self.within / repeats


def logged_variance(items: int, repeats: int, se: float, within_sd: float | None) -> RepeatVariance | None:
    """`RepeatVariance` back from what a run logged: its items (n), repeats, se (of the mean of the item means: the
    item means' variance is se^2 n) and within-item sd; None where it ran once or logged no within-item sd."""
    if repeats < 2 or within_sd is None or not math.isfinite(se) or items < 1:
        return None
    within = within_sd**2
    return RepeatVariance(items, repeats, max(se * se * items - within / repeats, 0.0), within)


def repeat_variance(baseline: DocumentScores, variant: DocumentScores) -> RepeatVariance:
    """`RepeatVariance` of the paired differences of two scorings with the same repeats of the same documents."""
    docs = sorted(baseline.repeats)
    d = np.array([variant.repeats[doc] for doc in docs], dtype=np.float64) - np.array(
        [baseline.repeats[doc] for doc in docs], dtype=np.float64
    )
    items, k = d.shape
    within = float(d.var(axis=1, ddof=1).mean()) if k > 1 else math.nan
    means = d.mean(axis=1)
    spread = float(means.var(ddof=1)) if items > 1 else math.nan
    between = max(spread - within / k, 0.0) if math.isfinite(within) else spread
    return RepeatVariance(items, k, between, within)


@dataclass(frozen=True)
class Settling:
    """What would settle an undecided check of a sampled task, at the policy's power: `items` at the same repeats, or
    `repeats` on the same items, each with the scorings it adds per variant (an item scored once more costs about one
    generation either way). None: that way cannot (more items than the task has; a between-item variance no number of
    repeats averages away, or one repeat, which shows no within-item variance)."""

    items_now: int
    repeats_now: int
    items: int | None
    repeats: int | None

    @property
    def added_by_items(self) -> int | None:
        return None if self.items is None else (self.items - self.items_now) * self.repeats_now

    @property
    def added_by_repeats(self) -> int | None:
        return None if self.repeats is None else (self.repeats - self.repeats_now) * self.items_now

    @property
    def by(self) -> str | None:
        """ "repeats" where more repeats are the cheaper way that can settle it, "items" where more items are (ties:
        items, which also widen what the verdict speaks for), None where neither can."""
        if self.added_by_repeats is None:
            return None if self.added_by_items is None else "items"
        if self.added_by_items is None or self.added_by_repeats < self.added_by_items:
            return "repeats"
        return "items"


def settling(
    variance: RepeatVariance, drop: float, limit: float, *, alpha: float, power: float, available: int | None = None
) -> Settling:
    """More items or more repeats, for the drop's one-sided (1 - alpha) bound to reach past `limit` with probability
    `power` at the same drop (`non_inferiority`'s sample size): the mean difference's variance must come down to
    v = (|limit - drop| / (z_(1-alpha) + z_power))^2. n items of k repeats give (between + within / k) / n, so
    items: (between + within / k) / v at k; repeats: within / (n v - between) on the n items, possible only where
    n v > between. `available`: the items the task has (None: unknown, no cap)."""
    gap = abs(limit - drop)
    n, k = variance.items, variance.repeats
    if gap == 0 or n < 1:
        return Settling(n, k, None, None)
    target = (gap / (quantile(1 - alpha) + quantile(power))) ** 2
    items: int | None = max(n + 1, math.ceil(variance.item_variance(k) / target))
    if available is not None and items > available:
        items = None
    repeats = None
    room = n * target - variance.between
    # Repeats that never differ within an item (within 0) change nothing however many are added.
    if k > 1 and math.isfinite(variance.within) and variance.within > 0 and room > 0:
        repeats = max(k + 1, math.ceil(variance.within / room))
    return Settling(n, k, items, repeats)


def _compare_repeats(baseline: DocumentScores, variant: DocumentScores) -> PairedComparison:
    """Items scored in k repeats each: items are the sampled units (clusters of their k repeats), so se is the
    cluster-robust se of the mean over all items x repeats with items as clusters, which for the same k per item is
    exactly the standard error of the item means' differences (the sum of an item's residuals is k times its mean's):
    the spread of the item means already holds the sampling within items (between + within / k). t with items - 1
    degrees of freedom; 0/1 item means (every repeat of each item alike) are judged on their flips, as one run's.

    0/1 scores in fractional item means: se is at least `adjusted_item_se`'s, so that identical answers (common with
    the same seeds: a variant close to the baseline samples the same tokens) show no limit, as Agresti and Min's se
    keeps one run's flips from doing (`combine` uses theirs for 0/1 leaves alike)."""
    docs = sorted(baseline.values)
    b, v = (np.array([scores.values[doc] for doc in docs], dtype=np.float64) for scores in (baseline, variant))
    found = _compare_means(b, v)
    parts = repeat_variance(baseline, variant)
    if found.correct_to_wrong is None and b.size > 1:
        d = np.array([variant.repeats[doc] for doc in docs], dtype=np.float64) - np.array(
            [baseline.repeats[doc] for doc in docs], dtype=np.float64
        )
        items = np.repeat(np.arange(d.shape[0]), d.shape[1])
        se = cluster_robust_se(d.reshape(-1) - found.diff, d.size, items)
        if all(np.isin(np.array(list(s.repeats.values())), (0.0, 1.0)).all() for s in (baseline, variant)):
            se = max(se, adjusted_item_se(d.mean(axis=1)))
        low, high = _interval(found.diff, se, found.df)
        found = replace(found, se=se, ci95_low=low, ci95_high=high, test="repeats_t")
    return replace(found, repeats=baseline.repeat_count, variance=parts)


def adjusted_item_se(differences: np.ndarray) -> float:
    """Agresti and Min's (2005) se of a mean of paired differences in [-1, 1], per item: half an item that gained the
    most (+1) and half one that lost the most (-1) added, and one unchanged, then the spread around the adjusted mean
    over n + 2 items. On one run's 0/1 differences it is `agresti_min_se` of their flips; never 0."""
    n = differences.size + 2
    mean = float(differences.sum()) / n
    spread = float(np.sum((differences - mean) ** 2)) + 0.5 * (1 - mean) ** 2 + 0.5 * (1 + mean) ** 2 + mean**2
    return math.sqrt(spread) / n


def cluster_robust_se(residuals: np.ndarray, total: float, clusters: np.ndarray | None = None) -> float:
    """Standard error of sum(residuals) / total with clusters as the sampled units (CR1):
    sqrt(G / (G - 1) * sum over clusters g of (sum of g's residuals)^2) / total, G clusters; without
    `clusters` (cluster index per residual, 0..G-1) every residual is its own cluster. For a mean
    (residuals x - mean, total n, no clusters) it is scipy's sem; for a ratio estimator sum x / sum w
    (residuals x - D w, total sum w) its usual linearised se. Hand-rolled: scipy has no clustered
    variance, and statsmodels' (cov_type="cluster") is not a dependency; the test checks it against the
    closed-form standard error of AR(1) data. nan with fewer than two clusters."""
    sums = residuals if clusters is None else np.bincount(clusters, weights=residuals)
    if sums.size < 2:
        return math.nan
    return math.sqrt(sums.size / (sums.size - 1) * float(np.sum(sums**2))) / total


def _cluster_codes(labels: Sequence[int]) -> np.ndarray:
    return np.unique(np.asarray(labels), return_inverse=True)[1].reshape(-1)


def _clustered(residuals: np.ndarray, total: float, clusters: np.ndarray) -> tuple[float, float, float | None]:
    """(cluster-robust se, its degrees of freedom, design effect against independent documents)."""
    se = cluster_robust_se(residuals, total, clusters)
    independent = cluster_robust_se(residuals, total)
    effect = (se / independent) ** 2 if independent > 0 and math.isfinite(se) else None
    return se, float(clusters.max()), effect  # clusters are numbered 0..G-1: G - 1 degrees of freedom


def _compare_means(b: np.ndarray, v: np.ndarray, clusters: np.ndarray | None = None) -> PairedComparison:
    d = v - b
    diff = float(d.mean())
    if clusters is not None:
        se, df, effect = _clustered(d - diff, d.size, clusters)
        low, high = _interval(diff, se, df)
        p_value = _t_p(diff, se, df)
        return PairedComparison(
            d.size,
            float(b.mean()),
            float(v.mean()),
            diff,
            se,
            low,
            high,
            p_value,
            "cluster_t",
            df=df,
            design_effect=effect,
        )
    se = _standard_error(d) if d.size > 1 else math.nan
    if np.isin(b, (0.0, 1.0)).all() and np.isin(v, (0.0, 1.0)).all():
        flips = (int(np.sum((b == 1) & (v == 0))), int(np.sum((b == 0) & (v == 1))))
        p_value, test, df = mcnemar_exact_p(*flips), "mcnemar_exact", math.inf
        low, high = flip_interval(d.size, *flips)
    else:
        flips, p_value, test, df = (None, None), _paired_t_p(d), "paired_t", float(d.size - 1)
        low, high = _interval(diff, se, df)
    return PairedComparison(d.size, float(b.mean()), float(v.mean()), diff, se, low, high, p_value, test, *flips, df=df)


def _paired_t_p(d: np.ndarray) -> float:
    if d.size < 2:
        return math.nan
    if np.all(d == d[0]):  # no spread: identical scores say nothing changed, a constant shift is certain
        return 1.0 if d[0] == 0 else 0.0
    return 2 * _upper_tail(abs(float(d.mean())) / _standard_error(d), d.size - 1)  # = scipy's ttest_rel(v, b)


def _standard_error(d: np.ndarray) -> float:
    # scipy.stats.sem's formula. scipy.stats is not imported on this path (every sweep's frontier, an unchanged
    # re-run's too): its import is a large share of such a re-run; tests hold these to scipy.stats' values.
    return float(d.std(ddof=1)) / math.sqrt(d.size)


def _compare_ratio(
    b_ll: np.ndarray,
    v_ll: np.ndarray,
    w: np.ndarray,
    aggregation: Aggregation,
    baseline: float,
    variant: float,
    clusters: np.ndarray | None = None,
) -> PairedComparison:
    n = int(b_ll.size)
    total = float(w.sum())
    x = b_ll - v_ll  # per document: how much more negative loglikelihood the variant has
    shift = float(x.sum()) / total  # D: difference of mean NLL per word (or byte)
    residual = x - shift * w  # ratio estimator
    if clusters is not None:
        se_shift, df, effect = _clustered(residual, total, clusters)
    else:
        se_shift, df, effect = cluster_robust_se(residual, total), float(n - 1), None
    if aggregation is Aggregation.BITS_PER_BYTE:
        se = se_shift / math.log(2)
        low, high = _interval(shift / math.log(2), se, df)
    else:  # perplexity: the delta method for se, D's interval mapped through exp
        se = variant * se_shift
        low, high = (baseline * math.expm1(end) for end in _interval(shift, se_shift, df))
    test = "cluster_t" if clusters is not None else "ratio_t"
    p_value = _t_p(shift, se_shift, df)
    return PairedComparison(
        n, baseline, variant, variant - baseline, se, low, high, p_value, test, df=df, design_effect=effect
    )


@dataclass(frozen=True)
class Group:
    """An lm-eval group score as lm-eval computed it: sum(weight * leaf score)."""

    leaves: tuple[str, ...]  # leaf score keys, eval/<leaf>/<metric>[:<filter>]
    weights: tuple[float, ...]


def combine(parts: Sequence[PairedComparison], weights: Sequence[float]) -> PairedComparison:
    """A group's comparison from its leaves', for a group score = sum(weight * leaf score).

    Leaves are disjoint documents, so their differences are independent: se = sqrt(sum w^2 se^2), with
    Welch-Satterthwaite's degrees of freedom. Only size weights over 0/1 leaves make the group one pool of
    documents: then flips add up, the exact McNemar test on the summed flips applies, and a verdict may
    judge the pool by its flips. With other weights (e.g. lm-eval's plain mean of its leaves) no flips are
    summed (a pool's flips would weigh a 50-document leaf like 1/40 of a 2,000-document one, where the group
    weighs them alike), 0/1 leaves contribute Agresti and Min's se (never 0, as a leaf without flips would
    otherwise be), and p is a z (or t) test.
    """
    if not parts or len(parts) != len(weights):
        raise ValueError("combine needs one weight per part, and at least one part")
    w = np.array(weights, dtype=np.float64)
    figures = np.array([(p.baseline, p.variant, p.diff) for p in parts], dtype=np.float64)
    baseline, variant, diff = (float(figure) for figure in w @ figures)
    n = sum(p.n for p in parts)
    zero_one = all(p.correct_to_wrong is not None and p.wrong_to_correct is not None for p in parts)
    by_size = bool(np.allclose(w, [p.n / n for p in parts])) if n else False
    if zero_one and not by_size:
        ses = np.array([agresti_min_se(p.n, p.correct_to_wrong, p.wrong_to_correct) for p in parts])  # type: ignore[arg-type]
    else:
        ses = np.array([p.se for p in parts], dtype=np.float64)
    se = float(np.linalg.norm(w * ses))
    df = satterthwaite_df(w * ses, [p.df for p in parts])
    low, high = _interval(diff, se, df)
    if zero_one and by_size:
        summed = (sum(p.correct_to_wrong for p in parts), sum(p.wrong_to_correct for p in parts))  # type: ignore[misc]
        low, high = flip_interval(n, *summed)  # one pool: judged, hence shown, by its summed flips
        return PairedComparison(
            n, baseline, variant, diff, se, low, high, mcnemar_exact_p(*summed), "mcnemar_exact", *summed
        )
    test = "combined_z" if math.isinf(df) else "combined_t"
    return PairedComparison(n, baseline, variant, diff, se, low, high, _t_p(diff, se, df), test, df=df)


def satterthwaite_df(scaled_ses: np.ndarray, dfs: Sequence[float]) -> float:
    """Welch-Satterthwaite degrees of freedom of sqrt(sum s_i^2), s_i = w_i se_i with df_i each:
    (sum s_i^2)^2 / sum(s_i^4 / df_i); an infinite df_i (a normal part) adds nothing below the line."""
    variances = np.asarray(scaled_ses, dtype=np.float64) ** 2
    finite = np.isfinite(np.asarray(dfs, dtype=np.float64))
    below = float(np.sum(variances[finite] ** 2 / np.asarray(dfs, dtype=np.float64)[finite]))
    if not math.isfinite(float(variances.sum())) or below <= 0:
        return math.inf
    return float(variances.sum()) ** 2 / below


def agresti_min_se(n: int, correct_to_wrong: int, wrong_to_correct: int) -> float:
    """Standard error of a difference of matched proportions with Agresti and Min's (2005)
    adjustment (half a document added to each cell): never 0, so five identical answers do not
    prove that nothing changes."""
    adjusted_n = n + 2
    b, c = correct_to_wrong + 0.5, wrong_to_correct + 0.5
    return math.sqrt((b + c) - (c - b) ** 2 / adjusted_n) / adjusted_n


def flip_se(n: int, correct_to_wrong: int, wrong_to_correct: int) -> float:
    """The standard error that Tango's two-sided 95% interval from the flips implies: its width over 2 z (nan without
    documents)."""
    low, high = flip_interval(n, correct_to_wrong, wrong_to_correct)
    return (high - low) / (2 * quantile(0.975))


def mcnemar_exact_p(correct_to_wrong: int, wrong_to_correct: int) -> float:
    """Exact McNemar test: two-sided binomial test of the discordant pairs against p = 1/2
    (no discordant pair: no evidence of a difference, p = 1)."""
    discordant = correct_to_wrong + wrong_to_correct
    if discordant == 0:
        return 1.0
    # scipy.stats' binomtest at p = 1/2, where the two-sided p is twice the smaller tail, through scipy.special's
    # binomial cdf (see _standard_error for why not scipy.stats).
    return min(1.0, 2 * float(_special().bdtr(min(correct_to_wrong, wrong_to_correct), discordant, 0.5)))


_NORMAL = NormalDist()  # the standard library's normal quantile: exact to double precision, far cheaper than scipy's


def quantile(probability: float, df: float = math.inf) -> float:
    """The standard normal quantile, or Student's t with `df` degrees of freedom when finite."""
    return _NORMAL.inv_cdf(probability) if math.isinf(df) else float(_special().stdtrit(df, probability))


def _upper_tail(z: float, df: float = math.inf) -> float:
    """P(Z > z), normal when df is infinite, Student's t otherwise."""
    return _NORMAL.cdf(-z) if math.isinf(df) else float(_special().stdtr(df, -z))


def _special():  # noqa: ANN202 - the scipy.special module
    # scipy.special's Student t and binomial (cephes, as scipy.stats uses: the same values) on every sweep's path (the
    # frontier's intervals and tests): it imports in a fraction of scipy.stats' time.
    from scipy import special

    return special


def _interval(center: float, se: float, df: float = math.inf) -> tuple[float, float]:
    if not math.isfinite(se):  # scipy's t.interval has no se = 0
        return math.nan, math.nan
    half = (Z_TWO_SIDED_95 if math.isinf(df) else quantile(0.975, df)) * se
    return center - half, center + half


def _t_p(center: float, se: float, df: float = math.inf) -> float:
    """Two-sided p of no difference: normal when df is infinite, Student's t otherwise."""
    if not math.isfinite(se):
        return math.nan
    if se == 0:
        return 1.0 if center == 0 else 0.0
    return 2 * _upper_tail(abs(center) / se, df)


# --- Non-inferiority: is the drop shown to be within a limit? ---


class Outcome(str, Enum):
    WITHIN = "shown within the limit"
    OVER = "shown over the limit"
    UNSURE = "not enough evidence"


@dataclass(frozen=True)
class NonInferiority:
    """A drop (loss in the metric's better direction, in the metric's units) against a limit."""

    outcome: Outcome
    drop: float
    lower: float  # one-sided bound at 1 - over_alpha: "shown over" when above the limit
    upper: float  # one-sided bound at 1 - alpha: "shown within" when at or below the limit
    limit: float
    documents_needed: int | None  # UNSURE only: documents that settle it with the stated power
    alpha: float = 0.025  # one-sided error rate of "shown within"
    over_alpha: float = 0.025  # of "shown over": alpha, or less where the claim is corrected for several checks
    df: float = math.inf  # of the standard error: Student's t when finite
    # UNSURE with more documents needed than the task has: the tightest limit its documents can settle
    # (shown within, or, for a drop beyond the limit, shown exceeded) with the stated power.
    best_limit: float | None = None


def float_slack(limit: float) -> float:
    """Float arithmetic turns a 1.0-point drop into 1.0000000000000009 points: forgive that much."""
    return 1e-9 * max(1.0, abs(limit))


def non_inferiority(
    drop: float,
    se: float,
    n: int,
    limit: float,
    *,
    alpha: float = 0.025,
    over_alpha: float | None = None,
    df: float = math.inf,
    power: float = 0.8,
    available: int | None = None,
) -> NonInferiority:
    """WITHIN when the one-sided (1 - alpha) upper bound of the drop is within `limit`, OVER when even the
    (1 - over_alpha) lower bound exceeds it (over_alpha defaults to alpha; several checks lower it: see
    `holm_alphas`), UNSURE otherwise, with the documents that would settle it with probability `power`.

    Documents needed, at the same spread sd = se sqrt(n) and the same drop (the usual non-inferiority
    sample size): n = ((z_(1-a) + z_power) sd / |limit - drop|)^2, a = alpha towards WITHIN, over_alpha
    towards OVER (power 0.5 gives the n at which the bound merely reaches the limit). When that exceeds
    the `available` documents, `best_limit` is the limit they can settle: drop +- (z_(1-a) + z_power) sd / sqrt(available).
    """
    over_alpha = alpha if over_alpha is None else over_alpha
    settings = {"alpha": alpha, "over_alpha": over_alpha, "df": df}
    if not math.isfinite(se):
        return NonInferiority(Outcome.UNSURE, drop, math.nan, math.nan, limit, None, **settings)
    lower, upper = drop - quantile(1 - over_alpha, df) * se, drop + quantile(1 - alpha, df) * se
    outcome = _outcome(lower, upper, limit)
    if outcome is not Outcome.UNSURE or drop == limit or n < 1:
        return NonInferiority(outcome, drop, lower, upper, limit, None, **settings)
    towards_within = drop < limit
    z = quantile(1 - (alpha if towards_within else over_alpha)) + quantile(power)
    spread = se * math.sqrt(n)
    needed = max(n + 1, math.ceil((z * spread / abs(limit - drop)) ** 2))
    best = None
    if available is not None and needed > available:
        reach = z * spread / math.sqrt(available)
        best = drop + reach if towards_within else drop - reach
    return NonInferiority(outcome, drop, lower, upper, limit, needed, **settings, best_limit=best)


def selection_adjusted_interval(
    drop: float, se: float, threshold: float, level: float = 0.95, df: float = math.inf
) -> tuple[float, float]:
    """The two-sided `level` interval of the true drop of a variant chosen because its observed drop was at most
    `threshold` (its upper bound within the limit): the drop's sampling distribution truncated to that event, and
    the interval of true drops under which the observed one is not in either tail (conditional inference for a
    selected estimate, Lee, Sun, Sun and Taylor 2016). Among chosen variants it covers the truth at `level`; the
    plain interval does not, as passing favours draws that came out low (the winner's curse). Normal (or Student's
    t with `df`) around the drop; a drop far below the threshold gets the plain interval back."""
    if not (math.isfinite(se) and se > 0 and math.isfinite(threshold)) or drop > threshold:
        return _interval(drop, se, df)
    special = _special()

    def log_cdf(z: float) -> float:
        return float(special.log_ndtr(z)) if math.isinf(df) else math.log(max(float(special.stdtr(df, z)), 1e-300))

    def selected_below(true_drop: float) -> float:
        """P(observed <= drop | observed <= threshold) at `true_drop`: falls from 1 to 0 as the true drop rises."""
        return math.exp(log_cdf((drop - true_drop) / se) - log_cdf((threshold - true_drop) / se))

    tail = (1 - level) / 2
    low, high = drop - 60 * se, drop + 60 * se + (threshold - drop)

    def solve(target: float) -> float | None:
        if selected_below(high) >= target:  # no true drop in reach puts the observed one in this tail
            return None
        return _crossing(lambda true_drop: selected_below(true_drop) - target, low, high)

    lower, upper = solve(1 - tail), solve(tail)
    # An observed drop at the threshold itself says nothing of how large the true one may be: no finite upper bound;
    # the lower one is then the plain one (selection removed only draws above the threshold).
    return (_interval(drop, se, df)[0] if lower is None else lower), (math.inf if upper is None else upper)


def _outcome(lower: float, upper: float, limit: float) -> Outcome:
    edge = limit + float_slack(limit)
    return Outcome.WITHIN if upper <= edge else Outcome.OVER if lower > edge else Outcome.UNSURE


def over_p(drop: float, se: float, limit: float, df: float = math.inf) -> float:
    """One-sided p of "the drop is within the limit" (small: shown over it), the p-value `holm_alphas` orders."""
    if not math.isfinite(se):
        return math.nan
    if se == 0:
        return 0.0 if drop > limit + float_slack(limit) else 1.0
    z = (drop - limit) / se
    return _upper_tail(z, df)


def holm_alphas(p_values: Sequence[float], alpha: float) -> list[float]:
    """The one-sided level each of m "shown over" claims is tested at, Holm's (1979) step-down for a
    family-wise error rate of `alpha`: by ascending p, rank r (1-based) at alpha / (m - r + 1), while
    every smaller p was rejected; from the first rank that is not, all later ones at that rank's level
    (their p, no smaller, fails it too, so none is rejected: Holm stops there). nan p-values (no test)
    are left out of m and get the strictest level, alpha / m.

    By hand, alpha 0.025 and p = (0.001, 0.02, 0.004): ranks 0.001 (1), 0.004 (2), 0.02 (3); 0.001 <=
    0.025/3, 0.004 <= 0.025/2, 0.02 <= 0.025/1: levels (0.00833, 0.025, 0.0125), all rejected (Holm's
    adjusted p: 0.003, 0.02, 0.008). With p = (0.013, 0.014): 0.013 > 0.025/2 stops at rank 1, both at 0.0125.
    """
    tested = [i for i, p in enumerate(p_values) if math.isfinite(p)]
    m = len(tested)
    levels = [alpha / max(m, 1)] * len(p_values)
    stopped: float | None = None
    for rank, i in enumerate(sorted(tested, key=lambda i: p_values[i]), start=1):
        level = stopped if stopped is not None else alpha / (m - rank + 1)
        levels[i] = level
        if stopped is None and p_values[i] > level:
            stopped = level
    return levels


# --- 0/1 scores of one pool of documents: Tango's score bounds ---
#
# There the drop is a difference of matched proportions, (worse - better) / n from the discordant pairs. Wald
# bounds on it, even on Agresti and Min's adjusted se, are liberal at the limit: at a true drop of exactly the limit
# they show it within more often than the nominal level (exact enumeration: tests/test_paired.py). Tango's (1998)
# score test keeps "shown within" at or under its level in the cells that test enumerates, and like
# Agresti-Min it never lets a few identical answers show a limit: with no flip its upper bound is z^2 / (n + z^2),
# above 0 for any finite n. On the other claim it is the bolder one where few documents flip: its "shown over", which
# rejects a variant, errs more often than the Wald bound on Agresti and Min's se there. So "shown over" needs both
# lower bounds over the limit: its error is at most the smaller of the two
# tests'.


def tango_restricted_rate(n: float, worse: float, better: float, delta: float) -> float:
    """The maximum-likelihood probability of a `better` pair (the variant right where the baseline was wrong) under
    the null drop p_worse - p_better = `delta`: Tango's (1998) closed form, the non-negative root of
    2n q^2 + (-(worse + better) + (2n - worse + better) delta) q - better delta (1 - delta) = 0. The same for counts
    and for rates (n = 1): every coefficient scales with n."""
    squared = 2 * n
    linear = -(worse + better) + (2 * n - worse + better) * delta
    constant = -better * delta * (1 - delta)
    # The roots are real (the restricted likelihood peaks inside its domain): the max only absorbs rounding.
    discriminant = max(linear * linear - 4 * squared * constant, 0.0)
    return (math.sqrt(discriminant) - linear) / (2 * squared)


def tango_statistic(n: float, worse: float, better: float, delta: float) -> float:
    """Tango's score statistic of the null drop `delta`, (worse - better - n delta) / sqrt(n (2 q + delta (1 - delta))),
    q the restricted rate above: standard normal at the null, decreasing in delta. Where the null leaves no variance
    (delta at an end of [-1, 1], or 0 without flips) it is 0 if the data sit exactly on delta, else +-inf."""
    excess = worse - better - n * delta
    variance = n * _tango_null_variance(n, worse, better, delta)
    if variance == 0:
        return 0.0 if excess == 0 else math.copysign(math.inf, excess)
    return excess / math.sqrt(variance)


def _tango_null_variance(n: float, worse: float, better: float, delta: float) -> float:
    """Per document, of worse - better under the null drop `delta`: 2 q + delta (1 - delta), q the restricted rate."""
    restricted = tango_restricted_rate(n, worse, better, delta)
    # At delta = -1 it is 2 * 1 - 2, where rounding leaves q a hair under 1.
    return max(2 * restricted + delta * (1 - delta), 0.0)


def paired_binary_non_inferiority(
    n: int,
    correct_to_wrong: int,
    wrong_to_correct: int,
    limit: float,
    *,
    higher_is_better: bool = True,
    alpha: float = 0.025,
    over_alpha: float | None = None,
    power: float = 0.8,
    available: int | None = None,
) -> NonInferiority:
    """`non_inferiority` for 0/1 scores of one pool of `n` independent documents, from their flips, on Tango's score
    bounds: the upper one-sided bound is the null drop that the score test at its level just fails to reject; the lower
    one is the smaller of Tango's and the Wald bound on Agresti and Min's se, so "shown over" needs both over the limit
    (see above). The drop is (correct_to_wrong - wrong_to_correct) / n, its negative where lower is better. No
    documents: UNSURE, nan bounds.

    Documents needed, at the same flip rates and drop: the score test's sample size (Nam 1997, Biometrics 53),
    ((z_(1-a) sd_0 + z_power sd) / |limit - drop|)^2, sd_0 the per-document sd of worse - better under the null at the
    limit (Tango's restricted rates), sd the observed one; `best_limit`: the limit at which that is `available`.
    """
    over_alpha = alpha if over_alpha is None else over_alpha
    settings = {"alpha": alpha, "over_alpha": over_alpha}
    if n < 1:
        return NonInferiority(Outcome.UNSURE, math.nan, math.nan, math.nan, limit, None, **settings)
    worse, better = _worse_better(n, correct_to_wrong, wrong_to_correct, higher_is_better)
    drop = (worse - better) / n
    lower, upper = flip_drop_bounds(n, worse, better, alpha, over_alpha)
    outcome = _outcome(lower, upper, limit)
    if outcome is not Outcome.UNSURE or drop == limit:
        return NonInferiority(outcome, drop, lower, upper, limit, None, **settings)
    towards_within = drop < limit
    z_level = quantile(1 - (alpha if towards_within else over_alpha))
    z_power = quantile(power)
    worse_rate, better_rate = worse / n, better / n
    observed_sd = math.sqrt(worse_rate + better_rate - drop**2)

    def documents_at(null_drop: float) -> float:
        if null_drop == drop:
            return math.inf
        null_sd = math.sqrt(_tango_null_variance(1, worse_rate, better_rate, null_drop))
        return ((z_level * null_sd + z_power * observed_sd) / (null_drop - drop)) ** 2

    needed = max(n + 1, math.ceil(documents_at(limit)))
    best = None
    if available is not None and needed > available:
        best = _crossing(lambda null_drop: documents_at(null_drop) - available, drop, 1.0 if towards_within else -1.0)
    return NonInferiority(outcome, drop, lower, upper, limit, needed, **settings, best_limit=best)


def paired_binary_over_p(
    n: int, correct_to_wrong: int, wrong_to_correct: int, limit: float, *, higher_is_better: bool = True
) -> float:
    """`over_p` on Tango's score test and the Wald test on Agresti and Min's se, the larger of the two: below a level
    exactly where `paired_binary_non_inferiority`'s lower bound at that level is over the limit. nan without
    documents."""
    if n < 1:
        return math.nan
    worse, better = _worse_better(n, correct_to_wrong, wrong_to_correct, higher_is_better)
    wald = over_p((worse - better) / n, agresti_min_se(n, worse, better), limit)
    return max(_upper_tail(tango_statistic(n, worse, better, limit)), wald)


def flip_drop_bounds(n: int, worse: int, better: int, alpha: float, over_alpha: float) -> tuple[float, float]:
    """The bounds a verdict on 0/1 scores judges the drop (worse - better) / n by: the lower one the smaller of Tango's
    and the Wald bound on Agresti and Min's se, each one-sided at `over_alpha`; the upper one Tango's at `alpha`."""
    drop = (worse - better) / n
    # Wald's bound may pass -1, where every document gained: no drop is lower, so that is where it is shown.
    wald_lower = max(drop - quantile(1 - over_alpha) * agresti_min_se(n, worse, better), -1.0)
    lower = min(_tango_bound(n, worse, better, quantile(1 - over_alpha)), wald_lower)
    return lower, _tango_bound(n, worse, better, -quantile(1 - alpha))


def flip_interval(
    n: int, correct_to_wrong: int, wrong_to_correct: int, *, higher_is_better: bool = True
) -> tuple[float, float]:
    """The two-sided 95% interval of variant minus baseline on 0/1 scores of one pool of `n` documents: the drop's
    bounds a verdict at the default level (2.5% one-sided each way) judges by, `flip_drop_bounds`, as a difference.
    Never [0, 0]: without a flip it is Tango's +-z^2 / (n + z^2). nan, nan without documents."""
    if n < 1:
        return math.nan, math.nan
    worse, better = _worse_better(n, correct_to_wrong, wrong_to_correct, higher_is_better)
    lower, upper = flip_drop_bounds(n, worse, better, _TAIL_95, _TAIL_95)
    return (-upper, -lower) if higher_is_better else (lower, upper)


def _worse_better(n: int, correct_to_wrong: int, wrong_to_correct: int, higher_is_better: bool) -> tuple[int, int]:
    """The discordant pairs that lost and that gained in the metric's better direction."""
    if min(correct_to_wrong, wrong_to_correct) < 0 or correct_to_wrong + wrong_to_correct > n:
        raise ValueError(f"flips {correct_to_wrong} and {wrong_to_correct} do not fit {n} documents")
    return (correct_to_wrong, wrong_to_correct) if higher_is_better else (wrong_to_correct, correct_to_wrong)


def _tango_bound(n: int, worse: int, better: int, z: float) -> float:
    """The null drop at which Tango's statistic is `z`: the lower bound for z > 0, the upper one for z < 0."""
    drop = (worse - better) / n
    return _crossing(lambda null_drop: tango_statistic(n, worse, better, null_drop) - z, drop, math.copysign(1.0, -z))


def _crossing(gap: Callable[[float], float], near: float, far: float) -> float:
    """Where `gap` changes sign between `near` and `far` (it is monotone there), or `far` where it never does: a bound
    that reaches the end of the drop's range. The Illinois variant of false position (Dowell and Jarratt 1971), to
    1e-12: about 10 steps of a microsecond each, where bisection takes 40 (a 57-subject suite judges 114 bounds per
    variant) and scipy's brentq would add scipy.optimize's import (0.23 s after scipy.special's, see `_special`)."""
    at_near, at_far = gap(near), gap(far)
    if at_near == 0:
        return near
    if (at_far > 0) == (at_near > 0):
        return far
    # A bracket of opposite signs: `kept` the end held over, `latest` the newest estimate.
    kept, at_kept, latest, at_latest = near, at_near, far, at_far
    for _ in range(200):  # a guard: it takes about 10
        if abs(latest - kept) <= 1e-12:
            break
        if math.isinf(at_kept) or math.isinf(at_latest):  # an end of the range, where the null has no variance
            step = (kept + latest) / 2
        else:
            step = latest - at_latest * (latest - kept) / (at_latest - at_kept)
        at_step = gap(step)
        if at_step == 0:
            return step
        if (at_step > 0) == (at_latest > 0):
            at_kept /= 2  # the same end kept twice: halving its weight keeps false position from stalling there
        else:
            kept, at_kept = latest, at_latest
        latest, at_latest = step, at_step
    return latest


# --- Per-document scores as JSON (the variant run's samples.json carries them) ---

# {metric key: {"aggregation", "values": {doc: value}, "weights": {doc: weight}}}, document ids as strings
_DOCUMENTS_JSON = TypeAdapter(dict[str, DocumentScores])


def documents_to_json(scores: Mapping[str, DocumentScores]) -> dict[str, dict]:
    return _DOCUMENTS_JSON.dump_python(dict(scores), mode="json")


def documents_from_json(data: Mapping[str, Mapping]) -> dict[str, DocumentScores]:
    return _DOCUMENTS_JSON.validate_python(data)
