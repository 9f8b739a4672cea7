"""The best mix of formats under a bit budget (pure): one format per group of layers, chosen from each group's measured
damage in each format, so that the summed damage is least and the stored bits stay within the budget.

A multiple-choice knapsack, solved exactly as a 0/1 integer program by scipy's `milp` (HiGHS): a variable per (group,
format), one format per group, the stored bits at most the budget. The summed damage stands for the mix's damage: each
group's KL was measured with only that group quantized, so interactions between groups are not modelled (a sweep of
the written mix measures the real figure). Bits are whole numbers (bytes * 8) and the budget is floored to one, so the
solver's feasibility tolerance (far below 1 bit) cannot let a solution past the budget; it is checked again anyway.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


class InfeasibleBudget(ValueError):
    """Even the cheapest format of every group stores more bits than the budget allows."""


@dataclass(frozen=True)
class Mix:
    chosen: dict[str, str]  # group -> format, in the tables' group order
    damage: float  # summed damage of the chosen (group, format) pairs
    bits: int  # stored bits of the chosen
    weights: int  # weights of the groups

    @property
    def bits_per_weight(self) -> float:
        return self.bits / self.weights


def best_mix(
    damage: Mapping[str, Mapping[str, float]],
    bits: Mapping[str, Mapping[str, int]],
    weights: Mapping[str, int],
    budget_bits_per_weight: float,
) -> Mix:
    """The least-damage choice of a format per group whose stored bits, over all the groups' weights, are at most
    `budget_bits_per_weight` on average. `damage[group][format]` (e.g. KL mean with only that group in that format),
    `bits[group][format]` (the group's stored bits in it, scales included) and `weights[group]` cover the same groups
    and formats. InfeasibleBudget (naming the least the groups can take) when no choice fits."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    groups = list(damage)
    formats = list(next(iter(damage.values()))) if groups else []
    if not groups or not formats:
        raise ValueError("no groups or no formats to choose from")
    for group in groups:
        if set(damage[group]) != set(formats) or set(bits[group]) != set(formats):
            raise ValueError(f"group {group}: damage and bits must cover the formats {formats}")
    total_weights = sum(weights[group] for group in groups)
    budget = math.floor(budget_bits_per_weight * total_weights)
    cheapest = sum(min(bits[group].values()) for group in groups)
    if cheapest > budget:
        raise InfeasibleBudget(
            f"{budget_bits_per_weight:g} bits per weight is below the least these formats can store: "
            f"{cheapest / total_weights:.4f} (every group in its smallest format)"
        )
    pairs = [(group, fmt) for group in groups for fmt in formats]
    one_each = np.zeros((len(groups), len(pairs)))
    for column, (group, _) in enumerate(pairs):
        one_each[groups.index(group), column] = 1
    stored = np.array([[float(bits[group][fmt]) for group, fmt in pairs]])
    costs = np.array([damage[group][fmt] for group, fmt in pairs], dtype=float)
    # HiGHS stops within an absolute gap of 1e-6 of the objective: damages of 1e-7 (per-group KL) all look alike to
    # it and it returns whatever mix it found first. Scaled so that the largest is 1, any gap it leaves is relative.
    scale = float(np.abs(costs).max())
    result = milp(
        c=costs / scale if scale > 0 else costs,
        constraints=[LinearConstraint(one_each, 1, 1), LinearConstraint(stored, -np.inf, budget)],
        integrality=np.ones(len(pairs)),
        bounds=Bounds(0, 1),
        options={"mip_rel_gap": 0.0},
    )
    if result.x is None:  # feasible by the check above: a solver failure, said as one
        raise RuntimeError(f"scipy's milp found no mix: {result.message}")
    chosen = {group: fmt for (group, fmt), x in zip(pairs, result.x) if x > 0.5}
    total_bits = sum(bits[group][fmt] for group, fmt in chosen.items())
    if len(chosen) != len(groups) or total_bits > budget:
        raise RuntimeError(f"scipy's milp returned an invalid mix ({len(chosen)} groups, {total_bits} > {budget} bits)")
    return Mix(chosen, sum(damage[group][fmt] for group, fmt in chosen.items()), total_bits, total_weights)
