"""Checks of a recipe against the world outside its file (files on disk, the model's config,
lm-eval's task index), before a sweep spends compute. `validate` runs them all."""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from quantlab import cache
from quantlab.corpora import text_source_problem
from quantlab.errors import BadInput, Problem, did_you_mean
from quantlab.metrics import EvalKey
from quantlab.models import (
    compute_dtype_name,
    hub_reachable,
    in_local_cache,
    linear_input_widths,
    materialized,
    module_classes,
    module_classes_identity,
    resolve_source,
    source_problem,
    widths_identity,
)
from quantlab.quantize import METHODS
from quantlab.recipe import LoadedRecipe, Recipe, parse_recipe, read_recipe, section
from quantlab.serving.environments import (
    EngineMissing,
    chosen_engine,
    engine_python,
    python_problem,
    serving_device,
)
from quantlab.serving.load import PROMPT_FILE_SUFFIXES

RECIPE_CHECKS_DIR = "recipe-checks"  # under the cache root: what `check_recipe` looked up
# Every quantizing method targets the Linear layers (quantlab/quantize: targets "Linear"): a pattern of
# `params.ignore` keeps something in BF16 only where it matches a module of this class.
QUANTIZED_CLASS = "Linear"


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


def check_recipe(
    loaded: LoadedRecipe, cache_root: Path | None = None, hub_optional: bool = False, nodes_install_engine: bool = False
) -> LoadedRecipe:
    """The model's config (layer widths and module names against each method's params) and lm-eval's task index.
    Raises BadInput. `nodes_install_engine`: the variants run on cluster nodes, each of which installs the serving
    engine it lacks (--executor ray), so that this machine need not have it.

    Both are slow to find out and fixed by content: with `cache_root`, what `remember_lookups` kept
    there is read instead, and the recipe comes back with what this check looked up. A hub model
    that this machine cannot reach (nor has cached) is bad input; with `hub_optional` (`quantlab
    validate`) what needs the hub is listed in `needs_hub` instead.
    """
    from quantlab.evaluate.lm_eval_runner import known_tasks, names_scored, repeat_problem, task_index_identity

    recipe, shown = loaded.recipe, str(loaded.path)
    remembered = cache_root / RECIPE_CHECKS_DIR if cache_root is not None else None
    lookups: list[tuple[dict[str, Any], Any]] = []

    def look_up(identity: dict[str, Any], find: Callable[[], Any]) -> Any:
        fact = cache.recall(remembered, identity) or find()
        lookups.append((identity, fact))
        return fact

    problems: list[Problem] = []
    needs_hub: list[str] = []
    # Only the patterns a recipe writes are checked: the default (["lm_head"]) is llm-compressor's own convention,
    # which it skips where a model has no such module, and an error in a field the recipe never wrote would puzzle.
    ignores = {
        index: list(variant.params.ignore)
        for index, variant in enumerate(recipe.variants)
        if "ignore" in variant.params.model_fields_set
    }
    try:
        source = resolve_source(recipe.model, loaded.path.parent)
        facts = [widths_identity(source)] + ([module_classes_identity(source)] if ignores else [])
        offline_hub_model = (
            source.kind == "hub"
            and any(cache.recall(remembered, identity) is None for identity in facts)
            and not in_local_cache(source)
            and not hub_reachable()
        )
        if not offline_hub_model:
            config_from = materialized(source, cache_root) if cache_root is not None else source
            widths = look_up(widths_identity(source), lambda: linear_input_widths(config_from))
            modules = look_up(module_classes_identity(source), lambda: module_classes(config_from)) if ignores else {}
            for index, variant in enumerate(recipe.variants):
                found = [
                    *METHODS[variant.method].check_model(variant.params, widths),
                    *(ignore_problems(ignores[index], modules) if index in ignores else []),
                ]
                for field, message in found:
                    problems.append(Problem(shown, f"variants[{index}] ({variant.name}).params.{field}", message))
        elif hub_optional:
            checked = "layer widths against group sizes" + (", module names against params.ignore" if ignores else "")
            needs_hub.append(f"model.source: the config of {source.display} ({checked})")
        else:
            no_copy = "this machine cannot reach the hub, and the local Hugging Face cache has no copy"
            problems.append(Problem(shown, "model.source", f"{source.display} is a hub model, {no_copy}"))
    except BadInput as error:
        problems += [Problem(shown, "model.source", problem.message) for problem in error.problems]
    task_names = [task.name for task in recipe.evals.tasks]
    unresolved = False
    if task_names:
        include = loaded.include_path
        # The recipe's own task files first: lm-eval's whole index is needed only for names they lack
        # (a local name is known to it as well: include_path takes precedence over lm-eval's tasks).
        known = set(look_up(task_index_identity(include, False), lambda: sorted(known_tasks(include, False))))
        if not known.issuperset(task_names):
            known |= set(look_up(task_index_identity(include), lambda: sorted(known_tasks(include))))
        for index, name in enumerate(task_names):
            if name not in known:  # a close name among lm-eval's ~10k: a stricter cutoff than for a recipe's few
                unresolved = True
                message = f"lm-eval cannot resolve task '{name}'{did_you_mean(name, known, cutoff=0.75)}"
                problems.append(Problem(shown, f"evals.tasks[{index}].name", message))
            elif (task := recipe.evals.tasks[index]).repeats > 1 and (
                why := repeat_problem(name, task.gen_kwargs and task.gen_kwargs.model_dump(exclude_none=True), include)
            ):
                problems.append(Problem(shown, f"evals.tasks[{index}] ({name}).repeats", why))
            elif task.repeats > 1 and recipe.evals.adaptive:  # its stages would pair part of each repeat's documents
                why = "a task in repeats scores every document: run it with evals.adaptive false, or with repeats 1"
                problems.append(Problem(shown, f"evals.tasks[{index}] ({name}).repeats", why))

    def scored() -> set[str]:
        identity = task_index_identity(loaded.include_path) | {"scored_under": sorted(task_names)}
        return set(look_up(identity, lambda: sorted(names_scored(task_names, loaded.include_path))))

    if not unresolved:  # with a task lm-eval cannot resolve, nothing says what the recipe scores
        problems += unscored_limits(recipe, shown, scored)
    if hub_optional and task_names:
        local = _tasks_defined_under(loaded.include_path)
        if hub_tasks := [name for name in task_names if name not in local]:
            needs_hub.append(
                f"evals.tasks: the data of {', '.join(hub_tasks)} (lm-eval downloads it when a sweep runs, "
                "unless the Hugging Face datasets cache has it)"
            )
    root = cache_root or cache.default_root()
    problems += serving_problems(recipe, loaded.path.parent, shown, root, nodes_install_engine)
    if problems:
        raise BadInput(problems)
    return replace(loaded, lookups=tuple(lookups), needs_hub=tuple(needs_hub))


def unscored_limits(recipe: Recipe, shown: str, scored: Callable[[], set[str]]) -> list[Problem]:
    """A drop limit on an lm-eval score of a task the recipe never scores: the sweep would run whole, then every
    variant would fail the policy for a metric nobody logged. `scored`: the requested tasks and every task and group
    below them (lm-eval's group tree), asked for only when a limit names a task that is not itself requested."""
    requested = [task.name for task in recipe.evals.tasks]
    named = {key: parsed.task for key in recipe.frontier.default_policy.max_drop if (parsed := EvalKey.parse(key))}
    elsewhere = {key: task for key, task in named.items() if task not in requested}
    known = scored() if elsewhere and requested else set()
    listed = f"{', '.join(requested)}, and the tasks below them" if requested else "none"
    return [
        Problem(
            shown,
            f"frontier.default_policy.max_drop.{key}",
            f"the recipe scores no task '{task}' (evals.tasks: {listed})" + did_you_mean(task, known),
        )
        for key, task in elsewhere.items()
        if task not in known
    ]


def serving_problems(
    recipe: Recipe, base_dir: Path, shown: str, cache_root: Path, nodes_install_engine: bool = False
) -> list[Problem]:
    """What stops the stages that need a server on this machine: its engine's environment (unless the nodes that run
    the variants install it) or guidellm missing, a variant's format the engine cannot serve here, a served
    evaluation on an engine that cannot score prompts, a prompts file absent."""
    settings = recipe.serving
    if not recipe.needs_server:
        return []
    # A recipe for a GPU checked where none is (validate's offline check of the GPU recipe) is checked as for the
    # GPU, but the engine's environment is that machine's to have, as the hub is: it is not looked for here.
    device, elsewhere = serving_device(recipe.runtime.device)
    engine = chosen_engine(settings, device, cache_root)
    problems = []
    try:
        python = None if elsewhere else engine_python(engine, settings.python, cache_root, device)
    except EngineMissing as missing:
        if not nodes_install_engine:
            problems.append(Problem(shown, "serving.engine", str(missing)))
    else:
        if python is not None and (problem := python_problem(engine, python)) is not None:
            problems.append(Problem(shown, "serving.python", problem))
    for name in settings.plugins:
        plugin = engine.plugins.get(name)
        if plugin is None:
            message = (
                f"{name} is no plugin of {engine.label}, the engine serving here (serving.engine: {settings.engine})"
            )
            problems.append(Problem(shown, "serving.plugins", message))
        elif device not in plugin.devices:
            message = f"{name} applies to {engine.label} on {', '.join(plugin.devices)}, not {device}"
            problems.append(Problem(shown, "serving.plugins", message))
    for index, variant in enumerate(recipe.variants):
        stored = METHODS[variant.method].stored_format
        if engine.supports(stored, device) is None:
            what = f"{stored} checkpoints" if stored else "this model"
            why = engine.why_not(stored, device)
            message = f"variant {variant.name}: {engine.label} cannot serve {what} on {device}" + (
                f": {why}" if why else ""
            )
            problems.append(Problem(shown, "serving.engine", message))
        if variant.kv_cache is not None and (why := engine.kv_cache_problem(variant.kv_cache.format, device)):
            problems.append(Problem(shown, f"variants[{index}] ({variant.name}).kv_cache", why))
        group_size = getattr(variant.params, "group_size", None)
        if group_size is not None and (why := engine.group_size_problem(stored, device, group_size)):
            problems.append(Problem(shown, f"variants[{index}] ({variant.name}).params.group_size", why))
        if why := engine.dtype_problem(stored, device, lambda: compute_dtype_name(recipe.runtime, device)):
            auto = recipe.runtime.dtype == "auto" and device == "cpu"
            default = " (this CPU's default: it has no BF16 matmul instructions)" if auto else ""
            message = f"variant {variant.name}: {why}{default}; set runtime.dtype: bfloat16, or leave it out"
            problems.append(Problem(shown, "runtime.dtype", message))
    if recipe.evals.engine != "reference" and not engine.scores_prompts:
        message = (
            f"{recipe.evals.engine} scoring goes through the server, and {engine.label} returns no prompt "
            "log-probabilities: set serving.engine: vllm (or evals.engine: reference)"
        )
        problems.append(Problem(shown, "evals.engine", message))
    if settings.enabled and importlib.util.find_spec("guidellm") is None:
        problems.append(Problem(shown, "serving", "guidellm is not installed: pip install guidellm==0.8.1"))
    if settings.prompts is not None:
        path = (base_dir / settings.prompts).resolve()
        if path.suffix.lower() not in PROMPT_FILE_SUFFIXES:
            kinds = ", ".join(PROMPT_FILE_SUFFIXES)
            problems.append(Problem(shown, "serving.prompts", f"{path.name}: not a prompts file ({kinds})"))
        elif not path.is_file():
            problems.append(Problem(shown, "serving.prompts", f"no such file: {path}"))
    return problems


def ignore_problems(patterns: Sequence[str], modules: Mapping[str, Sequence[str]]) -> list[tuple[str, str]]:
    """(param field, message) for each pattern of a variant's `ignore` that keeps no Linear layer in BF16 (it
    matches nothing, or only modules that are not quantized), or is no valid regular expression; and one for the
    whole list when it keeps every Linear layer (the variant would quantize nothing). `modules` is
    `models.module_classes`: each module's name -> its class names."""
    quantized = [name for name, classes in modules.items() if QUANTIZED_CLASS in classes]
    found: list[tuple[str, str]] = []
    kept: set[str] = set()
    for j, pattern in enumerate(patterns):
        try:
            matched = matching_modules(pattern, modules)
        except re.error as error:
            found.append((f"ignore[{j}]", f"'{pattern}' is not a valid regular expression ({error})"))
            continue
        if linear := [name for name in matched if QUANTIZED_CLASS in modules[name]]:
            kept.update(linear)
            continue
        found.append((f"ignore[{j}]", _keeps_nothing(pattern, matched, modules, quantized)))
    if quantized and kept.issuperset(quantized):
        found.append(("ignore", "keeps every Linear layer in BF16: the variant would quantize nothing (use bf16)"))
    return found


def matching_modules(pattern: str, modules: Mapping[str, Sequence[str]]) -> list[str]:
    """The modules that llm-compressor's `ignore` matches with `pattern`, as compressed-tensors' `is_match` does:
    a module whose name matches (its own `match_name`: equal, or for `re:` Python's re.match, anchored at the
    name's start) or one of whose classes (its MRO) is named `pattern`. Raises re.error for a bad `re:`."""
    from compressed_tensors.utils.match import match_name

    return [name for name, classes in modules.items() if match_name(name, pattern) or pattern in classes]


def _keeps_nothing(pattern: str, matched: list[str], modules: Mapping[str, Sequence[str]], quantized: list[str]) -> str:
    """Why `pattern` keeps no Linear layer, with what it probably meant."""
    if matched:  # a block or an attention / MLP module: each Linear layer is matched by its own name
        first = matched[0]
        shown = f"'{first}' ({modules[first][0]})" + (f" and {len(matched) - 1} more" if len(matched) > 1 else "")
        return (
            f"'{pattern}' matches no Linear layer, only {shown}: a layer is kept in BF16 by its own name, "
            f"so keep everything under '{first}' with 're:{re.escape(first)}\\..*'"
        )
    if pattern.startswith("re:"):
        body = pattern.removeprefix("re:")
        inside = next((name for name in quantized if re.search(body, name)), None)
        if inside is not None:  # the usual slip: re.match anchors at the start, so 'layers\.0' misses 'model.layers.0'
            return (
                f"'{pattern}' matches no module name from its start (compressed-tensors uses re.match), though it "
                f"is found inside '{inside}': did you mean 're:.*{body}'?"
            )
        # The regex's literal text (escapes and wildcards dropped) against the names.
        word = re.sub(r"\\(.)", r"\1", re.sub(r"\.\*|\.\+|[\^$()?+*]", "", body))
        return f"'{pattern}' matches no module of the model{_closest(word, modules)}"
    return f"'{pattern}' matches no module of the model{_closest(pattern, modules)}"


def _closest(word: str, modules: Mapping[str, Sequence[str]]) -> str:
    """ " (closest: 'a', 'b', 'c')" among the module and class names, or an example of the names."""
    choices = sorted({*modules, *(cls for classes in modules.values() for cls in classes)} - {""})
    close = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    if close:
        return f" (closest: {', '.join(repr(name) for name in close)})"
    linear = [name for name, classes in modules.items() if QUANTIZED_CLASS in classes]
    return f" (its Linear layers are named like {', '.join(repr(name) for name in linear[:1] + linear[-1:])})"


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
    nodes_install_engine: bool = False,
) -> LoadedRecipe:
    """Everything a sweep needs to know before spending compute, in two passes that each report every
    problem: the file (its schema and the files it names), then `check_recipe`. Raises BadInput.
    `parsed` sees the file's recipe between the two (the sweep starts its variants' imports there);
    `nodes_install_engine`: see `check_recipe`."""
    text, data = read_recipe(path)
    loaded = parse_recipe(path, text, data, missing_files(data, Path(path).resolve().parent, str(Path(path))))
    parsed(loaded)
    return check_recipe(loaded, cache_root, hub_optional, nodes_install_engine)
