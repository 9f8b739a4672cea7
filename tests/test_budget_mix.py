"""The best mix under a bit budget (quantlab.sensitivity.budget): a knapsack solved by hand, and against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from quantlab.sensitivity.budget import InfeasibleBudget, best_mix

# Three groups of 100 weights: bf16 stores 16 bits a weight and does no damage; fp8 8 bits, int4 4.25 (scales).
WEIGHTS = {"A": 100, "B": 100, "C": 100}
BITS = {group: {"bf16": 1600, "fp8": 800, "int4": 425} for group in WEIGHTS}
DAMAGE = {
    "A": {"bf16": 0.0, "fp8": 0.05, "int4": 0.30},
    "B": {"bf16": 0.0, "fp8": 0.01, "int4": 0.04},
    "C": {"bf16": 0.0, "fp8": 0.02, "int4": 0.10},
}
# budget (bits per weight) -> the least-damage mix, worked out by hand:
HAND = {
    # 1275 bits: only every group in int4 fits, exactly
    4.25: ({"A": "int4", "B": "int4", "C": "int4"}, 0.44),
    # 1800 bits: one group in fp8 (1650); A gains the most from it (0.25, against B's 0.03 and C's 0.08)
    6.0: ({"A": "fp8", "B": "int4", "C": "int4"}, 0.19),
    # 2400 bits: all fp8 (0.08); a bf16 group leaves 800 bits, less than two int4 groups (850)
    8.0: ({"A": "fp8", "B": "fp8", "C": "fp8"}, 0.08),
    # 3000 bits: A in bf16, then B int4 + C fp8 (2825, 0.06) beats B fp8 + C int4 (0.11) and A fp8, B int4, C bf16 (0.09)
    10.0: ({"A": "bf16", "B": "int4", "C": "fp8"}, 0.06),
    16.0: ({"A": "bf16", "B": "bf16", "C": "bf16"}, 0.0),
}


@pytest.mark.parametrize("budget", HAND)
def test_the_hand_solved_knapsack(budget):
    chosen, damage = HAND[budget]
    mix = best_mix(DAMAGE, BITS, WEIGHTS, budget)
    assert mix.chosen == chosen and mix.damage == pytest.approx(damage)
    assert mix.bits == sum(BITS[g][f] for g, f in chosen.items()) and mix.bits_per_weight <= budget


def test_a_budget_below_the_smallest_mix_is_refused_naming_it():
    with pytest.raises(
        InfeasibleBudget, match=r"4\.2 bits per weight is below the least these formats can store: 4\.2500"
    ):
        best_mix(DAMAGE, BITS, WEIGHTS, 4.2)


def test_tables_that_disagree_on_the_formats_are_refused():
    with pytest.raises(ValueError, match="group B: damage and bits must cover"):
        best_mix(DAMAGE, {**BITS, "B": {"bf16": 1600, "fp8": 800}}, WEIGHTS, 8.0)


def _brute_force(damage, bits, weights, budget):
    groups, formats = list(damage), list(damage[next(iter(damage))])
    limit = int(budget * sum(weights.values()))
    feasible = [
        sum(damage[g][f] for g, f in zip(groups, combo))
        for combo in itertools.product(formats, repeat=len(groups))
        if sum(bits[g][f] for g, f in zip(groups, combo)) <= limit
    ]
    return min(feasible) if feasible else None


@pytest.mark.parametrize("scale", [1.0, 1e-6, 1e3], ids=["unit", "per-group-KL", "large"])
@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_and_never_exceeds_the_budget(seed, scale):
    """Random tables of 2-5 groups of unequal sizes and 2-4 formats, their damages at any scale (per-group KL is
    1e-7 to 1e-6): the solver's damage is brute force's least, and its bits are within the budget; where brute force
    finds nothing, the solver refuses."""
    rng = random.Random(seed)
    groups = [f"g{i}" for i in range(rng.randint(2, 5))]
    formats = ["bf16", "fp8", "nvfp4", "int4"][: rng.randint(2, 4)]
    per_weight = {"bf16": 16, "fp8": 8.06, "nvfp4": 4.5, "int4": 4.25}
    weights = {g: rng.choice([64, 128, 320]) for g in groups}
    bits = {g: {f: round(per_weight[f] * weights[g]) for f in formats} for g in groups}
    damage = {
        g: {f: 0.0 if f == "bf16" else scale * rng.uniform(0, 1) / per_weight[f] for f in formats} for g in groups
    }
    budget = rng.uniform(4.0, 12.0)
    least = _brute_force(damage, bits, weights, budget)
    if least is None:
        with pytest.raises(InfeasibleBudget):
            best_mix(damage, bits, weights, budget)
        return
    mix = best_mix(damage, bits, weights, budget)
    assert mix.damage == pytest.approx(least, rel=1e-9, abs=0)
    assert mix.bits <= budget * sum(weights.values())
