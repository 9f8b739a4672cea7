"""Paired statistics against the baseline, and non-inferiority verdicts (pure: numbers in, numbers out).

Baseline and variant answer the same documents, so their difference is judged from the per-document
pairs, never from two independent standard errors (25 right-to-wrong and 5 wrong-to-right flips in
1,000 questions: paired se 0.54 points, McNemar p = 3e-4, where unpaired noise would say 2.2 points).
Intervals, verdicts and sample sizes all use the normal approximation, so the three agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np
from pydantic import TypeAdapter
from scipy import stats

Z_TWO_SIDED_95 = float(stats.norm.ppf(0.975))
Z_ONE_SIDED_95 = float(stats.norm.ppf(0.95))


class Aggregation(str, Enum):
    """How lm-eval aggregates a metric over documents."""

    MEAN = "mean"
    WEIGHTED_PERPLEXITY = "weighted_perplexity"  # exp(-sum ll / sum words)
    BITS_PER_BYTE = "bits_per_byte"  # -sum ll / (sum bytes * ln 2)


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
    test: str  # "mcnemar_exact", "paired_t", "ratio_z", "combined_z" or "none"
    correct_to_wrong: int | None = None  # 0/1 scores only
    wrong_to_correct: int | None = None

    def statistics(self) -> dict[str, float]:
        """The finite figures, by the statistic names of `quantlab.metrics.PAIRED_STATISTICS`."""
        figures = {name: getattr(self, name) for name in STATISTICS}
        return {name: float(value) for name, value in figures.items() if value is not None and math.isfinite(value)}

    @classmethod
    def logged(cls, variant: float, figures: Mapping[str, float | None]) -> PairedComparison | None:
        """Back from `statistics()` as a run logged them (None: not logged) and the variant's value."""
        if None in (figures["diff"], figures["ci95_low"], figures["ci95_high"]):
            return None
        found = {name: math.nan if value is None else value for name, value in figures.items()}
        counts = {name: None if figures[name] is None else int(figures[name]) for name in STATISTICS[-2:]}
        found |= counts | {"n": int(figures["n"] or 0)}
        return cls(baseline=variant - found["diff"], variant=variant, test="logged", **found)

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


STATISTICS = ("diff", "se", "ci95_low", "ci95_high", "p_value", "n", "correct_to_wrong", "wrong_to_correct")


class NotPaired(ValueError):
    """Baseline and variant scored different documents (another limit, another task version)."""


def compare(task: str, baseline: DocumentScores, variant: DocumentScores) -> PairedComparison:
    """The paired comparison of one metric; raises NotPaired when the documents differ.

    MEAN: the mean of per-document differences, se from their spread; p from the exact McNemar
    test on 0/1 scores, else a paired t-test. Ratio shapes rest on D = sum(ll_b - ll_v) / sum w
    (documents as the sampled units); perplexity maps D's interval through exp, p is a z test on D.
    """
    if baseline.values.keys() != variant.values.keys() or baseline.aggregation is not variant.aggregation:
        only_base = len(baseline.values.keys() - variant.values.keys())
        only_variant = len(variant.values.keys() - baseline.values.keys())
        raise NotPaired(
            f"task {task!r}: baseline and variant scored different documents "
            f"({only_base} only in baseline, {only_variant} only in variant)"
        )
    docs = sorted(baseline.values)
    b, v = (np.array([scores.values[d] for d in docs], dtype=np.float64) for scores in (baseline, variant))
    if baseline.aggregation is Aggregation.MEAN:
        return _compare_means(b, v)
    w = np.array([baseline.weights[d] for d in docs], dtype=np.float64)
    return _compare_ratio(b, v, w, baseline.aggregation, baseline.aggregate(), variant.aggregate())


def _compare_means(b: np.ndarray, v: np.ndarray) -> PairedComparison:
    d = v - b
    diff = float(d.mean())
    se = float(stats.sem(d)) if d.size > 1 else math.nan
    low, high = _interval(diff, se)
    if np.isin(b, (0.0, 1.0)).all() and np.isin(v, (0.0, 1.0)).all():
        flips = (int(np.sum((b == 1) & (v == 0))), int(np.sum((b == 0) & (v == 1))))
        p_value, test = mcnemar_exact_p(*flips), "mcnemar_exact"
    else:
        flips, p_value, test = (None, None), _paired_t_p(d), "paired_t"
    return PairedComparison(d.size, float(b.mean()), float(v.mean()), diff, se, low, high, p_value, test, *flips)


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
    residual = x - shift * w  # ratio estimator
    se_shift = float(math.sqrt(n / (n - 1) * float(np.sum(residual**2))) / total) if n > 1 else math.nan
    if aggregation is Aggregation.BITS_PER_BYTE:
        se = se_shift / math.log(2)
        low, high = _interval(shift / math.log(2), se)
    else:  # perplexity: the delta method for se, D's interval mapped through exp
        se = variant * se_shift
        low, high = (baseline * math.expm1(end) for end in _interval(shift, se_shift))
    return PairedComparison(n, baseline, variant, variant - baseline, se, low, high, _z_p(shift, se_shift), "ratio_z")


@dataclass(frozen=True)
class Group:
    """An lm-eval group score as lm-eval computed it: sum(weight * leaf score)."""

    leaves: tuple[str, ...]  # leaf score keys, eval/<leaf>/<metric>[:<filter>]
    weights: tuple[float, ...]


def combine(parts: Sequence[PairedComparison], weights: Sequence[float]) -> PairedComparison:
    """A group's comparison from its leaves', for a group score = sum(weight * leaf score).

    Leaves are disjoint documents, so their differences are independent: se = sqrt(sum w^2 se^2).
    Flips add up. With size weights over 0/1 leaves the group is one pool of documents and the
    exact McNemar test on the summed flips applies; otherwise p is a z test.
    """
    if not parts or len(parts) != len(weights):
        raise ValueError("combine needs one weight per part, and at least one part")
    w = np.array(weights, dtype=np.float64)
    figures = np.array([(p.baseline, p.variant, p.diff, p.se) for p in parts], dtype=np.float64)
    baseline, variant, diff = (float(figure) for figure in w @ figures[:, :3])
    se = float(np.linalg.norm(w * figures[:, 3]))
    n = sum(p.n for p in parts)
    flips = [(p.correct_to_wrong, p.wrong_to_correct) for p in parts]
    summed, p_value, test = (None, None), _z_p(diff, se), "combined_z"
    if all(None not in pair for pair in flips):
        summed = tuple(sum(column) for column in zip(*flips))
        if np.allclose(w, [p.n / n for p in parts]):
            p_value, test = mcnemar_exact_p(*summed), "mcnemar_exact"
    low, high = _interval(diff, se)
    return PairedComparison(n, baseline, variant, diff, se, low, high, p_value, test, *summed)


def agresti_min_se(n: int, correct_to_wrong: int, wrong_to_correct: int) -> float:
    """Standard error of a difference of matched proportions with Agresti and Min's (2005)
    adjustment (half a document added to each cell): never 0, so five identical answers do not
    prove that nothing changes."""
    adjusted_n = n + 2
    b, c = correct_to_wrong + 0.5, wrong_to_correct + 0.5
    return math.sqrt((b + c) - (c - b) ** 2 / adjusted_n) / adjusted_n


def mcnemar_exact_p(correct_to_wrong: int, wrong_to_correct: int) -> float:
    """Exact McNemar test: two-sided binomial test of the discordant pairs against p = 1/2
    (no discordant pair: no evidence of a difference, p = 1)."""
    discordant = correct_to_wrong + wrong_to_correct
    if discordant == 0:
        return 1.0
    return float(stats.binomtest(correct_to_wrong, discordant, 0.5, alternative="two-sided").pvalue)


def _interval(center: float, se: float) -> tuple[float, float]:  # scipy's norm.interval has no se = 0
    if not math.isfinite(se):
        return math.nan, math.nan
    return center - Z_TWO_SIDED_95 * se, center + Z_TWO_SIDED_95 * se


def _z_p(center: float, se: float) -> float:
    if not math.isfinite(se):
        return math.nan
    if se == 0:
        return 1.0 if center == 0 else 0.0
    return float(2 * stats.norm.sf(abs(center) / se))


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
    lower: float  # one-sided 95% bounds of the drop
    upper: float
    limit: float
    documents_needed: int | None  # UNSURE only: about how many documents would settle it


def float_slack(limit: float) -> float:
    """Float arithmetic turns a 1.0-point drop into 1.0000000000000009 points: forgive that much."""
    return 1e-9 * max(1.0, abs(limit))


def non_inferiority(drop: float, se: float, n: int, limit: float) -> NonInferiority:
    """WITHIN when the one-sided 95% upper bound of the drop is within `limit`, OVER when even
    the lower bound exceeds it, UNSURE otherwise, with the documents that would settle it."""
    if not math.isfinite(se):
        return NonInferiority(Outcome.UNSURE, drop, math.nan, math.nan, limit, None)
    lower, upper = drop - Z_ONE_SIDED_95 * se, drop + Z_ONE_SIDED_95 * se
    edge = limit + float_slack(limit)
    outcome = Outcome.WITHIN if upper <= edge else Outcome.OVER if lower > edge else Outcome.UNSURE
    needed = None  # UNSURE: n such that z * sd / sqrt(n) = |limit - drop| at the same spread and drop
    if outcome is Outcome.UNSURE and drop != limit and n >= 1:
        needed = max(n + 1, math.ceil((Z_ONE_SIDED_95 * se * math.sqrt(n) / abs(limit - drop)) ** 2))
    return NonInferiority(outcome, drop, lower, upper, limit, needed)


# --- Per-document scores as JSON (the variant run's samples.json carries them) ---

# {metric key: {"aggregation", "values": {doc: value}, "weights": {doc: weight}}}, document ids as strings
_DOCUMENTS_JSON = TypeAdapter(dict[str, DocumentScores])


def documents_to_json(scores: Mapping[str, DocumentScores]) -> dict[str, dict]:
    return _DOCUMENTS_JSON.dump_python(dict(scores), mode="json")


def documents_from_json(data: Mapping[str, Mapping]) -> dict[str, DocumentScores]:
    return _DOCUMENTS_JSON.validate_python(data)
