"""Quantization damage against the baseline, as pure statistics over already computed numbers:
token level (perplexity, KL divergence as ``llama-perplexity --kl-divergence`` reports it, top-1
agreement, Δp) and answer level (flips with the exact McNemar test, recovery). The baseline
compared with itself yields the same keys (KL 0, agreement 1, no flips, recovery 1)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

from quantlab.paired import mcnemar_exact_p  # re-exported: the one exact McNemar test


def perplexity(nll: np.ndarray) -> float:
    """exp of the mean negative log-likelihood (natural log) of the scored tokens."""
    return math.exp(float(_as_1d_float64(nll, "nll").mean()))


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
    """Summary of per-token KL values; the standard error uses the sample deviation (ddof=1).
    Percentiles interpolate linearly between order statistics, as llama.cpp and numpy do."""
    kld = _as_1d_float64(per_token_kld, "per_token_kld")
    percentiles = np.percentile(kld, [50.0, 90.0, 95.0, 99.0, 99.9])
    # One token has no spread to estimate: 0 keeps the column numeric (exact for the baseline's KL of 0).
    stderr = float(kld.std(ddof=1) / math.sqrt(kld.size)) if kld.size > 1 else 0.0
    return KldStats(float(kld.mean()), stderr, *map(float, percentiles), float(kld.max()))


@dataclass(frozen=True)
class TokenDamage:
    """Token-level damage of one variant over the perplexity corpus."""

    ppl: float
    ppl_tokens: int
    baseline_ppl: float
    kld: KldStats
    top1_agreement: float
    delta_p_mean: float  # Δp = p_variant - p_baseline of the correct token, as a fraction
    delta_p_rms: float
    ln_ppl_ratio: float

    def to_metrics(self) -> dict[str, float]:
        """quality/<field> (the KL statistics as quality/kld_<statistic>); baseline_ppl is the baseline's own row."""
        figures = asdict(self)
        del figures["baseline_ppl"]
        figures |= {f"kld_{name}": value for name, value in figures.pop("kld").items()}
        return {f"quality/{name}": float(value) for name, value in figures.items()}


def token_damage(
    kld: np.ndarray, baseline_nll: np.ndarray, variant_nll: np.ndarray, top1_match: np.ndarray
) -> TokenDamage:
    """Token-level damage from per-token arrays, all aligned on the same scored tokens."""
    kld = _as_1d_float64(kld, "kld")
    baseline_nll = _as_1d_float64(baseline_nll, "baseline_nll")
    variant_nll = _as_1d_float64(variant_nll, "variant_nll")
    top1_match = np.asarray(top1_match, dtype=bool).reshape(-1)
    sizes = {a.size for a in (kld, baseline_nll, variant_nll, top1_match)}
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
    def flipped_doc_ids(self) -> tuple[int | str, ...]:
        return tuple(sorted((*self.correct_to_wrong_ids, *self.wrong_to_correct_ids), key=_doc_id_order))

    def to_metrics(self) -> dict[str, float]:
        return flip_metrics(self.task, len(self.correct_to_wrong_ids), len(self.wrong_to_correct_ids))


def flip_metrics(task: str, correct_to_wrong: int, wrong_to_correct: int) -> dict[str, float]:
    """quality/flips/<task> (both ways, and each way) and quality/mcnemar_p/<task>; for a group,
    give the sums over its leaves (its documents are theirs)."""
    prefix = f"quality/flips/{task}"
    return {
        prefix: float(correct_to_wrong + wrong_to_correct),
        f"{prefix}/correct_to_wrong": float(correct_to_wrong),
        f"{prefix}/wrong_to_correct": float(wrong_to_correct),
        f"quality/mcnemar_p/{task}": mcnemar_exact_p(correct_to_wrong, wrong_to_correct),
    }


def paired_flips(task: str, baseline: Mapping[int | str, float], variant: Mapping[int | str, float]) -> FlipStats:
    """Flips between baseline and variant correctness (doc_id -> 1.0 correct / 0.0 wrong). Both must
    score the same samples: differing doc ids (another `limit`, another task version) are refused."""
    if baseline.keys() != variant.keys():
        only_base = len(baseline.keys() - variant.keys())
        only_variant = len(variant.keys() - baseline.keys())
        raise ValueError(
            f"task {task!r}: baseline and variant scored different samples "
            f"({only_base} only in baseline, {only_variant} only in variant)"
        )
    pairs = {
        doc_id: (_is_correct(task, doc_id, baseline[doc_id]), _is_correct(task, doc_id, variant[doc_id]))
        for doc_id in sorted(baseline, key=_doc_id_order)
    }
    correct_to_wrong = tuple(doc_id for doc_id, pair in pairs.items() if pair == (True, False))
    wrong_to_correct = tuple(doc_id for doc_id, pair in pairs.items() if pair == (False, True))
    counts = Counter(pairs.values())
    p = mcnemar_exact_p(len(correct_to_wrong), len(wrong_to_correct))
    return FlipStats(task, counts[True, True], counts[False, False], correct_to_wrong, wrong_to_correct, p)


@dataclass(frozen=True)
class Recovery:
    """variant / baseline for each metric of one task (1.0 = nothing lost), taken as is: for
    lower-is-better metrics above 1 means worse. A baseline of 0 gives 1.0 when the variant is 0
    too, and NaN (undefined, but the column stays) otherwise."""

    task: str
    ratios: Mapping[str, float]

    def to_metrics(self) -> dict[str, float]:
        return {f"quality/recovery/{self.task}/{metric}": ratio for metric, ratio in self.ratios.items()}


def recovery(task: str, baseline: Mapping[str, float], variant: Mapping[str, float]) -> Recovery:
    """Recovery of every metric the baseline and the variant both report for one task, except
    standard errors (``*_stderr``)."""
    shared = sorted(metric for metric in baseline.keys() & variant.keys() if not metric.endswith("_stderr"))
    return Recovery(task, {metric: _ratio(float(baseline[metric]), float(variant[metric])) for metric in shared})


def _ratio(base: float, var: float) -> float:
    if base == 0.0:
        return 1.0 if var == 0.0 else math.nan
    return var / base


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
