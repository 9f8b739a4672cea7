"""The recipe: what to sweep. Pydantic models (unknown keys rejected) and the YAML loader.

This module knows the file alone: `load_recipe` parses the YAML, checks its structure (each
variant's `params` against its method's own model: a union keyed by `method`) and the references
between fields, and collects every problem before reporting. What needs the world outside the
file (the model's config, lm-eval's task index, files on disk) is `quantlab.checks`.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, create_model

from quantlab.errors import BadInput, Problem
from quantlab.frontier import FrontierSettings
from quantlab.measure.settings import MeasureSettings
from quantlab.quantize import METHODS

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


class _Variant(StrictModel):
    name: SafeName


def _variant_model(method_name: str) -> type[_Variant]:
    """The variant model of one method: `method` is its tag, `params` the method's own `Params`."""
    method = METHODS[method_name]
    return create_model(
        f"{method.__name__}Variant",
        __base__=_Variant,
        method=(Literal[method_name], ...),
        params=(method.Params, Field(default_factory=method.Params)),
    )


_VARIANT_MODELS = tuple(_variant_model(name) for name in METHODS)
globals().update(
    {model.__name__: model for model in _VARIANT_MODELS}
)  # pickle finds them by name (jobs cross processes)

# One member per registered method, chosen by `method`: pydantic itself rejects an unknown method
# and parameters the method does not take, with the field that is wrong.
VariantSpec = Annotated[Union[_VARIANT_MODELS], Field(discriminator="method")]  # noqa: UP007


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
    apply_chat_template: bool | str = Field(
        False, description="true, or the name of one of the tokenizer's chat templates."
    )
    fewshot_as_multiturn: bool | None = Field(
        None, description="Few-shot examples as chat turns; unset = on with a chat template. Needs apply_chat_template."
    )
    system_instruction: str | None = None


class EvalSettings(StrictModel):
    include_path: str | None = Field(None, description="Directory of extra lm-eval task YAMLs, relative to the recipe.")
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


@dataclass(frozen=True)
class Lookup:
    """Something `checks.check_recipe` found outside the file, slow to find and fixed by `identity`."""

    identity: dict[str, Any]
    fact: Any


@dataclass(frozen=True)
class LoadedRecipe:
    """A recipe with where it came from: relative paths in it are relative to `path`."""

    path: Path
    recipe: Recipe
    text: str
    lookups: tuple[Lookup, ...] = ()  # filled by checks.check_recipe; see checks.remember_lookups
    needs_hub: tuple[str, ...] = ()  # what check_recipe(hub_optional=True) could not check offline

    def resolve(self, relative: str) -> Path:
        return (self.path.parent / relative).resolve()

    @property
    def include_path(self) -> Path | None:
        include = self.recipe.evals.include_path
        return self.resolve(include) if include else None


def load_recipe(path: str | Path) -> LoadedRecipe:
    """Parse and check a recipe file alone; raise BadInput listing every problem found."""
    text, data = read_recipe(path)
    return parse_recipe(path, text, data)


def read_recipe(path: str | Path) -> tuple[str, dict]:
    """The recipe file's text and its YAML mapping; BadInput if it cannot be read as one."""
    shown = str(Path(path))
    try:
        text = Path(path).read_text(encoding="utf-8")
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
    return text, data


def parse_recipe(path: str | Path, text: str, data: dict, found: Sequence[Problem] = ()) -> LoadedRecipe:
    """The recipe in `data` (read from `path`), checked against the schema and across its fields.

    `found` are problems other checks found in the same data: all are reported together, except
    those on a field that the schema already rejects.
    """
    shown = str(Path(path))
    problems = _problems_across_fields(data, shown) + list(found)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as error:
        structural = [_problem_from_pydantic(shown, data, item) for item in error.errors()]
        raise BadInput(structural + [p for p in problems if p.field not in {q.field for q in structural}]) from None
    if problems:
        raise BadInput(problems)
    return LoadedRecipe(path=Path(path).resolve(), recipe=recipe, text=text)


def _problem_from_pydantic(shown: str, data: dict, item: dict) -> Problem:
    loc = item["loc"]
    if loc[:1] == ("variants",) and len(loc) > 2 and isinstance(loc[1], int):
        loc = loc[:2] + loc[3:]  # drop the union's tag (the method) that pydantic puts after the index
    field = _field_path(data, loc)
    if item["type"] == "union_tag_invalid":
        method = item["ctx"]["tag"]
        return Problem(
            shown,
            f"{field}.method",
            f"unknown method '{method}'{did_you_mean(method, set(METHODS))}; known: {', '.join(sorted(METHODS))}",
        )
    if item["type"] == "union_tag_not_found":
        return Problem(shown, f"{field}.method", "required key is missing")
    if item["type"] == "extra_forbidden":
        return Problem(shown, field, "unknown parameter" if loc[2:3] == ("params",) else "unknown key")
    if item["type"] in ("model_type", "model_attributes_type") and loc[:1] == ("variants",) and len(loc) in (2, 3):
        return Problem(shown, field, "Input should be a valid dictionary")  # a variant or its params; not a class name
    if item["type"] == "missing":
        return Problem(shown, field, "required key is missing")
    if item["type"] == "string_pattern_mismatch":
        return Problem(shown, field, "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
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


def _problems_across_fields(data: dict, shown: str) -> list[Problem]:
    """What the schema's per-field checks cannot see: names unique, the baseline one of them.

    They read the raw YAML (guarding every type) so that they still run when the structure has
    errors too: the user sees every problem in one go.
    """
    problems: list[Problem] = []
    variants = data.get("variants") if isinstance(data.get("variants"), list) else []
    seen: dict[str, int] = {}
    for index, variant in enumerate(variants):
        name = variant.get("name") if isinstance(variant, dict) else None
        if isinstance(name, str):
            if name in seen:
                problems.append(
                    Problem(
                        shown,
                        f"variants[{index}] ({name}).name",
                        f"duplicate variant name (also variants[{seen[name]}])",
                    )
                )
            seen.setdefault(name, index)
    problems += _task_problems(section(data, "evals").get("tasks"), shown)
    baseline = data.get("baseline")
    if isinstance(baseline, str) and variants and baseline not in seen:
        problems.append(
            Problem(shown, "baseline", f"'{baseline}' is not a variant name{did_you_mean(baseline, set(seen))}")
        )
    return problems


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


def section(data: dict, key: str) -> dict:
    """A top-level section of the raw YAML, or {} when it is missing or not a mapping."""
    return data.get(key) if isinstance(data.get(key), dict) else {}
