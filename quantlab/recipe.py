"""The recipe: what to sweep. Pydantic models (unknown keys rejected) and the YAML loader.

The file alone, every problem collected before reporting; checks against the world outside it
(model config, lm-eval's task index, files on disk) are `quantlab.checks`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
)

from quantlab.adaptive import Spending
from quantlab.errors import BadInput, Problem, bad_input, did_you_mean
from quantlab.frontier import FrontierSettings
from quantlab.measure.settings import MeasureSettings
from quantlab.quantize import METHODS
from quantlab.serving.settings import ServingSettings

# A name becomes a directory and an MLflow tag: no separators, cannot be "." or "..".
SafeName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(StrictModel):
    source: str = Field(description="Hub id (org/name), checkpoint directory, .gguf file, or pkg://<package>/<file>.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    trust_remote_code: bool = Field(False, description="Run the model repository's own Python code (opt-in).")


def _kv_cache_shorthand(value: object) -> object:
    # `kv_cache: fp8` is `kv_cache: {format: fp8}` (per tensor)
    return {"format": value} if isinstance(value, str) else value


class KvCacheSpec(StrictModel):
    """The variant's KV cache stored quantized: K and V rounded to the format as attention writes them, with static
    scales llm-compressor calibrates on the recipe's calibration samples (its `kv_cache_scheme`)."""

    format: Literal["fp8"] = Field("fp8", description="fp8: FP8 E4M3 with static scales (vLLM's kv_cache_dtype fp8).")
    granularity: Literal["tensor", "head"] = Field(
        "tensor", description="One scale per layer for K and one for V (tensor), or one per KV head (head)."
    )

    @property
    def strategy(self) -> str:
        """compressed-tensors' QuantizationStrategy of the scales."""
        return {"tensor": "tensor", "head": "attn_head"}[self.granularity]


class VariantBase(StrictModel):
    """What every variant has beside its method's params."""

    kv_cache: Annotated[KvCacheSpec | None, BeforeValidator(_kv_cache_shorthand)] = Field(
        None, description="Quantize the KV cache too (on any method): fp8, or {format: fp8, granularity: head}."
    )

    @property
    def needs_calibration(self) -> bool:
        """Its checkpoint is calibrated on the recipe's samples: by its method, or for its KV-cache scales."""
        return METHODS[self.method].needs_calibration or self.kv_cache is not None  # type: ignore[attr-defined]


# The variant model of each method: `method` is its tag, `params` the method's own `Params`.
_VARIANT_MODELS = tuple(
    create_model(
        f"{method.__name__}Variant",
        __base__=VariantBase,
        name=(SafeName, ...),
        method=(Literal[name], ...),
        params=(method.Params, Field(default_factory=method.Params)),
    )
    for name, method in METHODS.items()
)
# pickle finds them by name (jobs cross processes)
globals().update({model.__name__: model for model in _VARIANT_MODELS})

# One member per registered method, chosen by `method`: pydantic itself rejects an unknown method
# and parameters the method does not take, with the field that is wrong.
VariantSpec = Annotated[Union[_VARIANT_MODELS], Field(discriminator="method")]  # noqa: UP007


# Where a text comes from (quantlab.corpora); both builtin defaults are offline and disjoint from each
# other and from every bundled eval text.
TEXT_SOURCE = "builtin:<name>, a .txt/.jsonl file (relative to the recipe), or hf:<dataset>:<split>:<text field>."


class CalibrationSettings(StrictModel):
    source: str = Field("builtin:pydoc-calibration", description=TEXT_SOURCE)
    num_samples: int = Field(32, gt=0, le=100_000)
    seq_len: int = Field(256, gt=0, le=1_000_000)
    seed: int = 0
    batch_size: int = Field(
        1,
        gt=0,
        le=100_000,
        description="Samples per calibration forward pass: more is faster and holds more activations in memory; "
        "the scales found move within their noise (float sums in another order).",
    )

    @field_validator("batch_size")
    @classmethod
    def _at_most_the_samples(cls, batch_size: int, info: ValidationInfo) -> int:
        samples = info.data.get("num_samples")
        if samples is not None and batch_size > samples:
            raise ValueError(f"{batch_size} is more than num_samples ({samples})")
        return batch_size


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
    gen_kwargs: GenKwargs | None = Field(None, description="Merged over the YAML's generation settings.")
    apply_chat_template: bool | str = Field(False, description="true, or the name of a tokenizer chat template.")
    fewshot_as_multiturn: bool | None = Field(None, description="Shots as chat turns; unset = on with a chat template.")
    system_instruction: str | None = None
    repeats: int = Field(
        1,
        ge=1,
        le=1000,
        description="Runs of a sampled generation task, each with its own seeds, the same for every variant; a "
        "document's score is its mean over them. More than 1 needs sampled decoding: gen_kwargs with do_sample: true "
        "and a temperature above 0, here or in the task's YAML.",
    )
    seed: int = Field(0, ge=0, description="repeats: the repeats' seeds are derived from it and the task's name.")

    @field_validator("repeats")
    @classmethod
    def _repeats_sample(cls, repeats: int, info: ValidationInfo) -> int:
        generation = info.data.get("gen_kwargs")
        if repeats > 1 and generation is not None and not_sampled(generation.model_dump(exclude_none=True)):
            raise ValueError(f"{repeats} repeats of greedy decoding give one answer {repeats} times: {SAMPLED}")
        return repeats

    @model_serializer(mode="wrap")
    def _one_run_left_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A task run once dumps (into every run's key) what it dumped before repeats existed.
        data = handler(self)
        return data if self.repeats > 1 else {k: v for k, v in data.items() if k not in ("repeats", "seed")}


SAMPLED = "set gen_kwargs do_sample: true and a temperature above 0"


def not_sampled(generation: dict[str, Any]) -> bool:
    """Whether lm-eval generation settings, as far as they are set, decode greedily: do_sample false, or a temperature
    of 0 (HFLM then turns sampling off). Unset ones are the task YAML's, checked with it."""
    return generation.get("do_sample") is False or generation.get("temperature") == 0


class EvalSettings(StrictModel):
    include_path: str | None = Field(None, description="Directory of extra lm-eval task YAMLs, relative to the recipe.")
    tasks: list[EvalTaskSpec] = Field(default_factory=list)
    batch_size: int = Field(8, gt=0, le=4096)
    engine: Literal["reference", "served", "both"] = Field(
        "reference",
        description="Where lm-eval scores each variant. reference: the checkpoint loaded in transformers here. "
        "served: lm-eval's local-completions against the variant's own server (serving.engine; vLLM), the kernels "
        "that ship. both: each, plus the paired difference of the engine's scores from the reference's "
        "(quality/engine_vs_reference/...), the check that catches kernel bugs; the served scores are the ones logged "
        "as eval/... and compared with the baseline.",
    )
    served_concurrency: int = Field(
        4, gt=0, le=4096, description="Requests lm-eval keeps in flight against the server (served, both)."
    )
    adaptive: bool = Field(
        False,
        description="Score each variant's tasks in stages and stop a task once every drop limit of "
        "frontier.default_policy on its scores is shown within, or one is shown over (the baseline scores every "
        "document); a variant whose token damage already fails a plain limit of the policy (max_kld, ...) stops "
        "every task at its first stage. Each stage's claims are tested at the level adaptive_spending allows by "
        "then, and the final verdict at the level of the stage the task stopped at, so each check keeps the "
        "policy's error rate. A task scored with few-shot examples, or with no drop limit on its scores, runs every "
        "document.",
    )
    adaptive_stages: list[Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=lambda: [0.25, 0.5, 0.75, 1.0],
        description="adaptive: the share of each task's documents scored by the end of each stage, increasing, the "
        "last 1. More stages stop sooner on clear verdicts and cost a little level at the last one.",
    )
    adaptive_spending: Spending = Field(
        Spending.OBRIEN_FLEMING,
        description="adaptive: how the policy's one-sided level is spent over the stages (Lan-DeMets). "
        "obrien_fleming: almost nothing early, so a stop needs overwhelming evidence and a task that runs every "
        "document is judged at nearly the full level; pocock: evenly, earlier stops and a stricter last stage.",
    )
    adaptive_seed: int = Field(
        0, ge=0, description="adaptive: seeds the one random order of each task's documents that every variant shares."
    )

    @field_validator("adaptive_stages")
    @classmethod
    def _stages_end_at_every_document(cls, stages: list[float]) -> list[float]:
        if any(later <= earlier for earlier, later in zip(stages, stages[1:])):
            raise ValueError(f"{stages} is not strictly increasing")
        if not stages or stages[-1] != 1:
            raise ValueError(f"{stages} must end with 1 (the last stage scores every document)")
        return stages

    @field_validator("adaptive")
    @classmethod
    def _adaptive_on_one_path(cls, adaptive: bool, info: ValidationInfo) -> bool:
        if adaptive and info.data.get("engine") == "both":
            raise ValueError(
                "adaptive evaluation stops each path's tasks where its own scores settle them, so the two paths of "
                "engine: both would score different documents: choose engine: reference or served"
            )
        return adaptive

    @model_serializer(mode="wrap")
    def _adaptive_left_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Without adaptive evaluation, the dump (part of every run's key) is what it was before it existed.
        data = handler(self)
        return data if self.adaptive else {k: v for k, v in data.items() if not k.startswith("adaptive")}


class GenerateSettings(StrictModel):
    """On-policy damage (quantlab.evaluate.on_policy): the baseline greedily continues prompts cut from the quality
    corpus, and each variant is scored token by token over prompt + the baseline's continuation."""

    enabled: bool = True
    prompts: int = Field(8, gt=0, le=10_000, description="Prompts, taken from the quality corpus at spread offsets.")
    prompt_tokens: int = Field(32, gt=1, le=1_000_000, description="Corpus tokens per prompt.")
    max_new_tokens: int = Field(
        48, gt=0, le=8192, description="Tokens the baseline generates per prompt (fewer where it ends its turn)."
    )


class QualitySettings(StrictModel):
    """Token-level damage against the baseline: perplexity and KL over a text corpus."""

    enabled: bool = True
    corpus: str = Field("builtin:pydoc-perplexity", description=TEXT_SOURCE)  # CPython's language reference
    max_tokens: int = Field(1024, gt=0, le=10_000_000)
    window: int = Field(256, gt=1, le=1_000_000)
    stride: int | None = Field(None, gt=0, description="Defaults to window (non-overlapping windows).")
    contexts: list[Annotated[int, Field(gt=1, le=1_000_000)]] = Field(
        default_factory=list,
        description="Context lengths, in increasing order, of a second pass over the corpus in windows of the longest "
        "(clipped to the model's max positions): KL and top-1 by how much context each token had, "
        "quality/<figure>/ctx<L> for the tokens with fewer than L and at least the previous length's tokens before "
        "them, e.g. [256, 1024, 4096]. Empty: no such pass.",
    )
    context_windows: int = Field(
        2, gt=0, le=10_000, description="Windows of the longest context length that pass scores (its corpus tokens)."
    )
    generate: GenerateSettings = Field(default_factory=GenerateSettings)

    @field_validator("contexts")
    @classmethod
    def _increasing(cls, contexts: list[int]) -> list[int]:
        if any(later <= earlier for earlier, later in zip(contexts, contexts[1:])):
            raise ValueError(f"{contexts} is not strictly increasing")
        return contexts

    @model_serializer(mode="wrap")
    def _unused_left_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Without contexts, the dump (part of the reference's and every run's key) is what it was before they existed.
        data = handler(self)
        return data if self.contexts else {k: v for k, v in data.items() if k not in ("contexts", "context_windows")}


class RuntimeSettings(StrictModel):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Compute dtype; auto = bfloat16 on CUDA and on CPUs with BF16 matmul instructions (AVX512-BF16, "
        "AMX), float32 on other CPUs (BF16 emulated there: slower).",
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
    serving: ServingSettings = Field(default_factory=ServingSettings)
    frontier: FrontierSettings = Field(default_factory=FrontierSettings)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)

    @property
    def needs_server(self) -> bool:
        """Whether a variant's checkpoint goes behind a server: to be put under load, or scored through it."""
        return self.serving.enabled or self.evals.engine != "reference"

    def variant(self, name: str) -> VariantSpec:
        return next(variant for variant in self.variants if variant.name == name)


@dataclass(frozen=True)
class LoadedRecipe:
    """A recipe with where it came from: relative paths in it are relative to `path`."""

    path: Path
    recipe: Recipe
    text: str
    # (identity, fact): what checks.check_recipe found outside the file, slow to find and fixed by identity
    lookups: tuple[tuple[dict[str, Any], Any], ...] = ()
    needs_hub: tuple[str, ...] = ()  # what check_recipe(hub_optional=True) could not check offline

    @property
    def include_path(self) -> Path | None:
        include = self.recipe.evals.include_path
        return (self.path.parent / include).resolve() if include else None


def load_recipe(path: str | Path) -> LoadedRecipe:
    """Parse and check a recipe file alone; raise BadInput listing every problem found."""
    return parse_recipe(path, *read_recipe(path))


def read_recipe(path: str | Path) -> tuple[str, dict]:
    """The recipe file's text and its YAML mapping; BadInput if it cannot be read as one."""
    shown = str(Path(path))
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise bad_input(shown, "", "no such recipe file") from None
    except (IsADirectoryError, UnicodeDecodeError, PermissionError) as error:
        raise bad_input(shown, "", f"cannot read recipe: {error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "YAML"
        reason = getattr(error, "problem", None) or str(error)
        raise bad_input(shown, where, f"YAML syntax error: {reason}") from None
    if not isinstance(data, dict):
        raise bad_input(shown, "", "a recipe is a YAML mapping (name:, model:, variants: ...)")
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
    loc, kind = item["loc"], item["type"]
    if loc[:1] == ("variants",) and len(loc) > 2 and isinstance(loc[1], int):
        loc = loc[:2] + loc[3:]  # drop the union's tag (the method) that pydantic puts after the index
    if kind.startswith("union_tag_"):
        loc += ("method",)  # the variant's tag: unknown or missing
    field = _field_path(data, loc)
    if kind == "union_tag_invalid":
        method, known = item["ctx"]["tag"], ", ".join(sorted(METHODS))
        return Problem(shown, field, f"unknown method '{method}'{did_you_mean(method, METHODS)}; known: {known}")
    if kind == "extra_forbidden":
        return Problem(shown, field, "unknown parameter" if loc[2:3] == ("params",) else "unknown key")
    if kind in ("model_type", "model_attributes_type") and loc[:1] == ("variants",) and len(loc) in (2, 3):
        return Problem(shown, field, "Input should be a valid dictionary")  # a variant or its params; not a class name
    if kind in ("missing", "union_tag_not_found"):
        return Problem(shown, field, "required key is missing")
    if kind == "string_pattern_mismatch":
        return Problem(shown, field, "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return Problem(shown, field, item["msg"])


def _field_path(data: Any, loc: tuple) -> str:
    """variants[2] (awq).params.group_size: index plus the variant's name where it has one."""
    path, node = "", data
    for key in loc:
        try:
            node = node[key] if isinstance(node, (dict, list)) else None
        except (KeyError, IndexError, TypeError):  # pydantic's loc goes where the raw data does not
            node = None
        if isinstance(key, int):
            name = node.get("name") if isinstance(node, dict) else None
            path += f"[{key}]" + (f" ({name})" if isinstance(name, str) else "")
        else:
            path += f".{key}" if path else str(key)
    return path


def _problems_across_fields(data: dict, shown: str) -> list[Problem]:
    """What the schema's per-field checks cannot see: names unique, the baseline one of them, task
    settings that go together. They read the raw YAML (guarding every type) so that they still run
    when the structure has errors too: the user sees every problem in one go."""
    problems: list[Problem] = []
    variants_raw = data.get("variants") if isinstance(data.get("variants"), list) else []
    variants = [item for _, item in _listed(variants_raw, "variants", "duplicate variant name", shown, problems)]
    # The same task twice: the second run's scores would overwrite the first's.
    tasks = section(data, "evals").get("tasks")
    for field, task in _listed(tasks, "evals.tasks", "task listed twice", shown, problems):
        # lm-eval's CLI refuses this combination; simple_evaluate would quietly use plain prompts.
        if task.get("fewshot_as_multiturn") is True and not task.get("apply_chat_template"):
            problems.append(Problem(shown, f"{field}.fewshot_as_multiturn", "needs apply_chat_template"))
    names = {variant["name"] for variant in variants if isinstance(variant.get("name"), str)}
    baseline = data.get("baseline")
    if isinstance(baseline, str) and variants_raw and baseline not in names:
        message = f"'{baseline}' is not a variant name{did_you_mean(baseline, names)}"
        problems.append(Problem(shown, "baseline", message))
    sequence = section(section(data, "frontier"), "default_policy").get("sequence")
    candidates = names - {baseline}
    for index, name in enumerate(sequence if isinstance(sequence, list) and variants_raw else []):
        if isinstance(name, str) and name not in candidates:
            why = "the baseline is no candidate" if name == baseline else "not a variant name"
            message = f"'{name}': {why}{did_you_mean(name, candidates) if name != baseline else ''}"
            problems.append(Problem(shown, f"frontier.default_policy.sequence[{index}]", message))
    return problems


def _listed(items: Any, prefix: str, duplicate: str, shown: str, problems: list[Problem]) -> Iterator[tuple[str, dict]]:
    """Each mapping of a raw YAML list with its field (`prefix[i] (name)`); adds a problem for a repeated name."""
    seen: dict[str, int] = {}
    for index, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        name = item.get("name")
        field = prefix + _field_path(items, (index,))
        if isinstance(name, str):
            if name in seen:
                problems.append(Problem(shown, f"{field}.name", f"{duplicate} (also {prefix}[{seen[name]}])"))
            seen.setdefault(name, index)
        yield field, item


def section(data: dict, key: str) -> dict:
    """A top-level section of the raw YAML, or {} when it is missing or not a mapping."""
    return data.get(key) if isinstance(data.get(key), dict) else {}
