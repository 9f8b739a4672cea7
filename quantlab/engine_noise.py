"""The engine against itself. The baseline's run logs its checkpoint served twice, otherwise batched, the second
pass against the first (`quality/engine_floor/...`): what the engine changes on its own, with the same weights.
A served difference no larger than that (engine against reference, a variant's served drop) is within the
engine's own noise: it cannot be told from a second serving of the same model.

Pure: logged runs in, judgements out; the report words them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quantlab.frontier import VariantSummary, find_baseline, logged_comparison
from quantlab.metrics import ENGINE_FLOOR_PREFIX, ENGINE_VS_REFERENCE_PREFIX, SERVED_QUALITY_PREFIX, is_eval_score
from quantlab.paired import PairedComparison

# Served token figures with a floor, and whether more is better
TOKEN_FIGURES = {"top1_agreement": True, "kld_topk_mean": False}


def noise(floor: PairedComparison) -> float:
    """How far the engine moved a score on its own: the farthest end of the floor's 95% interval from zero."""
    return max(abs(floor.diff), abs(floor.ci95_low), abs(floor.ci95_high))


def within_noise(difference: float, floor: PairedComparison) -> bool:
    return abs(difference) <= noise(floor)


def token_within_noise(figure: str, value: float, floor_value: float) -> bool:
    """A variant's served token figure no worse than the baseline's against itself."""
    return value >= floor_value if TOKEN_FIGURES[figure] else value <= floor_value


@dataclass(frozen=True)
class Judged:
    """One served difference of one variant, and whether the engine's own noise covers it."""

    variant: str
    what: str  # "engine - reference" or "served drop"
    comparison: PairedComparison
    within: bool


@dataclass(frozen=True)
class ScoreFloor:
    """A score's floor and the served differences judged against it."""

    score: str  # eval/<task>/<metric>
    floor: PairedComparison
    judged: tuple[Judged, ...]


@dataclass(frozen=True)
class TokenFloor:
    figure: str  # a served token figure: top1_agreement, kld_topk_mean
    floor: float
    variants: tuple[tuple[str, float, bool], ...]  # (variant, its served figure against the baseline's, within)


@dataclass(frozen=True)
class EngineNoise:
    scores: tuple[ScoreFloor, ...]
    tokens: tuple[TokenFloor, ...]


def engine_noise(variants: Sequence[VariantSummary]) -> EngineNoise | None:
    """Every served difference beside the floor the baseline logged; None when it logged none."""
    baseline = find_baseline(variants)
    if baseline is None or not any(key.startswith(ENGINE_FLOOR_PREFIX) for key in baseline.metrics):
        return None
    succeeded = [variant for variant in variants if variant.succeeded]
    scores = []
    for score in sorted(key for key in baseline.metrics if is_eval_score(key)):
        floor = logged_comparison(baseline, score, ENGINE_FLOOR_PREFIX)
        if floor is None:
            continue
        judged = []
        for variant in succeeded:
            found = [("engine - reference", logged_comparison(variant, score, ENGINE_VS_REFERENCE_PREFIX))]
            if variant is not baseline:
                found.append(("served drop", logged_comparison(variant, score)))
            judged += [
                Judged(variant.name, what, comparison, within_noise(comparison.diff, floor))
                for what, comparison in found
                if comparison is not None
            ]
        scores.append(ScoreFloor(score, floor, tuple(judged)))
    tokens = []
    for figure in TOKEN_FIGURES:
        floor_value = baseline.value(f"{ENGINE_FLOOR_PREFIX}served/{figure}")
        if floor_value is None:
            continue
        found = [
            (variant.name, value, token_within_noise(figure, value, floor_value))
            for variant in succeeded
            if variant is not baseline and (value := variant.value(SERVED_QUALITY_PREFIX + figure)) is not None
        ]
        tokens.append(TokenFloor(figure, floor_value, tuple(found)))
    return EngineNoise(tuple(scores), tuple(tokens))
