"""The files through which LoadGenerator hands guidellm's runner its scenarios, one after another (standard library
only: the runner's fork server re-imports what the runner imports)."""

from __future__ import annotations

from pathlib import Path


def scenario_file(prefix: Path, number: int) -> Path:
    """The `number`th scenario (from 1), written whole (renamed into place)."""
    return prefix.with_name(f"{prefix.name}-{number}.json")


def exit_file(prefix: Path, number: int) -> Path:
    """guidellm's exit code for the `number`th scenario, written whole once it has run."""
    return prefix.with_name(f"{prefix.name}-{number}.exit")


def end_file(prefix: Path) -> Path:
    """Once it exists the runner runs no more scenarios, stops its fork server and exits."""
    return prefix.with_name(f"{prefix.name}.end")


def write_whole(path: Path, text: str) -> None:
    staged = path.with_name(path.name + ".partial")
    staged.write_text(text)
    staged.rename(path)
