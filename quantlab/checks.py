"""Checks of a recipe against the world outside its file (files on disk, the model's config,
lm-eval's task index), before a sweep spends compute. `validate` runs them all."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from quantlab import cache
from quantlab.corpora import text_source_problem
from quantlab.errors import BadInput, Problem, did_you_mean
from quantlab.models import (
    hub_reachable,
    in_local_cache,
    linear_input_widths,
    materialized,
    resolve_source,
    source_problem,
    widths_identity,
)
from quantlab.quantize import METHODS
from quantlab.recipe import LoadedRecipe, parse_recipe, read_recipe, section

RECIPE_CHECKS_DIR = "recipe-checks"  # under the cache root: what `check_recipe` looked up


def missing_files(data: dict, base_dir: Path, shown: str) -> list[Problem]:
    """The model, texts and task directory the raw recipe names that are not on disk (no network)."""
    problems: list[Problem] = []
    checks = [
        ("model.source", section(data, "model").get("source"), source_problem),
        ("calibration.source", section(data, "calibration").get("source"), text_source_problem),
        ("quality.corpus", section(data, "quality").get("corpus"), text_source_problem),
    ]
    for field, value, check in checks:
        if isinstance(value, str) and (message := check(value, base_dir)) is not None:
            problems.append(Problem(shown, field, message))
    include = section(data, "evals").get("include_path")
    if isinstance(include, str) and not (base_dir / include).resolve().is_dir():
        problems.append(Problem(shown, "evals.include_path", f"no such directory: {(base_dir / include).resolve()}"))
    return problems


def check_recipe(loaded: LoadedRecipe, cache_root: Path | None = None, hub_optional: bool = False) -> LoadedRecipe:
    """The model's config (layer widths against each method's params) and lm-eval's task index. Raises BadInput.

    Both are slow to find out and fixed by content: with `cache_root`, what `remember_lookups` kept
    there is read instead, and the recipe comes back with what this check looked up. A hub model
    that this machine cannot reach (nor has cached) is bad input; with `hub_optional` (`quantlab
    validate`) what needs the hub is listed in `needs_hub` instead.
    """
    from quantlab.evaluate.lm_eval_runner import known_tasks, task_index_identity

    recipe, shown = loaded.recipe, str(loaded.path)
    remembered = cache_root / RECIPE_CHECKS_DIR if cache_root is not None else None
    lookups: list[tuple[dict[str, Any], Any]] = []

    def look_up(identity: dict[str, Any], find: Callable[[], Any]) -> Any:
        fact = cache.recall(remembered, identity) or find()
        lookups.append((identity, fact))
        return fact

    problems: list[Problem] = []
    needs_hub: list[str] = []
    try:
        source = resolve_source(recipe.model, loaded.path.parent)
        offline_hub_model = (
            source.kind == "hub"
            and cache.recall(remembered, widths_identity(source)) is None
            and not in_local_cache(source)
            and not hub_reachable()
        )
        if not offline_hub_model:
            config_from = materialized(source, cache_root) if cache_root is not None else source
            widths = look_up(widths_identity(source), lambda: linear_input_widths(config_from))
            for index, variant in enumerate(recipe.variants):
                for field, message in METHODS[variant.method].check_model(variant.params, widths):
                    problems.append(Problem(shown, f"variants[{index}] ({variant.name}).params.{field}", message))
        elif hub_optional:
            needs_hub.append(f"model.source: the config of {source.display} (layer widths against group sizes)")
        else:
            no_copy = "this machine cannot reach the hub, and the local Hugging Face cache has no copy"
            problems.append(Problem(shown, "model.source", f"{source.display} is a hub model, {no_copy}"))
    except BadInput as error:
        problems += [Problem(shown, "model.source", problem.message) for problem in error.problems]
    task_names = [task.name for task in recipe.evals.tasks]
    if task_names:
        include = loaded.include_path
        # The recipe's own task files first: lm-eval's whole index is needed only for names they lack
        # (a local name is known to it as well: include_path takes precedence over lm-eval's tasks).
        known = set(look_up(task_index_identity(include, False), lambda: sorted(known_tasks(include, False))))
        if not known.issuperset(task_names):
            known |= set(look_up(task_index_identity(include), lambda: sorted(known_tasks(include))))
        for index, name in enumerate(task_names):
            if name not in known:  # a close name among lm-eval's ~10k: a stricter cutoff than for a recipe's few
                message = f"lm-eval cannot resolve task '{name}'{did_you_mean(name, known, cutoff=0.75)}"
                problems.append(Problem(shown, f"evals.tasks[{index}].name", message))
    if hub_optional and task_names:
        local = _tasks_defined_under(loaded.include_path)
        if hub_tasks := [name for name in task_names if name not in local]:
            needs_hub.append(
                f"evals.tasks: the data of {', '.join(hub_tasks)} (lm-eval downloads it when a sweep runs, "
                "unless the Hugging Face datasets cache has it)"
            )
    if problems:
        raise BadInput(problems)
    return replace(loaded, lookups=tuple(lookups), needs_hub=tuple(needs_hub))


def _tasks_defined_under(include_path: Path | None) -> set[str]:
    """Task, group and tag names that the YAMLs under include_path define (their data is local or theirs)."""
    names: set[str] = set()
    for path in include_path.rglob("*.yaml") if include_path else ():
        # lm-eval's YAMLs use custom tags (!function); a plain line scan reads their names.
        with contextlib.suppress(OSError, UnicodeDecodeError):
            found = re.findall(r"^(?:task|group|tag):(.*\S)", path.read_text(encoding="utf-8"), re.MULTILINE)
            names.update(value.strip().strip("'\"") for value in found)
    return names


def remember_lookups(loaded: LoadedRecipe, cache_root: Path) -> None:
    """Keep what the check of a recipe looked up, for the next check; call it once work starts
    (so that bad input, or an unreachable tracking server, leaves nothing in the cache)."""
    for identity, fact in loaded.lookups:
        cache.remember(cache_root / RECIPE_CHECKS_DIR, identity, fact)


def validate(
    path: str | Path,
    cache_root: Path | None = None,
    hub_optional: bool = False,
    parsed: Callable[[LoadedRecipe], object] = lambda loaded: None,
) -> LoadedRecipe:
    """Everything a sweep needs to know before spending compute, in two passes that each report every
    problem: the file (its schema and the files it names), then `check_recipe`. Raises BadInput.
    `parsed` sees the file's recipe between the two (the sweep starts its variants' imports there)."""
    text, data = read_recipe(path)
    loaded = parse_recipe(path, text, data, missing_files(data, Path(path).resolve().parent, str(Path(path))))
    parsed(loaded)
    return check_recipe(loaded, cache_root, hub_optional)
