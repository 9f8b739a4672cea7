"""Adaptive evaluation (pure): a variant's task scored in stages, stopped once its drop checks are settled.

Every variant scores a task's documents in one fixed random order (seeded by the recipe and the task's name, so the
order is the same for every variant, and the baseline, which scores every document, has each of them). At the end of
a stage its paired statistics against the baseline are judged exactly as the final verdict judges them
(`quantlab.paired`'s non-inferiority bounds on the policy's drop rules), but at the stage's nominal level: the level an
alpha-spending function (Lan and DeMets 1983) allows once that share of the documents is in. The stages' claims then
err, all together, no more often than the policy's one-sided level, however the variant stops: the error rate of each
check is kept. The task stops at the first stage where every drop check on it is shown within its limit, or one is
shown over it (the variant is then rejected whatever the others show); else it runs to its last document. A variant
that a plain limit of the policy rejects before its tasks run (its token damage over max_kld) stops each at the first
stage: a stop for a reason outside the task's own statistics, after which its claims still stand at that stage's
level, as any group sequential design allows.

The information fraction of a stage is its share of the task's documents (the variance of a paired mean difference is
inversely proportional to the documents paired). Nominal levels come from the usual recursive integration of the
Brownian-motion approximation of the stages' z statistics (Armitage, McPherson and Rowe 1969; Jennison and Turnbull
2000, ch. 19), one-sided: the same boundaries gsDesign computes with `sfLDOF` and `test.type = 1`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from statistics import NormalDist

import numpy as np

from quantlab.paired import (
    NonInferiority,
    Outcome,
    PairedComparison,
    non_inferiority,
    paired_binary_non_inferiority,
)
from quantlab.policy import DropRule

_NORMAL = NormalDist()
# The grid of the recursive integration: z from _LOW to the stage's boundary. Below -_LOW the normal density is under
# 1e-30: nothing there reaches a later boundary.
_LOW = -12.0
_HIGH = 40.0  # a boundary no statistic reaches: a stage that spends nothing
_POINTS = 1001


class Spending(str, Enum):
    """How much of the one-sided level the stages may spend by the time a share t of the documents is in."""

    # Lan and DeMets' O'Brien-Fleming type, one-sided: 2 - 2 Phi(z_(1 - alpha/2) / sqrt(t)). Almost nothing early (a
    # stop needs overwhelming evidence), nearly the whole level at the last stage: a variant that runs every document
    # is judged at close to the level a full evaluation uses.
    OBRIEN_FLEMING = "obrien_fleming"
    # Lan and DeMets' Pocock type: alpha ln(1 + (e - 1) t). Spends evenly: earlier stops, a stricter last stage.
    POCOCK = "pocock"


def spent(fraction: float, alpha: float, spending: Spending = Spending.OBRIEN_FLEMING) -> float:
    """The share of the one-sided level `alpha` spent once `fraction` (0-1) of the documents is in: 0 at 0, alpha at 1,
    increasing between."""
    if fraction <= 0:
        return 0.0
    t = min(fraction, 1.0)
    if spending is Spending.POCOCK:
        return alpha * math.log1p((math.e - 1) * t)
    return 2 * _NORMAL.cdf(-_NORMAL.inv_cdf(1 - alpha / 2) / math.sqrt(t))


def stage_documents(total: int, fractions: Sequence[float]) -> tuple[int, ...]:
    """The documents scored by the end of each stage (cumulative): the stage's fraction of `total`, rounded up, at least
    one; stages that would add nothing are left out, and the last has every document."""
    return tuple(sorted({_count(total, f) for f in fractions if f > 0} | {total}))


def nominal_levels(
    fractions: Sequence[float], alpha: float, spending: Spending = Spending.OBRIEN_FLEMING
) -> tuple[float, ...]:
    """The one-sided level each stage's claim is tested at, stages at the information `fractions` (increasing, the last
    1): the levels whose boundaries c_k make P(Z_1 < c_1, ..., Z_(k-1) < c_(k-1), Z_k >= c_k) = spent(t_k) -
    spent(t_(k-1)) at the null, where Z_k is the z statistic of the first t_k of the information (a Brownian motion
    scaled by sqrt(t_k): corr(Z_j, Z_k) = sqrt(t_j / t_k)). The first is spent(t_1) itself; later ones are a little
    above their increment of the level, as paths that crossed earlier stopped there."""
    times = [float(t) for t in fractions]
    if not times or any(b <= a for a, b in zip(times, times[1:])) or times[0] <= 0 or abs(times[-1] - 1) > 1e-12:
        raise ValueError(f"information fractions must increase from above 0 to 1, got {list(fractions)}")
    levels: list[float] = []
    grid = density = None  # the sub-density of the z statistic on the paths still running, on its grid
    previous = 0.0
    for t in times:
        target = spent(t, alpha, spending) - spent(previous, alpha, spending)
        if grid is None or density is None:
            boundary = _HIGH if target <= 0 else -_NORMAL.inv_cdf(target)
            grid = np.linspace(_LOW, min(boundary, _HIGH), _POINTS)
            density = np.exp(-(grid**2) / 2) / math.sqrt(2 * math.pi)
        else:
            boundary, grid, density = _next_stage(
                grid, density, math.sqrt(previous / t), math.sqrt(1 - previous / t), target
            )
        levels.append(_upper_tail(boundary) if boundary < _HIGH else 0.0)
        previous = t
    return tuple(levels)


def _next_stage(
    grid: np.ndarray, density: np.ndarray, shrink: float, spread: float, target: float
) -> tuple[float, np.ndarray, np.ndarray]:
    """From the running paths' sub-density at one stage to the next: the boundary at which `target` of the probability
    exits there, and the sub-density below it. Given Z_k = z, Z_(k+1) is normal with mean z * shrink (sqrt(t_k /
    t_(k+1))) and sd `spread` (sqrt(1 - t_k / t_(k+1)))."""
    from scipy import optimize, special

    weights = np.full(grid.size, grid[1] - grid[0])
    weights[[0, -1]] /= 2  # the trapezoid rule
    mass = weights * density

    def exits(boundary: float) -> float:
        return float(mass @ special.ndtr((grid * shrink - boundary) / spread))

    if target <= 0 or exits(_HIGH) >= target:
        boundary = _HIGH
    else:
        boundary = optimize.brentq(lambda c: exits(c) - target, _LOW, _HIGH, xtol=1e-12)
    below = np.linspace(_LOW, boundary, _POINTS)
    kernel = np.exp(-(((below[:, None] - grid[None, :] * shrink) / spread) ** 2) / 2) / (
        spread * math.sqrt(2 * math.pi)
    )
    return boundary, below, kernel @ mass


def _upper_tail(z: float) -> float:
    from scipy import special

    return float(special.ndtr(-z))


@dataclass(frozen=True)
class Design:
    """The stages of one task (or of the leaf tasks of a group): each leaf's documents in the order they are scored,
    how many of them each stage has scored by its end, and the nominal one-sided level of its claims."""

    orders: Mapping[str, Sequence[int]]  # leaf task -> its document ids in the shared order (`document_order`)
    documents: tuple[Mapping[str, int], ...]  # per stage: leaf task -> documents scored by its end
    levels: tuple[float, ...]  # per stage
    alpha: float  # the one-sided level of the whole design

    @property
    def stages(self) -> int:
        return len(self.levels)

    @property
    def total(self) -> int:
        return sum(len(order) for order in self.orders.values())

    def used(self, stage: int) -> int:
        return sum(self.documents[stage].values())

    def samples(self, stage: int) -> dict[str, list[int]]:
        """Leaf task -> the documents scored by the end of `stage`: lm-eval's `samples`."""
        return {task: sorted(self.orders[task][:count]) for task, count in self.documents[stage].items()}

    def share(self, stage: int) -> float:
        """The stage's nominal level as a share of the design's: what the final verdict scales its levels by."""
        return self.levels[stage] / self.alpha


def design(
    orders: Mapping[str, Sequence[int]],
    fractions: Sequence[float],
    alpha: float,
    spending: Spending = Spending.OBRIEN_FLEMING,
) -> Design:
    """The stages of a task whose leaves have the documents of `orders`, each stage at `fractions` of every leaf's
    documents (`stage_documents`; the last stage every document), with the nominal levels of `spending` at `alpha`.
    A stage's information fraction is its share of all the documents."""
    if not orders or min(len(order) for order in orders.values()) < 1:
        raise ValueError(f"every leaf task needs documents, got {sorted(orders)}")
    stages = sorted({f for f in fractions if 0 < f < 1} | {1.0})
    counts = [{task: _count(len(order), f) for task, order in orders.items()} for f in stages]
    unique = [stage for i, stage in enumerate(counts) if i == 0 or stage != counts[i - 1]]
    total = sum(len(order) for order in orders.values())
    times = [sum(stage.values()) / total for stage in unique]
    return Design(dict(orders), tuple(unique), nominal_levels(times, alpha, spending), alpha)


def _count(total: int, fraction: float) -> int:
    # The share rounded up, at least one document; the tolerance keeps 0.3 * 10 at 3 where floats make it 3.0000000004.
    return min(total, max(1, math.ceil(fraction * total - 1e-9)))


def document_order(documents: Sequence[int], seed: int, task: str) -> list[int]:
    """`documents` (a task's ids) in the fixed random order every variant scores them in: seeded by the recipe's
    `seed` and the task's name (one task's order does not move when another is added), independent of the
    variant, of the process and of Python's hash seed."""
    digest = hashlib.sha256(f"{seed}\0{task}".encode()).digest()
    generator = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    ordered = sorted(documents)
    return [ordered[i] for i in generator.permutation(len(ordered))]


def judge(
    rule: DropRule, comparison: PairedComparison, alpha: float, over_alpha: float, power: float = 0.8
) -> NonInferiority:
    """One drop check on a stage's paired comparison, as the final verdict judges its logged figures
    (`quantlab.decision`): 0/1 scores of one pool of documents on the bounds from their flips, others on the paired
    standard error (Student's t where it has degrees of freedom), "shown within" at `alpha`, "shown over" at
    `over_alpha`."""
    limit = rule.allowed or 0.0
    if comparison.correct_to_wrong is not None and comparison.wrong_to_correct is not None:
        higher_is_better = rule.spec.higher_is_better is not False
        return paired_binary_non_inferiority(
            comparison.n,
            comparison.correct_to_wrong,
            comparison.wrong_to_correct,
            limit,
            higher_is_better=higher_is_better,
            alpha=alpha,
            over_alpha=over_alpha,
            power=power,
        )
    drop = -comparison.diff if rule.spec.higher_is_better else comparison.diff
    return non_inferiority(
        drop, comparison.se, comparison.n, limit, alpha=alpha, over_alpha=over_alpha, df=comparison.df, power=power
    )


class StopReason(str, Enum):
    """Why a variant's task stopped where it did."""

    WITHIN = "every drop limit on it shown within"
    OVER = "a drop limit on it shown over"
    REJECTED = "the variant already fails a limit of the policy"  # with the limit after a colon
    LAST = "all documents: no earlier stage settled it"
    UNCHECKED = "all documents: no drop limit of the policy applies to its scores"
    NOT_ADAPTIVE = "all documents: scored in full"  # with the reason after a colon (few-shot prompts, ...)


def stop_after(outcomes: Sequence[Outcome], last: bool) -> StopReason | None:
    """Whether a stage whose drop checks came out as `outcomes` ends the task: a check shown over ends it (the variant
    is rejected whatever the others show), every check shown within ends it; otherwise only the `last` stage does."""
    if any(outcome is Outcome.OVER for outcome in outcomes):
        return StopReason.OVER
    if outcomes and all(outcome is Outcome.WITHIN for outcome in outcomes):
        return StopReason.WITHIN
    return StopReason.LAST if last else None


@dataclass(frozen=True)
class StageResult:
    """Where a variant's task stopped."""

    task: str
    stage: int  # 0-based, of `stages`
    stages: int
    documents_used: int
    documents_total: int
    level: float  # the nominal one-sided level of the stage it stopped at
    level_share: float  # that level as a share of the design's: the final verdict's levels are scaled by it
    reason: StopReason
    detail: str = ""  # NOT_ADAPTIVE: why

    @property
    def sequential(self) -> bool:
        """Whether its drop checks were judged stage by stage (its verdict is then tested at `level`)."""
        return self.reason in (StopReason.WITHIN, StopReason.OVER, StopReason.REJECTED, StopReason.LAST)

    @property
    def words(self) -> str:
        stage = f"stage {self.stage + 1} of {self.stages}"
        reason = self.reason.value if not self.detail else f"{self.reason.value}: {self.detail}"
        return f"{reason} ({stage}, {self.documents_used:,} of {self.documents_total:,} documents)"


def stage_outcomes(
    rules: Sequence[DropRule],
    comparisons: Mapping[str, PairedComparison],
    level: float,
    family: int,
    power: float = 0.8,
) -> tuple[Outcome, ...]:
    """The stage's drop checks judged at its nominal `level`: "shown within" at the level, "shown over" at the level
    over the variant's `family` of drop checks (Bonferroni: below Holm's lowest level, so a claim made here stands in
    the final verdict whatever the other checks show). A rule without a comparison is unsettled."""
    if level <= 0:  # a stage the spending function gives nothing (a very early one): no claim can be made there
        return (Outcome.UNSURE,) * len(rules)
    over = level / max(family, 1)
    return tuple(
        judge(rule, comparisons[rule.metric], level, over, power).outcome
        if rule.metric in comparisons
        else Outcome.UNSURE
        for rule in rules
    )
