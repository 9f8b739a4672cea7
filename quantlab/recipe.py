"""The recipe: what to sweep. Pydantic models (unknown keys rejected) and the loader.

Loading happens in two passes, and both collect every problem before reporting:
1. `load_recipe` parses the YAML and checks structure and everything knowable from the file
   alone (names, references between fields, method parameters, files next to the recipe).
2. `check_recipe` looks outside the file: the model's config (layer widths against group
   sizes) and lm-eval's task index. A sweep runs both before any work.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from quantlab.errors import BadInput, Problem
from quantlab.frontier import FrontierSettings
from quantlab.measure.settings import MeasureSettings

# A name becomes a directory and an MLflow tag: no separators, cannot be "." or "..".
SafeName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(StrictModel):
    source: str = Field(
        description="Hub id (org/name), local checkpoint directory, a .gguf file, "
        "or pkg://<python package>/<file> for a file a package ships."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    trust_remote_code: bool = Field(
        False, description="Run the model repository's own Python code. Off unless you opt in."
    )


class VariantSpec(StrictModel):
    name: SafeName
    method: str
    params: dict[str, Any] = Field(default_factory=dict)


class CalibrationSettings(StrictModel):
    source: str = Field(
        "builtin:pydoc-calibration",
        description="builtin:pydoc-calibration (offline, disjoint from every bundled eval text), "
        "a .txt/.jsonl file (relative to the recipe), or hf:<dataset>:<split>:<text field>.",
    )
    num_samples: int = Field(32, gt=0, le=100_000)
    seq_len: int = Field(256, gt=0, le=1_000_000)
    seed: int = 0


class GenKwargs(BaseModel):
    """lm-eval generation settings: the common ones checked here, any other passed to the model as is."""

    model_config = ConfigDict(extra="allow", frozen=True)

    max_gen_toks: int | None = Field(None, gt=0)
    until: list[str] | str | None = None
    do_sample: bool | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, gt=0)


class EvalTaskSpec(StrictModel):
    """One lm-eval task, group or tag. Unset settings are the task YAML's own (as with lm-eval's CLI)."""

    name: str = Field(min_length=1)
    num_fewshot: int | None = Field(None, ge=0, le=100, description="Shots; unset = the task YAML's num_fewshot.")
    limit: int | None = Field(None, gt=0, description="Score only the first N documents of each leaf task.")
    gen_kwargs: GenKwargs | None = Field(
        None, description="Generation settings merged over the YAML's (e.g. max_gen_toks); generation tasks only."
    )
    apply_chat_template: bool | str = Field(False, description="true, or the name of one of the tokenizer's chat templates.")
    fewshot_as_multiturn: bool | None = Field(
        None, description="Few-shot examples as chat turns; unset = on with a chat template. Needs apply_chat_template."
    )
    system_instruction: str | None = None


class EvalSettings(StrictModel):
    include_path: str | None = Field(
        None, description="Directory of extra lm-eval task YAMLs, relative to the recipe."
    )
    tasks: list[EvalTaskSpec] = Field(default_factory=list)
    batch_size: int = Field(8, gt=0, le=4096)


class QualitySettings(StrictModel):
    """Token-level damage against the baseline: perplexity and KL over a text corpus."""

    enabled: bool = True
    corpus: str = Field(
        "builtin:pydoc-perplexity",
        description="builtin:pydoc-perplexity (CPython's language reference, disjoint from the "
        "calibration text), a .txt/.jsonl file (relative to the recipe), or hf:<dataset>:<split>:<field>.",
    )
    max_tokens: int = Field(1024, gt=0, le=10_000_000)
    window: int = Field(256, gt=1, le=1_000_000)
    stride: int | None = Field(None, gt=0, description="Defaults to window (non-overlapping windows).")


class RuntimeSettings(StrictModel):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Compute dtype; auto = bfloat16 on CUDA, float32 on CPU."
    )
    cpus: float = Field(1, gt=0, le=1024, description="CPUs each variant asks of the Ray scheduler.")
    gpus: float = Field(0, ge=0, le=64, description="GPUs each variant asks of the Ray scheduler.")


class Recipe(StrictModel):
    name: SafeName
    model: ModelSpec
    baseline: str
    variants: list[VariantSpec] = Field(min_length=1)
    calibration: CalibrationSettings = Field(default_factory=CalibrationSettings)
    evals: EvalSettings = Field(default_factory=EvalSettings)
    quality: QualitySettings = Field(default_factory=QualitySettings)
    measure: MeasureSettings = Field(default_factory=MeasureSettings)
    frontier: FrontierSettings = Field(default_factory=FrontierSettings)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)

    def variant(self, name: str) -> VariantSpec:
        return next(variant for variant in self.variants if variant.name == name)


RECIPE_CHECKS_DIR = "recipe-checks"  # under the cache root: what `check_recipe` looked up


@dataclass(frozen=True)
class Lookup:
    """Something `check_recipe` found outside the file, slow to find and fixed by `identity`."""

    identity: dict[str, Any]
    fact: Any


@dataclass(frozen=True)
class LoadedRecipe:
    """A recipe with where it came from: relative paths in it are relative to `path`."""

    path: Path
    recipe: Recipe
    text: str
    lookups: tuple[Lookup, ...] = ()  # filled by check_recipe; see remember_lookups
    needs_hub: tuple[str, ...] = ()  # what check_recipe(hub_optional=True) could not check offline

    def resolve(self, relative: str) -> Path:
        return (self.path.parent / relative).resolve()

    @property
    def include_path(self) -> Path | None:
        include = self.recipe.evals.include_path
        return self.resolve(include) if include else None


def load_recipe(path: str | Path) -> LoadedRecipe:
    """Parse and check a recipe file; raise BadInput listing every problem found."""
    path = Path(path)
    shown = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput([Problem(shown, "", "no such recipe file")]) from None
    except (IsADirectoryError, UnicodeDecodeError, PermissionError) as error:
        raise BadInput([Problem(shown, "", f"cannot read recipe: {error}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "YAML"
        reason = getattr(error, "problem", None) or str(error)
        raise BadInput([Problem(shown, where, f"YAML syntax error: {reason}")]) from None
    if not isinstance(data, dict):
        raise BadInput([Problem(shown, "", "a recipe is a YAML mapping (name:, model:, variants: ...)")])
    problems = _problems_in_file(data, path.resolve().parent, shown)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as error:
        structural = [_problem_from_pydantic(shown, data, item) for item in error.errors()]
        raise BadInput(structural + [p for p in problems if p.field not in {q.field for q in structural}]) from None
    if problems:
        raise BadInput(problems)
    return LoadedRecipe(path=path.resolve(), recipe=recipe, text=text)


def _problem_from_pydantic(shown: str, data: dict, item: dict) -> Problem:
    field = _field_path(data, item["loc"])
    if item["type"] == "extra_forbidden":
        return Problem(shown, field, "unknown key")
    if item["type"] == "missing":
        return Problem(shown, field, "required key is missing")
    if item["type"] == "string_pattern_mismatch":
        return Problem(
            shown, field, "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return Problem(shown, field, item["msg"])


def _field_path(data: Any, loc: tuple) -> str:
    """variants[2] (awq).params.group_size: index plus the variant's name where it has one."""
    parts: list[str] = []
    node = data
    for key in loc:
        if isinstance(key, int):
            label = f"[{key}]"
            if isinstance(node, list) and key < len(node) and isinstance(node[key], dict):
                name = node[key].get("name")
                label += f" ({name})" if isinstance(name, str) else ""
            parts.append(label)
        else:
            parts.append(("." if parts else "") + str(key))
        node = node[key] if isinstance(node, (dict, list)) and _has(node, key) else None
    return "".join(parts)


def _has(node: dict | list, key: Any) -> bool:
    return key in node if isinstance(node, dict) else isinstance(key, int) and key < len(node)


def did_you_mean(word: str, choices: list[str] | set[str]) -> str:
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _problems_in_file(data: dict, base_dir: Path, shown: str) -> list[Problem]:
    """Checks across fields that need only the file and the method registry.

    They read the raw YAML (guarding every type) so that they still run when the structure has
    errors too: the user sees every problem in one go.
    """
    from quantlab.quantize import METHODS

    problems: list[Problem] = []
    variants = data.get("variants") if isinstance(data.get("variants"), list) else []
    seen: dict[str, int] = {}
    for index, variant in enumerate(variants):
        if not isinstance(variant, dict):
            continue
        name, method_name = variant.get("name"), variant.get("method")
        field = f"variants[{index}] ({name})"
        if isinstance(name, str):
            if name in seen:
                problems.append(Problem(shown, f"{field}.name", f"duplicate variant name (also variants[{seen[name]}])"))
            seen.setdefault(name, index)
        if not isinstance(method_name, str):
            continue
        method = METHODS.get(method_name)
        if method is None:
            known = ", ".join(sorted(METHODS))
            problems.append(Problem(
                shown, f"{field}.method",
                f"unknown method '{method_name}'{did_you_mean(method_name, set(METHODS))}; known: {known}",
            ))
            continue
        params = variant.get("params") or {}
        try:
            method.Params.model_validate(params)
        except ValidationError as error:
            for item in error.errors():
                sub = ".".join(str(part) for part in item["loc"])
                message = "unknown parameter" if item["type"] == "extra_forbidden" else item["msg"]
                problems.append(Problem(shown, f"{field}.params.{sub}".rstrip("."), message))
    problems += _task_problems(_section(data, "evals").get("tasks"), shown)
    baseline = data.get("baseline")
    if isinstance(baseline, str) and variants and baseline not in seen:
        problems.append(Problem(shown, "baseline", f"'{baseline}' is not a variant name{did_you_mean(baseline, set(seen))}"))
    return problems + _missing_files(data, base_dir, shown)


def _task_problems(tasks: Any, shown: str) -> list[Problem]:
    """Across a task's fields, and across tasks: what pydantic's per-field checks cannot see."""
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for index, task in enumerate(tasks if isinstance(tasks, list) else []):
        if not isinstance(task, dict):
            continue
        name = task.get("name")
        field = f"evals.tasks[{index}]" + (f" ({name})" if isinstance(name, str) else "")
        if isinstance(name, str):
            if name in seen:  # the same keys twice: the second run's scores would overwrite the first's
                problems.append(Problem(shown, f"{field}.name", f"task listed twice (also evals.tasks[{seen[name]}])"))
            seen.setdefault(name, index)
        # lm-eval's CLI refuses this combination; simple_evaluate would quietly use plain prompts.
        if task.get("fewshot_as_multiturn") is True and not task.get("apply_chat_template"):
            problems.append(Problem(shown, f"{field}.fewshot_as_multiturn", "needs apply_chat_template"))
    return problems


def _section(data: dict, key: str) -> dict:
    return data.get(key) if isinstance(data.get(key), dict) else {}


def _missing_files(data: dict, base_dir: Path, shown: str) -> list[Problem]:
    from quantlab.corpora import text_source_problem
    from quantlab.models import source_problem

    problems: list[Problem] = []
    checks = [
        ("model.source", _section(data, "model").get("source"), source_problem),
        ("calibration.source", _section(data, "calibration").get("source"), text_source_problem),
        ("quality.corpus", _section(data, "quality").get("corpus"), text_source_problem),
    ]
    for field, value, check in checks:
        if isinstance(value, str) and (message := check(value, base_dir)) is not None:
            problems.append(Problem(shown, field, message))
    include = _section(data, "evals").get("include_path")
    if isinstance(include, str) and not (base_dir / include).resolve().is_dir():
        problems.append(Problem(shown, "evals.include_path", f"no such directory: {(base_dir / include).resolve()}"))
    return problems


def check_recipe(loaded: LoadedRecipe, cache_root: Path | None = None, hub_optional: bool = False) -> LoadedRecipe:
    """Checks that look outside the file: model config and lm-eval's task index. Raises BadInput.

    Both are slow to find out (the model's config through transformers, ~10k lm-eval task files)
    and fixed by content. With `cache_root`, what `remember_lookups` stored there after an earlier
    check is read instead; the recipe comes back with what this check looked up.

    A hub model on a machine that cannot reach the hub (and has no cached copy) is bad input for
    a sweep; with `hub_optional` (`quantlab validate`) the checks that need it are skipped and
    listed in `needs_hub` instead, with the lm-eval tasks whose data comes from the hub.
    """
    from quantlab.models import hub_reachable, in_local_cache

    from quantlab import cache
    from quantlab.evaluate.lm_eval_runner import known_tasks, task_index_identity, unknown_tasks
    from quantlab.models import linear_input_widths, resolve_source, widths_identity
    from quantlab.quantize import METHODS

    recipe = loaded.recipe
    shown = str(loaded.path)
    remembered = cache_root / RECIPE_CHECKS_DIR if cache_root is not None else None
    lookups: list[Lookup] = []

    def look_up(identity: dict[str, Any], find: Callable[[], Any]) -> Any:
        fact = cache.recall(remembered, identity) or find()
        lookups.append(Lookup(identity, fact))
        return fact

    problems: list[Problem] = []
    needs_hub: list[str] = []
    try:
        source = resolve_source(recipe.model, loaded.path.parent)
        offline_hub_model = (
            source.kind == "hub" and cache.recall(remembered, widths_identity(source)) is None
            and not in_local_cache(source) and not hub_reachable()
        )
        if offline_hub_model and hub_optional:
            needs_hub.append(f"model.source: the config of {source.display} (layer widths against group sizes)")
            widths = None
        elif offline_hub_model:
            raise BadInput([Problem("", "", f"{source.display} is a hub model, this machine cannot reach the "
                                    "hub, and the local Hugging Face cache has no copy")])
        else:
            widths = look_up(widths_identity(source), lambda: linear_input_widths(source))
    except BadInput as error:
        problems += [Problem(shown, "model.source", problem.message) for problem in error.problems]
        widths = None
    if widths is not None:
        for index, variant in enumerate(recipe.variants):
            method = METHODS[variant.method]
            params = method.Params.model_validate(variant.params)
            for field, message in method.check_model(params, widths):
                problems.append(Problem(shown, f"variants[{index}] ({variant.name}).params.{field}", message))
    task_names = [task.name for task in recipe.evals.tasks]
    if task_names:
        known = set(look_up(task_index_identity(loaded.include_path), lambda: sorted(known_tasks(loaded.include_path))))
        for name, suggestion in unknown_tasks(task_names, known):
            index = task_names.index(name)
            hint = f" (did you mean '{suggestion}'?)" if suggestion else ""
            problems.append(Problem(shown, f"evals.tasks[{index}].name", f"lm-eval cannot resolve task '{name}'{hint}"))
    if hub_optional and task_names:
        local = _tasks_defined_under(loaded.include_path)
        hub_tasks = [name for name in task_names if name not in local]
        if hub_tasks:
            needs_hub.append(f"evals.tasks: the data of {', '.join(hub_tasks)} (lm-eval downloads it when a sweep runs, "
                             "unless the Hugging Face datasets cache has it)")
    if problems:
        raise BadInput(problems)
    return replace(loaded, lookups=tuple(lookups), needs_hub=tuple(needs_hub))


def _tasks_defined_under(include_path: Path | None) -> set[str]:
    """Task, group and tag names that the YAMLs under include_path define (their data is local or theirs)."""
    names: set[str] = set()
    for path in sorted(include_path.rglob("*.yaml")) if include_path else ():
        try:
            # lm-eval's YAMLs use custom tags (!function); a plain line scan reads their names.
            for line in path.read_text(encoding="utf-8").splitlines():
                key, _, value = line.partition(":")
                if key in ("task", "group", "tag") and value.strip():
                    names.add(value.strip().strip("'\""))
        except (OSError, UnicodeDecodeError):
            continue
    return names


def remember_lookups(loaded: LoadedRecipe, cache_root: Path) -> None:
    """Keep what the check of a recipe looked up, for the next check; call it once work starts
    (so that bad input, or an unreachable tracking server, leaves nothing in the cache)."""
    from quantlab import cache

    for lookup in loaded.lookups:
        cache.remember(cache_root / RECIPE_CHECKS_DIR, lookup.identity, lookup.fact)


def validate(path: str | Path, cache_root: Path | None = None, hub_optional: bool = False) -> LoadedRecipe:
    """Everything a sweep needs to know before spending compute. Raises BadInput."""
    return check_recipe(load_recipe(path), cache_root, hub_optional)
