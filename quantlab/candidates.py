"""The error rate of the choice among several candidates (pure).

Each candidate is shown within its drop limits at the policy's one-sided level. With K candidates truly at their
limits, shipping the cheapest one shown within would ship a variant over its limits up to K times as often, so the
family of candidates is controlled as the policy says (`quantlab.policy.CandidateControl`): a fixed sequence (each
at the full level, in a declared order, stopping at the first not shown within: the first one tested must be shown
within for anything to ship, so the rate stays the level) or Bonferroni (each at level / K).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from quantlab.policy import CandidateControl


class SequenceError(ValueError):
    """A declared sequence that names no candidate of the sweep."""


@dataclass(frozen=True)
class ChoiceControl:
    """How the candidates were tested, and what that makes the error rate of the choice."""

    method: CandidateControl
    order: tuple[str, ...]  # the candidates: for a fixed sequence, in the order tested
    alpha: float  # the policy's one-sided level
    has_drop_limits: bool = True  # without any, no claim is statistical: there is no error rate to state
    stopped_at: str | None = None  # fixed sequence: the first candidate not shown within every drop limit

    @property
    def candidate_alpha(self) -> float:
        """The one-sided level each candidate's claims are tested at."""
        if self.method is CandidateControl.BONFERRONI and len(self.order) > 1:
            return self.alpha / len(self.order)
        return self.alpha

    @property
    def untested(self) -> tuple[str, ...]:
        """Candidates after the one the fixed sequence stopped at: none of them can be shipped."""
        if self.stopped_at is None:
            return ()
        return self.order[self.order.index(self.stopped_at) + 1 :]

    @property
    def error_rate(self) -> float | None:
        """The most the chance of shipping a variant truly over a drop limit can be (None: no drop limits)."""
        if not self.has_drop_limits:
            return None
        if self.method is CandidateControl.NONE:
            return min(1.0, self.alpha * max(len(self.order), 1))
        return self.alpha

    @property
    def words(self) -> str:
        """The error rate of the recommendation, and why, in a sentence."""
        k, level = len(self.order), _percent(self.alpha)
        if not self.has_drop_limits:
            return "No drop limits: the choice rests on logged figures alone, with no error rate to state."
        if k == 0:
            return "No candidate besides the baseline."
        head = "The chance of shipping a variant truly over a drop limit is"
        if k == 1:
            return f"{head} at most {level}: one candidate, tested at {level}."
        if self.method is CandidateControl.BONFERRONI:
            return (
                f"{head} at most {level}: each of the {k} candidates tested at {level} / {k} = "
                f"{_percent(self.candidate_alpha)} (Bonferroni)."
            )
        if self.method is CandidateControl.NONE:
            return (
                f"{head} up to {_percent(self.error_rate or 0.0)}: {k} candidates, each tested at {level} with no "
                "correction for their number (policy candidates: none)."
            )
        text = (
            f"{head} at most {level}: the {k} candidates tested in a fixed sequence ({', '.join(self.order)}), "
            f"each at {level}, stopping at the first not shown within every drop limit"
        )
        if self.untested:
            text += f"; it stopped at {self.stopped_at}, so {', '.join(self.untested)} could not be shipped"
        return text + "."

    @property
    def brief(self) -> str:
        """'at most 2.5% (fixed sequence of 3 candidates)'; "" where there is no rate to state."""
        rate, k = self.error_rate, len(self.order)
        if rate is None or k == 0:
            return ""
        if k == 1:
            return f"at most {_percent(rate)} (one candidate)"
        how = {
            CandidateControl.FIXED_SEQUENCE: f"fixed sequence of {k} candidates",
            CandidateControl.BONFERRONI: f"Bonferroni over {k} candidates",
            CandidateControl.NONE: f"{k} candidates, uncorrected",
        }[self.method]
        return f"{'up to' if self.method is CandidateControl.NONE else 'at most'} {_percent(rate)} ({how})"

    def untested_reason(self, name: str) -> str:
        return (
            f"not tested: the fixed sequence of candidates stopped at {self.stopped_at}, which is not shown within "
            f"every drop limit (policy candidates: fixed_sequence; a later candidate shipped would not keep the "
            f"choice's error rate at {_percent(self.alpha)})"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "method": self.method.value,
            "order": list(self.order),
            "alpha": self.alpha,
            "candidate_alpha": self.candidate_alpha,
            "stopped_at": self.stopped_at,
            "untested": list(self.untested),
            "error_rate": self.error_rate,
            "words": self.words,
        }


def _percent(value: float) -> str:
    return f"{100 * value:.3g}%"


def sequence_order(
    objective_values: Mapping[str, float | None], declared: Sequence[str], higher_is_better: bool
) -> tuple[str, ...]:
    """The candidates in the order a fixed sequence tests them: those `declared` first, as declared, then the rest
    by the objective, the value it rates worst first (the least compressed, as a rule: the likeliest to hold),
    those without one last, by name. The order uses no quality figure, which keeps the sequence's error rate."""
    unknown = [name for name in declared if name not in objective_values]
    if unknown:
        names = ", ".join(sorted(objective_values)) or "none"
        raise SequenceError(f"sequence names {', '.join(unknown)}, not among the candidates ({names})")
    rest = [name for name in objective_values if name not in declared]

    def worst_first(name: str) -> tuple[bool, float, str]:
        value = objective_values[name]
        if value is None or not math.isfinite(value):
            return True, 0.0, name
        return False, value if higher_is_better else -value, name

    return (*dict.fromkeys(declared), *sorted(rest, key=worst_first))


def control_choice(
    method: CandidateControl,
    order: Sequence[str],
    shown_within: Mapping[str, bool],
    alpha: float,
    has_drop_limits: bool = True,
) -> ChoiceControl:
    """The family's control once each candidate was judged: `shown_within` says whether all of a candidate's drop
    limits were shown within (at `ChoiceControl.candidate_alpha`). A fixed sequence stops at the first that was not."""
    stopped = None
    if method is CandidateControl.FIXED_SEQUENCE and has_drop_limits:
        stopped = next((name for name in order if not shown_within.get(name, False)), None)
    return ChoiceControl(method, tuple(order), alpha, has_drop_limits, stopped)
