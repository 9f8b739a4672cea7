"""Errors that the CLI turns into exit codes; nothing here prints."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the user's input, located by file and field."""

    file: str
    field: str
    message: str

    def __str__(self) -> str:
        return ": ".join(part for part in (self.file, self.field, self.message) if part)


@dataclass(eq=False)  # eq=False: an exception stays hashable, compared by identity
class BadInput(Exception):
    """Input that no amount of compute would fix (exit 2). Carries every problem found at once; its text is one
    line per problem. (Its `args` are `(problems,)`, so a pickled copy rebuilds itself.)"""

    problems: list[Problem]

    def __str__(self) -> str:
        return "\n".join(str(problem) for problem in self.problems)


def bad_input(file: str, field: str, message: str) -> BadInput:
    return BadInput([Problem(file, field, message)])


def did_you_mean(word: str, choices: Iterable[str], cutoff: float = 0.6) -> str:
    """ " (did you mean 'x'?)" for the closest choice, or "" when none is close."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=cutoff)
    return f" (did you mean '{close[0]}'?)" if close else ""


def first_line(error: BaseException, limit: int = 300) -> str:
    """An error's first line, for a one-line message (MLflow's and requests' errors span many)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]
