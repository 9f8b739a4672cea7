"""The engine against itself (quantlab.engine_noise): served differences judged against the baseline served twice,
from logged runs; and the KL between two served passes that each report only their top tokens."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from quantlab.engine_noise import engine_noise, within_noise
from quantlab.evaluate.served_damage import ServedPass, served_twice, shared_topk_kld
from quantlab.frontier import VariantSummary
from quantlab.metrics import ENGINE_FLOOR_PREFIX, ENGINE_VS_REFERENCE_PREFIX, PAIRED_PREFIX, paired_key
from quantlab.paired import Aggregation, DocumentScores, compare
from quantlab.report import BEYOND, WITHIN, engine_floor_table
from quantlab.serving.engines.base import PositionLogprobs

CLOZE = "eval/pydoc_cloze/acc"


def _logged(prefix: str, first: list[float], second: list[float]) -> dict[str, float]:
    """The paired figures a run logs for `second` against `first`, per document, under `prefix`."""
    comparison = compare(
        CLOZE,
        DocumentScores(Aggregation.MEAN, dict(enumerate(first))),
        DocumentScores(Aggregation.MEAN, dict(enumerate(second))),
    )
    return {paired_key(CLOZE, name, prefix): value for name, value in comparison.statistics().items()}


RIGHT = [1.0] * 30 + [0.0] * 10


def _flipped(scores: list[float], right_to_wrong: int, wrong_to_right: int = 0) -> list[float]:
    changed = list(scores)
    for index in range(right_to_wrong):
        changed[index] = 0.0
    for index in range(wrong_to_right):
        changed[30 + index] = 1.0
    return changed


# (the baseline served twice: its flips, a variant's engine - reference flips, its served drop's flips, judged). The
# floor reaches as far as its interval, the one a verdict on its flips would judge by: among 40 documents, +-8.76 pts
# with no flip (Tango's z^2 / (n + z^2)), +-10.8 with one each way, +-12.5 with two, 17.9 below with (3, 1).
@pytest.mark.parametrize(
    "floor, against_reference, drop, judged",
    [
        ((1, 1), (1, 0), (1, 1), (True, True)),  # no more than the engine moves on its own
        # A second serving that flipped nothing among 40 documents cannot tell 3 flips (7.5 pts) from its own noise
        ((0, 0), (0, 0), (3, 0), (True, True)),
        ((0, 0), (0, 0), (4, 0), (True, False)),  # 10 pts: beyond what 40 identical answers leave open
        ((2, 2), (6, 0), (0, 6), (False, False)),  # both beyond (15 pts): a kernel difference, a real change
        ((2, 2), (4, 0), (0, 4), (True, True)),  # 10 pts either way: within
        ((3, 1), (1, 2), (2, 1), (True, True)),
    ],
)
def test_served_differences_are_judged_against_the_baseline_served_twice(floor, against_reference, drop, judged):
    baseline = VariantSummary(
        "bf16",
        "bf16",
        True,
        {CLOZE: 0.75} | _logged(ENGINE_FLOOR_PREFIX, RIGHT, _flipped(RIGHT, *floor)),
        is_baseline=True,
    )
    variant = VariantSummary(
        "fp8",
        "fp8",
        True,
        {CLOZE: 0.7}
        | _logged(ENGINE_VS_REFERENCE_PREFIX, RIGHT, _flipped(RIGHT, *against_reference))
        | _logged(PAIRED_PREFIX, RIGHT, _flipped(RIGHT, *drop)),
    )
    found = engine_noise([baseline, variant])
    assert found is not None
    (score,) = found.scores
    verdicts = {(j.variant, j.what): j.within for j in score.judged}
    assert (verdicts[("fp8", "engine - reference")], verdicts[("fp8", "served drop")]) == judged
    assert ("bf16", "served drop") not in verdicts  # the baseline against itself is zero by construction
    rows = engine_floor_table([baseline, variant]).rows
    words = {row[3].split(":")[0]: row[4] for row in rows if row[2] == "fp8"}
    assert words == {
        "engine - reference": WITHIN if judged[0] else BEYOND,
        "served drop": WITHIN if judged[1] else BEYOND,
    }


def test_no_floor_logged_no_section():
    baseline = VariantSummary("bf16", "bf16", True, {CLOZE: 0.75}, is_baseline=True)
    assert engine_noise([baseline]) is None and engine_floor_table([baseline]) is None


@pytest.mark.parametrize(
    "difference, low, high, within",
    [(0.0, 0.0, 0.0, True), (0.01, 0.0, 0.0, False), (-0.05, -0.04, 0.06, True), (-0.07, -0.04, 0.06, False)],
)
def test_within_noise_is_the_farthest_end_of_the_floors_interval(difference, low, high, within):
    floor = compare(
        CLOZE, DocumentScores(Aggregation.MEAN, {0: 1.0, 1: 0.0}), DocumentScores(Aggregation.MEAN, {0: 1.0, 1: 0.0})
    )
    assert within_noise(difference, replace(floor, ci95_low=low, ci95_high=high, diff=(low + high) / 2)) is within


def _position(ids: list[int], probabilities: list[float], actual: int = 0) -> PositionLogprobs:
    logprobs = np.log(np.array(probabilities))
    return PositionLogprobs(
        float(logprobs[actual]), ids[int(np.argmax(logprobs))], np.array(ids), logprobs.astype(np.float64)
    )


def test_two_served_passes_kl_is_a_lower_bound_of_the_exact_kl_over_the_tokens_both_report():
    """Over a 6-token vocabulary: each pass reports its top 3; the KL over the tokens both report plus one bucket
    is at most the exact KL (log-sum inequality), and zero for identical passes."""
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.04, 0.01])
    q = np.array([0.45, 0.1, 0.25, 0.12, 0.05, 0.03])
    first = _position([0, 1, 2], p[[0, 1, 2]].tolist())
    second = _position([0, 2, 3], q[[0, 2, 3]].tolist())
    bound, rest = shared_topk_kld(first, second)
    exact = float(np.sum(p * np.log(p / q)))
    merged = (
        p[0] * math.log(p[0] / q[0])
        + p[2] * math.log(p[2] / q[2])
        + (1 - p[0] - p[2]) * math.log((1 - p[0] - p[2]) / (1 - q[0] - q[2]))
    )
    assert bound == pytest.approx(merged) and 0 < bound <= exact
    assert rest == pytest.approx(1 - p[0] - p[2])
    assert shared_topk_kld(first, first)[0] == pytest.approx(0.0, abs=1e-12)


def test_a_pass_served_twice_alike_has_full_agreement_and_no_kl():
    positions = [_position([0, 1, 2], [0.6, 0.3, 0.05]), _position([3, 1, 2], [0.7, 0.2, 0.05], actual=1)]
    first = ServedPass(positions, np.array([0, 0]))
    moved = [positions[0], _position([1, 3, 2], [0.5, 0.4, 0.05], actual=1)]  # its top-1 changed
    same = served_twice(first, first).metrics("f/")
    assert same["f/top1_agreement"] == 1.0 and same["f/kld_topk_mean"] == pytest.approx(0.0, abs=1e-12)
    differs = served_twice(first, ServedPass(moved, np.array([0, 0]))).metrics("f/")
    assert differs["f/top1_agreement"] == 0.5 and differs["f/kld_topk_mean"] > 0
