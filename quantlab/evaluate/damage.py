"""Quantization damage against the baseline, as pure statistics over already computed numbers.

Token level (one value per scored corpus token, computed by :mod:`quantlab.evaluate.reference`):
perplexity, and the statistics ``llama-perplexity --kl-divergence`` reports for
KL(P_baseline || Q_variant): mean with its standard error, median, p90, p95, p99, p99.9 and max
(percentiles interpolate linearly between order statistics, as llama.cpp and numpy's default do),
the share of tokens whose top-1 prediction matches the baseline's, the change in probability of
the correct token ``Δp = p_variant - p_baseline`` (mean and RMS, as fractions, not percent) and
``ln(PPL(variant) / PPL(baseline))``.

Answer level (one value per lm-eval sample): flips between correct and wrong, the exact McNemar
test on the discordant pairs (:func:`quantlab.paired.mcnemar_exact_p`), and recovery
``variant metric / baseline metric``. The paired difference, its interval and test for every
score shape live in :mod:`quantlab.paired`.

The baseline compared to itself goes through the same functions and yields the same keys
(KL 0, agreement 1, no flips, recovery 1), so every run can be compared column by column.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from quantlab.paired import (
    mcnemar_exact_p,  # the one exact McNemar test (re-exported here)
)

QUALITY = "quality"


def perplexity(nll: np.ndarray) -> float:
    """exp of the mean negative log-likelihood (natural log) of the scored tokens."""
    nll = _as_1d_float64(nll, "nll")
    return math.exp(float(nll.mean()))


@dataclass(frozen=True)
class KldStats:
    """Distribution of the per-token KL divergence, in nats."""

    mean: float
    mean_stderr: float
    median: float
    p90: float
    p95: float
    p99: float
    p999: float
    max: float


def kld_stats(per_token_kld: np.ndarray) -> KldStats:
    """Summary of per-token KL values; the standard error uses the sample deviation (ddof=1)."""
    kld = _as_1d_float64(per_token_kld, "per_token_kld")
    median, p90, p95, p99, p999 = np.percentile(kld, [50.0, 90.0, 95.0, 99.0, 99.9])
    # One token has no spread to estimate; 0 keeps the column numeric (and is exact for the
    # baseline, whose KL is identically 0).
    stderr = float(kld.std(ddof=1) / math.sqrt(kld.size)) if kld.size > 1 else 0.0
    return KldStats(
        mean=float(kld.mean()),
        mean_stderr=stderr,
        median=float(median),
        p90=float(p90),
        p95=float(p95),
        p99=float(p99),
        p999=float(p999),
        max=float(kld.max()),
    )


@dataclass(frozen=True)
class TokenDamage:
    """Token-level damage of one variant over the perplexity corpus.

    ``kld_error_bound_mean`` bounds how far ``kld.mean`` may lie from the KL computed with
    exact float32 baseline log-probabilities (the stored baseline is rounded; see
    :mod:`quantlab.evaluate.reference`). It is a diagnostic, not one of the contract keys.
    """

    ppl: float
    ppl_tokens: int
    baseline_ppl: float
    kld: KldStats
    top1_agreement: float
    delta_p_mean: float
    delta_p_rms: float
    ln_ppl_ratio: float
    kld_error_bound_mean: float = 0.0

    def to_metrics(self) -> dict[str, float]:
        return {
            f"{QUALITY}/ppl": self.ppl,
            f"{QUALITY}/ppl_tokens": float(self.ppl_tokens),
            f"{QUALITY}/kld_mean": self.kld.mean,
            f"{QUALITY}/kld_mean_stderr": self.kld.mean_stderr,
            f"{QUALITY}/kld_median": self.kld.median,
            f"{QUALITY}/kld_p90": self.kld.p90,
            f"{QUALITY}/kld_p95": self.kld.p95,
            f"{QUALITY}/kld_p99": self.kld.p99,
            f"{QUALITY}/kld_p999": self.kld.p999,
            f"{QUALITY}/kld_max": self.kld.max,
            f"{QUALITY}/top1_agreement": self.top1_agreement,
            f"{QUALITY}/delta_p_mean": self.delta_p_mean,
            f"{QUALITY}/delta_p_rms": self.delta_p_rms,
            f"{QUALITY}/ln_ppl_ratio": self.ln_ppl_ratio,
        }


def token_damage(
    kld: np.ndarray,
    baseline_nll: np.ndarray,
    variant_nll: np.ndarray,
    top1_match: np.ndarray,
    kld_error_bound: np.ndarray | None = None,
) -> TokenDamage:
    """Token-level damage from per-token arrays, all aligned on the same scored tokens."""
    kld = _as_1d_float64(kld, "kld")
    baseline_nll = _as_1d_float64(baseline_nll, "baseline_nll")
    variant_nll = _as_1d_float64(variant_nll, "variant_nll")
    top1_match = np.asarray(top1_match, dtype=bool).reshape(-1)
    bound = np.zeros_like(kld) if kld_error_bound is None else _as_1d_float64(kld_error_bound, "kld_error_bound")
    sizes = {a.size for a in (kld, baseline_nll, variant_nll, top1_match, bound)}
    if len(sizes) != 1:
        raise ValueError(f"per-token arrays differ in length: {sorted(sizes)}")
    delta_p = np.exp(-variant_nll) - np.exp(-baseline_nll)
    return TokenDamage(
        ppl=perplexity(variant_nll),
        ppl_tokens=int(variant_nll.size),
        baseline_ppl=perplexity(baseline_nll),
        kld=kld_stats(kld),
        top1_agreement=float(top1_match.mean()),
        delta_p_mean=float(delta_p.mean()),
        delta_p_rms=float(np.sqrt(np.mean(delta_p**2))),
        # Difference of mean NLLs rather than log of a ratio of rounded perplexities.
        ln_ppl_ratio=float(variant_nll.mean() - baseline_nll.mean()),
        kld_error_bound_mean=float(bound.mean()),
    )


@dataclass(frozen=True)
class FlipStats:
    """Paired per-sample comparison of a variant with the baseline on one task."""

    task: str
    both_correct: int
    both_wrong: int
    correct_to_wrong_ids: tuple[int | str, ...]
    wrong_to_correct_ids: tuple[int | str, ...]
    mcnemar_p: float

    @property
    def correct_to_wrong(self) -> int:
        return len(self.correct_to_wrong_ids)

    @property
    def wrong_to_correct(self) -> int:
        return len(self.wrong_to_correct_ids)

    @property
    def flips(self) -> int:
        return self.correct_to_wrong + self.wrong_to_correct

    @property
    def flipped_doc_ids(self) -> tuple[int | str, ...]:
        return tuple(sorted((*self.correct_to_wrong_ids, *self.wrong_to_correct_ids), key=_doc_id_order))

    def to_metrics(self) -> dict[str, float]:
        return flip_metrics(self.task, self.correct_to_wrong, self.wrong_to_correct)


def flip_metrics(task: str, correct_to_wrong: int, wrong_to_correct: int) -> dict[str, float]:
    """quality/flips/<task> (both ways, and each way) and quality/mcnemar_p/<task>; for a group,
    give the sums over its leaves (its documents are theirs)."""
    prefix = f"{QUALITY}/flips/{task}"
    return {
        prefix: float(correct_to_wrong + wrong_to_correct),
        f"{prefix}/correct_to_wrong": float(correct_to_wrong),
        f"{prefix}/wrong_to_correct": float(wrong_to_correct),
        f"{QUALITY}/mcnemar_p/{task}": mcnemar_exact_p(correct_to_wrong, wrong_to_correct),
    }


def paired_flips(
    task: str,
    baseline: Mapping[int | str, float],
    variant: Mapping[int | str, float],
) -> FlipStats:
    """Flips between baseline and variant correctness (doc_id -> 1.0 correct / 0.0 wrong).

    Both must score the same samples: differing doc ids mean the runs are not paired (another
    `limit`, another task version), which would make every count meaningless.
    """
    if baseline.keys() != variant.keys():
        only_base = len(baseline.keys() - variant.keys())
        only_variant = len(variant.keys() - baseline.keys())
        raise ValueError(
            f"task {task!r}: baseline and variant scored different samples "
            f"({only_base} only in baseline, {only_variant} only in variant)"
        )
    counts = {(True, True): 0, (False, False): 0}
    correct_to_wrong: list[int | str] = []
    wrong_to_correct: list[int | str] = []
    for doc_id in sorted(baseline, key=_doc_id_order):
        was = _is_correct(task, doc_id, baseline[doc_id])
        now = _is_correct(task, doc_id, variant[doc_id])
        if was == now:
            counts[(was, now)] += 1
        elif was:
            correct_to_wrong.append(doc_id)
        else:
            wrong_to_correct.append(doc_id)
    return FlipStats(
        task=task,
        both_correct=counts[(True, True)],
        both_wrong=counts[(False, False)],
        correct_to_wrong_ids=tuple(correct_to_wrong),
        wrong_to_correct_ids=tuple(wrong_to_correct),
        mcnemar_p=mcnemar_exact_p(len(correct_to_wrong), len(wrong_to_correct)),
    )


@dataclass(frozen=True)
class Recovery:
    """variant / baseline for each metric of one task (1.0 = nothing lost).

    The ratio is taken as is: for lower-is-better metrics (perplexities) above 1 means worse.
    A baseline of 0 gives 1.0 when the variant is 0 too, and NaN (undefined, but the column
    stays) otherwise.
    """

    task: str
    ratios: Mapping[str, float]

    def to_metrics(self) -> dict[str, float]:
        return {f"{QUALITY}/recovery/{self.task}/{metric}": ratio for metric, ratio in self.ratios.items()}


def recovery(task: str, baseline: Mapping[str, float], variant: Mapping[str, float]) -> Recovery:
    """Recovery of every metric the baseline and the variant both report for one task.

    Standard errors (``*_stderr``) are not metrics to recover and are skipped.
    """
    ratios: dict[str, float] = {}
    for metric in sorted(baseline.keys() & variant.keys()):
        if metric.endswith("_stderr"):
            continue
        base, var = float(baseline[metric]), float(variant[metric])
        if base == 0.0:
            ratios[metric] = 1.0 if var == 0.0 else math.nan
        else:
            ratios[metric] = var / base
    return Recovery(task=task, ratios=ratios)


def _is_correct(task: str, doc_id: int | str, value: float) -> bool:
    if value not in (0.0, 1.0):
        raise ValueError(f"task {task!r}, doc {doc_id!r}: correctness must be 1.0 or 0.0, got {value!r}")
    return value == 1.0


def _doc_id_order(doc_id: int | str) -> tuple[int, int | str]:
    # lm-eval's doc ids are ints; strings (from other harnesses) sort after them, each kind in order.
    return (0, doc_id) if isinstance(doc_id, int) else (1, str(doc_id))


def _as_1d_float64(values: np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.size == 0:
        raise ValueError(f"{name} is empty: no scored tokens")
    return array
