"""Quantization damage against the baseline, as pure statistics over already computed numbers:
token level (perplexity, KL divergence as ``llama-perplexity --kl-divergence`` reports it, top-1
agreement, Δp) and answer level (flips with the exact McNemar test, recovery). The baseline
compared with itself yields the same keys (KL 0, agreement 1, no flips, recovery 1)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from quantlab.metrics import EVAL_PREFIX, is_eval_score
from quantlab.paired import (
    cluster_robust_se,
    mcnemar_exact_p,  # re-exported: the one exact McNemar test
)

# quality/kld_<name> -> the percentile of the per-token KL it reports
KLD_PERCENTILES = {"median": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p999": 99.9}


def perplexity(nll: np.ndarray) -> float:
    """exp of the mean negative log-likelihood (natural log) of the scored tokens."""
    return math.exp(float(_as_1d_float64(nll, "nll").mean()))


def kld_stats(per_token_kld: np.ndarray, clusters: np.ndarray | None = None) -> dict[str, float]:
    """Distribution of per-token KL values, in nats. The standard error of the mean takes `clusters` (the
    scoring window of each token: neighbouring tokens' KL is correlated) as the sampled units, cluster-robust;
    without them, the sample deviation (ddof=1) over independent tokens. Percentiles interpolate linearly
    between order statistics, as llama.cpp and numpy do."""
    kld = _as_1d_float64(per_token_kld, "per_token_kld")
    percentiles = np.percentile(kld, list(KLD_PERCENTILES.values()))
    if clusters is not None:
        codes = np.unique(np.asarray(clusters).reshape(-1), return_inverse=True)[1].reshape(-1)
        if codes.size != kld.size:
            raise ValueError(f"clusters has {codes.size} entries for {kld.size} tokens")
        stderr = cluster_robust_se(kld - kld.mean(), kld.size, codes)
    else:
        stderr = float(kld.std(ddof=1) / math.sqrt(kld.size)) if kld.size > 1 else 0.0
    # One token (or window) has no spread to estimate: 0 keeps the column numeric (exact for the baseline's KL of 0).
    stderr = stderr if math.isfinite(stderr) else 0.0
    return {
        "mean": float(kld.mean()),
        "mean_stderr": stderr,
        **dict(zip(KLD_PERCENTILES, percentiles.tolist())),
        "max": float(kld.max()),
    }


def token_damage(
    kld: np.ndarray,
    baseline_nll: np.ndarray,
    variant_nll: np.ndarray,
    top1_match: np.ndarray,
    clusters: np.ndarray | None = None,
) -> dict[str, float]:
    """quality/<figure> of one variant over the perplexity corpus, from per-token arrays all aligned on the
    same scored tokens (the KL statistics as quality/kld_<statistic>; `clusters`: see kld_stats)."""
    kld = _as_1d_float64(kld, "kld")
    baseline_nll = _as_1d_float64(baseline_nll, "baseline_nll")
    variant_nll = _as_1d_float64(variant_nll, "variant_nll")
    top1_match = np.asarray(top1_match, dtype=bool).reshape(-1)
    sizes = {a.size for a in (kld, baseline_nll, variant_nll, top1_match)}
    if len(sizes) != 1:
        raise ValueError(f"per-token arrays differ in length: {sorted(sizes)}")
    delta_p = np.exp(-variant_nll) - np.exp(-baseline_nll)  # of the correct token, as a fraction
    figures = {
        "ppl": perplexity(variant_nll),
        "ppl_tokens": variant_nll.size,
        "top1_agreement": top1_match.mean(),
        "delta_p_mean": delta_p.mean(),
        "delta_p_rms": np.sqrt(np.mean(delta_p**2)),
        # Difference of mean NLLs rather than log of a ratio of rounded perplexities.
        "ln_ppl_ratio": variant_nll.mean() - baseline_nll.mean(),
    } | {f"kld_{name}": value for name, value in kld_stats(kld, clusters).items()}
    return {f"quality/{name}": float(value) for name, value in figures.items()}


def context_lengths(lengths: Sequence[int], max_positions: int | None) -> tuple[int, ...]:
    """The recipe's context lengths (increasing) that the model can take: those over its `max_positions` dropped,
    and `max_positions` itself as the last when any was (so the longest bucket still reaches the model's limit)."""
    if max_positions is None or lengths[-1] <= max_positions:
        return tuple(lengths)
    return tuple(length for length in lengths if length < max_positions) + (max_positions,)


def token_contexts(windows: Sequence[Any]) -> np.ndarray:
    """Per scored token, in scoring order, how many tokens of its window come before it (its context)."""
    return np.concatenate([np.arange(w.score_from - w.start, w.end - w.start) for w in windows])


def context_buckets(contexts: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
    """Per token, the index of its bucket: bucket i holds the contexts in [lengths[i-1], lengths[i]) (from 0 for
    the first); a context at or past the last length is refused (the windows are never longer than it)."""
    contexts = np.asarray(contexts)
    if contexts.size and contexts.max() >= lengths[-1]:
        raise ValueError(f"a token has {int(contexts.max())} tokens of context, past the longest length {lengths[-1]}")
    return np.searchsorted(np.asarray(lengths), contexts, side="right")


def damage_by_context(
    kld: np.ndarray, top1_match: np.ndarray, contexts: np.ndarray, lengths: Sequence[int]
) -> dict[str, float]:
    """quality/<figure>/ctx<L> per context bucket (see context_buckets): mean and p99 KL, top-1 agreement and the
    tokens counted; a bucket no token fell in is left out."""
    kld, top1_match = _as_1d_float64(kld, "kld"), np.asarray(top1_match, dtype=bool).reshape(-1)
    buckets = context_buckets(contexts, lengths)
    figures: dict[str, float] = {}
    for index, length in enumerate(lengths):
        members = buckets == index
        if not members.any():
            continue
        figures |= {
            f"quality/kld_mean/ctx{length}": float(kld[members].mean()),
            f"quality/kld_p99/ctx{length}": float(np.percentile(kld[members], 99.0)),
            f"quality/top1_agreement/ctx{length}": float(top1_match[members].mean()),
            f"quality/ppl_tokens/ctx{length}": float(members.sum()),
        }
    return figures


def kv_cache_pairs(variants: Sequence[Any]) -> dict[str, str | None]:
    """Each variant with a quantized KV cache -> the recipe's variant that is the same but for it (same method,
    same params, no kv_cache), or None when the recipe has none: the first such in recipe order."""
    pairs: dict[str, str | None] = {}
    for variant in variants:
        if variant.kv_cache is None:
            continue
        pairs[variant.name] = next(
            (
                other.name
                for other in variants
                if other.kv_cache is None and other.method == variant.method and other.params == variant.params
            ),
            None,
        )
    return pairs


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


def paired_flips(
    task: str, baseline: Mapping[int | str, float], variant: Mapping[int | str, float]
) -> dict[str, list[int | str]]:
    """The documents whose correctness flipped (doc_id -> 1.0 correct / 0.0 wrong), in doc id order, under
    "correct_to_wrong" and "wrong_to_correct". Both must score the same samples: differing doc ids
    (another `limit`, another task version) are refused."""
    if baseline.keys() != variant.keys():
        only_base = len(baseline.keys() - variant.keys())
        only_variant = len(variant.keys() - baseline.keys())
        raise ValueError(
            f"task {task!r}: baseline and variant scored different samples "
            f"({only_base} only in baseline, {only_variant} only in variant)"
        )
    flips: dict[str, list[int | str]] = {"correct_to_wrong": [], "wrong_to_correct": []}
    for doc_id in sorted(baseline, key=_doc_id_order):
        was, now = _is_correct(task, doc_id, baseline[doc_id]), _is_correct(task, doc_id, variant[doc_id])
        if was != now:
            flips["correct_to_wrong" if was else "wrong_to_correct"].append(doc_id)
    return flips


def recovery(baseline: Mapping[str, float], variant: Mapping[str, float]) -> dict[str, float]:
    """quality/recovery/<task>/<metric>[:<filter>]: variant / baseline for every lm-eval score both report
    except standard errors (1.0 = nothing lost), taken as is: for lower-is-better scores above 1 means worse.
    A baseline of 0 gives 1.0 when the variant is 0 too, and NaN (undefined, but the column stays) otherwise."""
    shared = sorted(key for key in baseline.keys() & variant.keys() if is_eval_score(key))
    return {f"quality/recovery/{key.removeprefix(EVAL_PREFIX)}": _ratio(baseline[key], variant[key]) for key in shared}


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
