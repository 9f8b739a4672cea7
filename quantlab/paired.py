"""Paired statistics against the baseline, and non-inferiority verdicts (pure: numbers in, numbers out).

Baseline and variant answer the same documents, so their difference is judged from the
per-document pairs, never from two independent standard errors: with 1,000 questions,
0.60 -> 0.58 through 25 right-to-wrong and 5 wrong-to-right flips has a paired standard error
of 0.54 points (McNemar p = 3e-4), where treating the two scores as independent samples would
give 2.2 points and call it noise.

Shapes (how lm-eval aggregates a metric over documents), each compared its own way:
- `Aggregation.MEAN`: the score is the mean of per-document values (acc, exact_match, mc2).
  diff = mean of per-document differences; se = their sample deviation / sqrt(n). p: the exact
  McNemar test when every value is 0 or 1, otherwise a paired t-test (scipy's `ttest_rel`).
  Verdicts on 0/1 scores use `agresti_min_se` instead, which is never 0 (see there).
- `Aggregation.WEIGHTED_PERPLEXITY` / `Aggregation.BITS_PER_BYTE`: lm-eval's rolling
  loglikelihood metrics, exp(-sum ll / sum w) and -sum ll / (sum w ln 2), where w is a
  document's words or bytes. Both rest on D = sum(ll_b - ll_v) / sum w, the difference of mean
  negative loglikelihood per unit; its standard error treats documents as the sampled units
  (ratio estimator). Perplexity diffs and intervals are baseline * (exp(D) - 1) mapped through
  the same exp; p is a two-sided z test on D.

Intervals use the normal approximation (z = 1.96 two-sided, 1.645 one-sided), the same one the
non-inferiority verdicts and the sample-size estimates use, so all three agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
from scipy import stats

Z_TWO_SIDED_95 = float(stats.norm.ppf(0.975))
Z_ONE_SIDED_95 = float(stats.norm.ppf(0.95))


class Aggregation(str, Enum):
    MEAN = "mean"
    WEIGHTED_PERPLEXITY = "weighted_perplexity"
    BITS_PER_BYTE = "bits_per_byte"


@dataclass(frozen=True)
class DocumentScores:
    """One metric of one task, per document: the score (MEAN) or the loglikelihood (ratio
    shapes, with the document's words or bytes in `weights`)."""

    aggregation: Aggregation
    values: Mapping[int, float]
    weights: Mapping[int, float] = field(default_factory=dict)

    def aggregate(self) -> float:
        """The task-level figure, computed as lm-eval computes it."""
        values = np.array(list(self.values.values()), dtype=np.float64)
        if self.aggregation is Aggregation.MEAN:
            return float(values.mean())
        total_weight = float(sum(self.weights[doc] for doc in self.values))
        if self.aggregation is Aggregation.WEIGHTED_PERPLEXITY:
            return math.exp(-float(values.sum()) / total_weight)
        return -float(values.sum()) / (total_weight * math.log(2))

    @property
    def is_binary(self) -> bool:
        return self.aggregation is Aggregation.MEAN and all(v in (0.0, 1.0) for v in self.values.values())


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
    test: str  # "mcnemar_exact", "paired_t", "ratio_z", "combined_z" or "none"
    correct_to_wrong: int | None = None  # 0/1 scores only
    wrong_to_correct: int | None = None

    def statistics(self) -> dict[str, float]:
        """The finite figures, by the statistic names of `quantlab.metrics.PAIRED_STATISTICS`."""
        figures: dict[str, float] = {
            "diff": self.diff,
            "se": self.se,
            "ci95_low": self.ci95_low,
            "ci95_high": self.ci95_high,
            "p_value": self.p_value,
            "n": float(self.n),
        }
        if self.correct_to_wrong is not None and self.wrong_to_correct is not None:
            figures["correct_to_wrong"] = float(self.correct_to_wrong)
            figures["wrong_to_correct"] = float(self.wrong_to_correct)
        return {name: value for name, value in figures.items() if math.isfinite(value)}


class NotPaired(ValueError):
    """Baseline and variant scored different documents (another limit, another task version)."""


def compare(task: str, baseline: DocumentScores, variant: DocumentScores) -> PairedComparison:
    """The paired comparison of one metric; raises NotPaired when the documents differ."""
    if baseline.values.keys() != variant.values.keys() or baseline.aggregation is not variant.aggregation:
        only_base = len(baseline.values.keys() - variant.values.keys())
        only_variant = len(variant.values.keys() - baseline.values.keys())
        raise NotPaired(
            f"task {task!r}: baseline and variant scored different documents "
            f"({only_base} only in baseline, {only_variant} only in variant)"
        )
    docs = sorted(baseline.values)
    b = np.array([baseline.values[d] for d in docs], dtype=np.float64)
    v = np.array([variant.values[d] for d in docs], dtype=np.float64)
    if baseline.aggregation is Aggregation.MEAN:
        return _compare_means(b, v, baseline.is_binary and variant.is_binary)
    w = np.array([baseline.weights[d] for d in docs], dtype=np.float64)
    return _compare_ratio(b, v, w, baseline.aggregation, baseline.aggregate(), variant.aggregate())


def _compare_means(b: np.ndarray, v: np.ndarray, binary: bool) -> PairedComparison:
    n = int(b.size)
    d = v - b
    diff = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    low, high = _interval(diff, se)
    if binary:
        c2w, w2c = int(np.sum((b == 1) & (v == 0))), int(np.sum((b == 0) & (v == 1)))
        return PairedComparison(
            n,
            float(b.mean()),
            float(v.mean()),
            diff,
            se,
            low,
            high,
            mcnemar_exact_p(c2w, w2c),
            "mcnemar_exact",
            c2w,
            w2c,
        )
    return PairedComparison(n, float(b.mean()), float(v.mean()), diff, se, low, high, _paired_t_p(d), "paired_t")


def _paired_t_p(d: np.ndarray) -> float:
    if d.size < 2:
        return math.nan
    if np.all(d == d[0]):  # no spread: identical scores say nothing changed, a constant shift is certain
        return 1.0 if d[0] == 0 else 0.0
    return float(stats.ttest_1samp(d, 0.0).pvalue)  # = ttest_rel(v, b)


def _compare_ratio(
    b_ll: np.ndarray, v_ll: np.ndarray, w: np.ndarray, aggregation: Aggregation, baseline: float, variant: float
) -> PairedComparison:
    n = int(b_ll.size)
    total = float(w.sum())
    x = b_ll - v_ll  # per document: how much more negative loglikelihood the variant has
    shift = float(x.sum()) / total  # D: difference of mean NLL per word (or byte)
    residual = x - shift * w
    se_shift = float(math.sqrt(n / (n - 1) * float(np.sum(residual**2))) / total) if n > 1 else math.nan
    p = _z_p(shift, se_shift)
    if aggregation is Aggregation.BITS_PER_BYTE:
        scale = 1 / math.log(2)
        low, high = _interval(shift * scale, se_shift * scale)
        return PairedComparison(n, baseline, variant, variant - baseline, se_shift * scale, low, high, p, "ratio_z")
    low_shift, high_shift = _interval(shift, se_shift)
    return PairedComparison(
        n,
        baseline,
        variant,
        variant - baseline,
        variant * se_shift,  # delta method on exp
        baseline * math.expm1(low_shift),
        baseline * math.expm1(high_shift),
        p,
        "ratio_z",
    )


def combine(parts: Sequence[PairedComparison], weights: Sequence[float]) -> PairedComparison:
    """A group's comparison from its leaves', for a group score = sum(weight * leaf score).

    Leaves are disjoint documents, so their differences are independent: se = sqrt(sum w^2 se^2).
    Flips add up. With size weights over 0/1 leaves the group is one pool of documents and the
    exact McNemar test on the summed flips applies; otherwise p is a z test.
    """
    if not parts or len(parts) != len(weights):
        raise ValueError("combine needs one weight per part, and at least one part")
    w = np.array(weights, dtype=np.float64)
    diff = float(sum(wi * p.diff for wi, p in zip(w, parts)))
    se = float(math.sqrt(sum((wi * p.se) ** 2 for wi, p in zip(w, parts))))
    low, high = _interval(diff, se)
    n = sum(p.n for p in parts)
    baseline = float(sum(wi * p.baseline for wi, p in zip(w, parts)))
    variant = float(sum(wi * p.variant for wi, p in zip(w, parts)))
    flips = [(p.correct_to_wrong, p.wrong_to_correct) for p in parts]
    if all(c is not None and r is not None for c, r in flips):
        c2w, w2c = sum(c for c, _ in flips), sum(r for _, r in flips)  # type: ignore[misc]
        size_weighted = np.allclose(w, [p.n / n for p in parts])
        p_value, test = (
            (mcnemar_exact_p(c2w, w2c), "mcnemar_exact") if size_weighted else (_z_p(diff, se), "combined_z")
        )
        return PairedComparison(n, baseline, variant, diff, se, low, high, p_value, test, c2w, w2c)
    return PairedComparison(n, baseline, variant, diff, se, low, high, _z_p(diff, se), "combined_z")


def agresti_min_se(n: int, correct_to_wrong: int, wrong_to_correct: int) -> float:
    """Standard error of a difference of matched proportions with Agresti and Min's (2005)
    adjustment: half a document added to each of the four cells.

    The plain paired standard error is 0 when no answer flipped, which would declare 5 identical
    answers proof that nothing changes; the adjusted one says how little 5 documents show.
    """
    adjusted_n = n + 2
    b, c = correct_to_wrong + 0.5, wrong_to_correct + 0.5
    return math.sqrt((b + c) - (c - b) ** 2 / adjusted_n) / adjusted_n


def mcnemar_exact_p(correct_to_wrong: int, wrong_to_correct: int) -> float:
    """Exact McNemar test: two-sided binomial test of the discordant pairs against p = 1/2
    (no discordant pair: no evidence of a difference, p = 1)."""
    if correct_to_wrong < 0 or wrong_to_correct < 0:
        raise ValueError("discordant counts must be non-negative")
    discordant = correct_to_wrong + wrong_to_correct
    if discordant == 0:
        return 1.0
    return float(stats.binomtest(correct_to_wrong, discordant, 0.5, alternative="two-sided").pvalue)


def _interval(center: float, se: float) -> tuple[float, float]:
    if not math.isfinite(se):
        return math.nan, math.nan
    return center - Z_TWO_SIDED_95 * se, center + Z_TWO_SIDED_95 * se


def _z_p(center: float, se: float) -> float:
    if not math.isfinite(se):
        return math.nan
    if se == 0:
        return 1.0 if center == 0 else 0.0
    return float(2 * stats.norm.sf(abs(center) / se))


# --------------------------------------------------------------------------------------
# Non-inferiority: is the drop shown to be within a limit?
# --------------------------------------------------------------------------------------


class Outcome(str, Enum):
    WITHIN = "shown within the limit"
    OVER = "shown over the limit"
    UNSURE = "not enough evidence"


@dataclass(frozen=True)
class NonInferiority:
    """A drop (loss in the metric's better direction, in the metric's units) against a limit."""

    drop: float
    se: float
    limit: float
    lower: float  # one-sided 95% bounds of the drop
    upper: float
    outcome: Outcome
    documents_needed: int | None  # UNSURE only: about how many documents would settle it


def non_inferiority(drop: float, se: float, n: int, limit: float) -> NonInferiority:
    """WITHIN when the one-sided 95% upper bound of the drop is within `limit`, OVER when even
    the lower bound exceeds it, UNSURE otherwise, with the documents that would settle it at the
    same per-document spread (se * sqrt(n)) and the same observed drop."""
    if not math.isfinite(se):
        return NonInferiority(drop, se, limit, math.nan, math.nan, Outcome.UNSURE, None)
    margin = Z_ONE_SIDED_95 * se
    lower, upper = drop - margin, drop + margin
    if upper <= limit + _slack(limit):
        return NonInferiority(drop, se, limit, lower, upper, Outcome.WITHIN, None)
    if lower > limit + _slack(limit):
        return NonInferiority(drop, se, limit, lower, upper, Outcome.OVER, None)
    return NonInferiority(drop, se, limit, lower, upper, Outcome.UNSURE, documents_to_settle(drop, se, n, limit))


def documents_to_settle(drop: float, se: float, n: int, limit: float) -> int | None:
    """n such that z * sd / sqrt(n) = |limit - drop|: None when the drop sits on the limit."""
    gap = abs(limit - drop)
    if gap == 0 or n < 1 or not math.isfinite(se):
        return None
    spread = se * math.sqrt(n)
    return max(n + 1, math.ceil((Z_ONE_SIDED_95 * spread / gap) ** 2))


def _slack(limit: float) -> float:
    # Float arithmetic turns a 1.0-point drop into 1.0000000000000009 points: forgive that much.
    return 1e-9 * max(1.0, abs(limit))


# --------------------------------------------------------------------------------------
# Per-document scores as JSON (the variant run's samples.json carries them)
# --------------------------------------------------------------------------------------


def documents_to_json(scores: Mapping[str, DocumentScores]) -> dict[str, dict]:
    """{metric key: {"aggregation", "values": {doc: value}, "weights": {doc: weight}}}."""
    return {
        key: {
            "aggregation": doc.aggregation.value,
            "values": {str(d): v for d, v in doc.values.items()},
            "weights": {str(d): w for d, w in doc.weights.items()},
        }
        for key, doc in scores.items()
    }


def documents_from_json(data: Mapping[str, Mapping]) -> dict[str, DocumentScores]:
    return {
        key: DocumentScores(
            Aggregation(item["aggregation"]),
            {int(d): float(v) for d, v in item["values"].items()},
            {int(d): float(w) for d, w in item.get("weights", {}).items()},
        )
        for key, item in data.items()
    }
