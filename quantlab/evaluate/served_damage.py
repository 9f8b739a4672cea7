"""Token damage through a serving engine: its prompt log-probabilities (`Engine.prompt_logprobs`: per position the
top k tokens and the actual one) against the baseline's stored pass over the same windows of the same tokens.

Top-1 agreement and the variant's NLL are exact. The KL is over the engine's top-k tokens (and the actual token)
plus one bucket for the rest of the vocabulary: merging outcomes can only shrink a KL divergence (the log-sum
inequality), so it is a lower bound of the exact KL. By the chain rule its shortfall is exactly
p_rest * KL(P | rest || Q | rest): it vanishes with the baseline's mass outside the engine's top k, which is logged
beside it (`kld_topk_tail_mass`). Logged as `kld_topk_*` so that nobody reads it as the exact figure; how far below
the exact KL it falls at k = 20 and k = 100 is measured in benchmarks/README.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantlab.evaluate.damage import token_damage
from quantlab.evaluate.reference import (
    LOGPROBS_FILE,
    NLL_FILE,
    TOKENS_FILE,
    TOP1_FILE,
    Window,
    read_reference,
    reference_windows,
)
from quantlab.serving.engines.base import Engine, PositionLogprobs

TAIL_FLOOR = 1e-12  # a bucket's probability below this is rounding, not mass


def topk_kld(reference_logprobs: np.ndarray, token_ids: np.ndarray, engine_logprobs: np.ndarray) -> tuple[float, float]:
    """KL(P || Q) with every token outside `token_ids` merged into one bucket, P from the reference's full
    log-probabilities (renormalized), Q known on `token_ids` only: a lower bound of the exact KL (see the module);
    and P's mass in that bucket."""
    return bucketed_kld(_renormalized(reference_logprobs)[token_ids], engine_logprobs)


def _renormalized(log_p: np.ndarray) -> np.ndarray:
    """Stored log-probabilities (float16 on disk) made a distribution again in float64."""
    log_p = np.asarray(log_p, dtype=np.float64)
    return log_p - np.logaddexp.reduce(log_p)


def bucketed_kld(log_p: np.ndarray, log_q: np.ndarray) -> tuple[float, float]:
    """KL(P || Q) over the tokens whose log-probabilities are given (the same tokens, in the same order, in both)
    plus one bucket for the rest of the vocabulary; and P's mass in that bucket."""
    p_known, q_known = np.exp(log_p), np.exp(log_q)
    known = float(np.sum(p_known * (log_p - log_q)))
    p_rest = max(0.0, 1.0 - float(p_known.sum()))
    q_rest = max(TAIL_FLOOR, 1.0 - float(q_known.sum()))
    rest = p_rest * np.log(p_rest / q_rest) if p_rest > TAIL_FLOOR else 0.0
    return max(0.0, known + rest), p_rest


@dataclass(frozen=True)
class ServedPass:
    """The reference's windows through the engine once: what it reported for each scored token, in the reference's
    order, and each token's scoring window."""

    positions: list[PositionLogprobs]
    windows: np.ndarray

    @property
    def nll(self) -> np.ndarray:
        return np.array([-found.actual for found in self.positions], dtype=np.float64)

    @property
    def top1(self) -> np.ndarray:
        return np.array([found.top1 for found in self.positions], dtype=np.int64)


def served_pass(
    engine: Engine,
    url: str,
    model_name: str,
    reference_dir: Path,
    top_k: int,
    concurrency: int,
    reverse: bool = False,
    timeout_s: float = 600,
) -> ServedPass:
    """The engine's prompt log-probabilities over the reference's windows, sent `concurrency` at a time (`reverse`:
    the last window first, so that each meets other neighbours in the engine's batches)."""
    info = read_reference(reference_dir)
    tokens = np.load(info.path / TOKENS_FILE).astype(np.int64)
    windows = reference_windows(info)

    def one(window: Window) -> list[PositionLogprobs | None]:
        return engine.prompt_logprobs(url, model_name, tokens[window.start : window.end].tolist(), top_k, timeout_s)

    order = windows[::-1] if reverse else windows
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        answers = dict(zip((window.start for window in order), pool.map(one, order)))
    positions: list[PositionLogprobs] = []
    window_of: list[int] = []
    for index, window in enumerate(windows):
        reported = answers[window.start]
        for position in range(window.score_from - window.start, window.end - window.start):
            found = reported[position]
            if found is None:
                raise RuntimeError(f"the engine gave no log-probabilities for token {window.start + position}")
            positions.append(found)
            window_of.append(index)
    return ServedPass(positions, np.array(window_of, dtype=np.int64))


@dataclass(frozen=True)
class ServedTokens:
    kld_topk: np.ndarray
    tail_mass: np.ndarray  # the reference's probability outside the top k it is compared on, per token
    baseline_nll: np.ndarray
    variant_nll: np.ndarray
    top1_match: np.ndarray
    windows: np.ndarray  # each token's scoring window: the cluster of its standard errors

    def metrics(self, prefix: str = "quality/served/") -> dict[str, float]:
        figures = token_damage(self.kld_topk, self.baseline_nll, self.variant_nll, self.top1_match, self.windows)
        served = {key.removeprefix("quality/").replace("kld_", "kld_topk_"): value for key, value in figures.items()}
        served["kld_topk_tail_mass"] = float(self.tail_mass.mean())
        return {f"{prefix}{name}": value for name, value in served.items()}


def served_token_comparison(served: ServedPass, reference_dir: Path) -> ServedTokens:
    """A served pass against the reference's stored one, token by token."""
    info = read_reference(reference_dir)
    pairs = [bucketed_kld(log_p, log_q) for log_p, log_q in _known_logprobs(served, reference_dir)]
    kld = np.array([kl for kl, _ in pairs], dtype=np.float64)
    tail = np.array([rest for _, rest in pairs], dtype=np.float64)
    baseline_nll = np.load(info.path / NLL_FILE).astype(np.float64)
    baseline_top1 = np.load(info.path / TOP1_FILE)
    return ServedTokens(kld, tail, baseline_nll, served.nll, served.top1 == baseline_top1, served.windows)


def bucketed_ear(log_p: np.ndarray, log_q: np.ndarray) -> float:
    """Expected acceptance rate, sum of min(p, q), over the tokens whose log-probabilities are given plus one bucket
    for the rest of the vocabulary: an upper bound of the exact EAR, since merging outcomes can only raise a sum of
    minima (min(a + b, c + d) >= min(a, c) + min(b, d))."""
    p_known, q_known = np.exp(log_p), np.exp(log_q)
    rest = min(max(0.0, 1.0 - float(p_known.sum())), max(0.0, 1.0 - float(q_known.sum())))
    return min(1.0, float(np.minimum(p_known, q_known).sum()) + rest)


def served_on_policy_figures(served: ServedPass, reference_dir: Path) -> dict[str, np.ndarray]:
    """Per token of the baseline's stored on-policy pass (quantlab.evaluate.on_policy), through the engine: the
    top-k KL (a lower bound), top-1 agreement and delta-NLL as the served token damage has them, and the top-k EAR
    (an upper bound, `bucketed_ear`)."""
    known = list(_known_logprobs(served, reference_dir))
    info = read_reference(reference_dir)
    baseline_nll = np.load(info.path / NLL_FILE).astype(np.float64)
    return {
        "kld_topk_mean": np.array([bucketed_kld(log_p, log_q)[0] for log_p, log_q in known], dtype=np.float64),
        "top1_agreement": (served.top1 == np.load(info.path / TOP1_FILE)).astype(np.float64),
        "ear_topk": np.array([bucketed_ear(log_p, log_q) for log_p, log_q in known], dtype=np.float64),
        "delta_nll": served.nll - baseline_nll,
    }


def _known_logprobs(served: ServedPass, reference_dir: Path) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per scored token: the reference's log-probabilities (renormalized) on the tokens the engine reported, and the
    engine's on the same tokens."""
    info = read_reference(reference_dir)
    stored = np.load(info.path / LOGPROBS_FILE, mmap_mode="r")
    for row, found in enumerate(served.positions):
        yield _renormalized(stored[row])[found.token_ids], found.logprobs


def shared_topk_kld(first: PositionLogprobs, second: PositionLogprobs) -> tuple[float, float]:
    """KL(first || second) where each is known on its own top k only: the tokens both report, each alone, and one
    bucket for the rest of the vocabulary. A partition of the vocabulary, so a lower bound of the exact KL, as
    `topk_kld` is (see the module); and the first's mass in that bucket."""
    _, in_first, in_second = np.intersect1d(first.token_ids, second.token_ids, return_indices=True)
    return bucketed_kld(first.logprobs[in_first], second.logprobs[in_second])


def served_twice(first: ServedPass, second: ServedPass) -> ServedTokens:
    """The same checkpoint served twice, the second pass against the first, token by token: the engine's own
    variation (its floor), on the figures a variant's served token damage reports."""
    pairs = [shared_topk_kld(a, b) for a, b in zip(first.positions, second.positions, strict=True)]
    kld = np.array([kl for kl, _ in pairs], dtype=np.float64)
    tail = np.array([rest for _, rest in pairs], dtype=np.float64)
    return ServedTokens(kld, tail, first.nll, second.nll, first.top1 == second.top1, first.windows)
