"""`quantlab sensitivity rank` and `mix` in MLflow: a parent run of its own (role `sensitivity-sweep`, so that a
sweep's tools never take it for a sweep) holding one run of role `sensitivity` with each group's figures, the ranking
as JSON and a bar chart (a mix: one per format); and, when asked, a copy of the recipe with one more variant: the
ranked variant keeping its most damaging groups in BF16, or the mix."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import get_args

from quantlab import tracking
from quantlab.errors import BadInput, Problem, bad_input, did_you_mean
from quantlab.logbook import mark_dead_sweeps, sweep_process_tags
from quantlab.metrics import Shown, shown_in
from quantlab.quantize import METHODS
from quantlab.quantize.base import PresetMethod
from quantlab.recipe import LoadedRecipe
from quantlab.report import sensitivity_chart
from quantlab.sensitivity.budget import Mix, best_mix
from quantlab.sensitivity.groups import (
    RANK_BY,
    By,
    GroupDamage,
    LayerGroup,
    kept_variant_name,
    mixed_variant,
    ranked,
    recipe_keeping,
    recipe_with_variant,
)
from quantlab.sensitivity.probe import Progress, Sensitivity, SensitivityJob, measure_sensitivity, sensitivity_key

LOGGED_FIGURES = tuple(key.removeprefix("quality/") for key in shown_in(Shown.SENSITIVITY))  # per group
RANKING_ARTIFACT = "sensitivity.json"
CHART_ARTIFACT = "sensitivity.png"


@dataclass(frozen=True)
class SensitivityOptions:
    tracking_uri: str
    cache_root: Path
    by: By = "block"
    rounded: bool = False
    force: bool = False
    write_recipe: Path | None = None
    keep: int = 2
    log: Path | None = None  # where the libraries' output goes: logged with the run


@dataclass(frozen=True)
class SensitivityOutcome:
    ranking: list[GroupDamage]  # most damaging first
    result: Sensitivity
    rounding: str
    experiment_id: str
    parent_run_id: str
    run_id: str
    written: tuple[Path, str] | None = None  # the recipe written and its new variant


def check_request(loaded: LoadedRecipe, variant: str, options: SensitivityOptions) -> None:
    """Bad input before any work: which variant, whether it quantizes anything, where the recipe goes."""
    recipe, shown = loaded.recipe, str(loaded.path)
    names = [v.name for v in recipe.variants]
    if variant not in names:
        raise bad_input("--variant", "", f"'{variant}' is not a variant of {shown}{did_you_mean(variant, names)}")
    method = recipe.variant(variant).method
    if METHODS[method].rounded(recipe.variant(variant).params) is None:
        quantizing = [v.name for v in recipe.variants if METHODS[v.method].rounded(v.params) is not None]
        raise bad_input("--variant", "", f"'{variant}' ({method}) quantizes nothing; pick one of {quantizing}")
    if problems := _measure_and_write_problems(loaded, options):
        raise BadInput(problems)


def _measure_and_write_problems(loaded: LoadedRecipe, options: SensitivityOptions) -> list[Problem]:
    problems = []
    if options.by not in get_args(By):
        problems.append(Problem("--by", "", f"'{options.by}' is not one of: {', '.join(get_args(By))}"))
    if not loaded.recipe.quality.enabled:
        why = "sensitivity compares each group with the baseline's reference pass over the quality corpus"
        problems.append(Problem(str(loaded.path), "quality.enabled", f"is false: {why}"))
    if (target := options.write_recipe) is not None:
        if not target.parent.is_dir():
            problems.append(Problem("--write-recipe", "", f"no such directory: {target.parent}"))
        elif target.resolve() == loaded.path:
            problems.append(Problem("--write-recipe", "", "is the recipe itself: write the copy elsewhere"))
    return problems


def run_sensitivity(
    loaded: LoadedRecipe, variant: str, options: SensitivityOptions, progress: Progress
) -> SensitivityOutcome:
    job = SensitivityJob(loaded, variant, options.by, options.rounded, options.cache_root, options.force)
    store = tracking.open_store(options.tracking_uri)
    experiment = store.experiment_id(loaded.recipe.name)
    mark_dead_sweeps(store, experiment)
    method = loaded.recipe.variant(variant).method
    parent, run = tracking.start_sensitivity(
        store, experiment, variant, method, sensitivity_key(job), sweep_process_tags()
    )
    try:
        store.log_files(parent, {"recipe.yaml": loaded.text})
        result = measure_sensitivity(job, progress)
        ranking = ranked(result.groups)
        written = _write_recipe(loaded, variant, options, ranking) if options.write_recipe else None
        files = {
            RANKING_ARTIFACT: json.dumps(_ranking_json(job, result, ranking), indent=1),
            CHART_ARTIFACT: sensitivity_chart(
                [item.group.name for item in ranking],
                [item.metrics[RANK_BY] for item in ranking],
                result.whole[RANK_BY],
                f"{loaded.recipe.name}: {variant}, one group (--by {options.by}) at a time, quantized by {job.rounding}",
            ),
        }
        if written is not None:
            files[f"recipes/{written[0].name}"] = written[0].read_text(encoding="utf-8")
        files |= _log_file(options.log)
        tracking.log_variant(
            store,
            run,
            metrics=_metrics(result, ranking),
            params={
                "variant": variant,
                "method": method,
                "by": options.by,
                "rounding": job.rounding,
                "groups": str(len(result.groups)),
                "rank_by": RANK_BY,
            },
            tags={"quantlab.groups_computed": str(result.computed)},
            datasets=(),
            files=files,
        )
        store.finish(parent, "FINISHED")
    except BaseException as error:
        status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        with suppress(*tracking.store_errors()):
            store.log_files(run, _log_file(options.log))
        tracking.end_unfinished(store, [run, parent], status, f"{type(error).__name__}: {error}")
        raise
    return SensitivityOutcome(ranking, result, job.rounding, experiment, parent, run, written)


def _log_file(log: Path | None) -> dict[str, str]:
    if log is None or not log.is_file():
        return {}
    return {"logs/sensitivity.log": log.read_text(encoding="utf-8", errors="replace")}


def _metrics(result: Sensitivity, ranking: list[GroupDamage]) -> dict[str, float]:
    metrics = {f"sensitivity/every_group/{figure}": result.whole[f"quality/{figure}"] for figure in LOGGED_FIGURES}
    for rank, item in enumerate(ranking, start=1):
        metrics[f"sensitivity/rank/{item.group.name}"] = float(rank)
        for figure in LOGGED_FIGURES:
            metrics[f"sensitivity/group/{item.group.name}/{figure}"] = item.metrics[f"quality/{figure}"]
    return metrics


def _ranking_json(job: SensitivityJob, result: Sensitivity, ranking: list[GroupDamage]) -> dict:
    return {
        "recipe": job.loaded.recipe.name,
        "variant": job.variant,
        "method": job.loaded.recipe.variant(job.variant).method,
        "by": job.by,
        "rounding": job.rounding,
        "rank_by": RANK_BY,
        "every_group": result.whole,
        "ranking": [
            {
                "rank": rank,
                "group": item.group.name,
                "ignore_pattern": item.group.ignore_pattern,
                "modules": list(item.group.modules),
                "metrics": item.metrics,
            }
            for rank, item in enumerate(ranking, start=1)
        ],
    }


def _write_recipe(
    loaded: LoadedRecipe, variant: str, options: SensitivityOptions, ranking: list[GroupDamage]
) -> tuple[Path, str]:
    """The recipe with a variant keeping the `keep` most damaging groups in BF16, checked like any recipe."""
    import yaml

    target = options.write_recipe
    assert target is not None
    if options.keep >= len(ranking):
        raise bad_input("--keep", "", f"{options.keep} keeps every one of the {len(ranking)} groups: keep fewer")
    raw = next(item for item in yaml.safe_load(loaded.text)["variants"] if item["name"] == variant)
    name = kept_variant_name(variant, options.keep, options.by)
    kept = [item.group for item in ranking[: options.keep]]
    text = recipe_keeping(loaded.text, loaded.path.parent, target.parent, raw, name, kept)
    header = (
        f"# Written by `quantlab sensitivity rank {loaded.path.name} --variant {variant} --by {options.by} "
        f"--keep {options.keep}`: {name} keeps {', '.join(g.name for g in kept)} in BF16.\n"
    )
    return _write_validated(target, header + text, options.cache_root), name


def _write_validated(target: Path, text: str, cache_root: Path) -> Path:
    """`text` at `target` once it passes `quantlab validate` (written aside, renamed into place)."""
    from quantlab.checks import validate

    staging = target.with_name(f".{target.name}.partial")
    staging.write_text(text, encoding="utf-8")
    try:
        validate(staging, cache_root)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    staging.replace(target)
    return target


@dataclass(frozen=True)
class BudgetOutcome:
    mix: Mix
    formats: dict[str, str]  # format -> the variant measured for it (the recipe's own of that method, or one added)
    damage: dict[str, dict[str, float]]  # group -> format -> KL mean with only that group in that format
    bits: dict[str, dict[str, int]]  # group -> format -> stored bits of the group's weights
    runs: dict[str, str]  # format -> its sensitivity run
    weights: dict[str, int]  # group -> its weights
    written: tuple[Path, str] | None = None


def check_formats(
    loaded: LoadedRecipe, formats: Sequence[str], budget_bits: float, options: SensitivityOptions
) -> None:
    """Bad input before any work: every format a registered method (bf16 for 'left unquantized'), two at least."""
    problems = _measure_and_write_problems(loaded, options)
    for name in formats:
        if name not in METHODS:
            known = ", ".join(sorted(METHODS))
            problems.append(
                Problem("--formats", "", f"unknown format '{name}'{did_you_mean(name, METHODS)}; known: {known}")
            )
    # A format the recipe has no variant of is measured with its method's defaults: checked against the model now.
    widths = next((fact for identity, fact in loaded.lookups if "widths_of" in identity), None)
    own = {variant.method for variant in loaded.recipe.variants}
    for name in formats:
        if name in METHODS and name not in own and widths:
            for field, message in METHODS[name].check_model(METHODS[name].Params(), widths):
                why = f"its default params.{field} does not fit the model ({message})"
                problems.append(
                    Problem("--formats", "", f"'{name}': {why}; add a variant of it that fits to the recipe")
                )
    if len(set(formats)) < 2:
        problems.append(Problem("--formats", "", "name two formats or more to choose between (e.g. fp8,bf16)"))
    if not 0 < budget_bits <= 32:
        problems.append(Problem("--budget-bits", "", f"{budget_bits:g} is not a number of bits per weight in (0, 32]"))
    if problems:
        raise BadInput(problems)


def format_variants(loaded: LoadedRecipe, formats: Sequence[str]) -> tuple[LoadedRecipe, dict[str, str]]:
    """The recipe with a variant for each quantizing format it lacks (the method's defaults, named after it), and
    format -> the variant measured for it: the recipe's first of that method, whose params it keeps."""
    from pydantic import TypeAdapter

    from quantlab.recipe import VariantSpec

    recipe, chosen, added = loaded.recipe, {}, []
    names = {variant.name for variant in recipe.variants}
    for name in formats:
        if METHODS[name].rounded(METHODS[name].Params()) is None:
            continue  # bf16: left as the baseline has it
        own = next((variant.name for variant in recipe.variants if variant.method == name), None)
        if own is None:
            own = name if name not in names else f"{name}-budget"
            added.append(TypeAdapter(VariantSpec).validate_python({"name": own, "method": name}))
        chosen[name] = own
    widened = recipe.model_copy(update={"variants": [*recipe.variants, *added]})
    return replace(loaded, recipe=widened), chosen


def run_budget_mix(
    loaded: LoadedRecipe, formats: Sequence[str], budget_bits: float, options: SensitivityOptions, progress: Progress
) -> BudgetOutcome:
    """Each quantizing format's per-group damage (a sensitivity run each, kept and resumable as any), each group's
    stored bits in it read off that format's checkpoint, the best mix under the budget, and the recipe written."""
    widened, measured = format_variants(loaded, formats)
    damage: dict[str, dict[str, float]] = {}
    bits: dict[str, dict[str, int]] = {}
    runs, weights, groups = {}, {}, {}
    for name, variant in measured.items():
        # Each format as the written mix quantizes its part (quantlab.quantize.mixed: the method's rounded()
        # modifiers, calibrated where they observe activations): a preset's own checkpoint is exactly that; AWQ's,
        # GPTQ's or SmoothQuant's is not, their round-to-nearest copy is.
        as_mixed = replace(options, write_recipe=None, rounded=not issubclass(METHODS[name], PresetMethod))
        outcome = run_sensitivity(widened, variant, as_mixed, progress)
        runs[name] = outcome.run_id
        stored, counts = _stored_bits(widened, variant, as_mixed, [item.group for item in outcome.result.groups])
        weights = counts
        groups = {item.group.name: item.group for item in outcome.result.groups}
        for item in outcome.result.groups:
            damage.setdefault(item.group.name, {})[name] = item.metrics[RANK_BY]
            bits.setdefault(item.group.name, {})[name] = stored[item.group.name]
    for name in formats:
        if name not in measured:  # left unquantized: stored as BF16, no damage of its own
            for group in damage:
                damage[group][name], bits[group][name] = 0.0, 16 * weights[group]
    mix = best_mix(damage, bits, weights, budget_bits)
    written = _write_mix(loaded, formats, measured, groups, mix, options) if options.write_recipe else None
    return BudgetOutcome(mix, measured, damage, bits, runs, weights, written)


def _stored_bits(
    loaded: LoadedRecipe, variant: str, options: SensitivityOptions, groups: list[LayerGroup]
) -> tuple[dict[str, int], dict[str, int]]:
    """(group -> stored bits of its modules in the variant's checkpoint, scales and packing included; group -> its
    weights, counted in the baseline's checkpoint: packed formats do not all store the unpacked shape). Both
    checkpoints are those the sensitivity run used, from the cache."""
    from quantlab.models import materialize, pick_device, resolve_source
    from quantlab.stages.quantize import quantize_variant, rounded_variant

    recipe, recipe_dir, cache_root = loaded.recipe, loaded.path.parent, options.cache_root
    device = pick_device(recipe.runtime)
    source = materialize(resolve_source(recipe.model, recipe_dir), cache_root)
    spec = recipe.variant(variant)
    checkpoint = (
        rounded_variant(source, spec, cache_root, device)
        if options.rounded
        else quantize_variant(source, spec, recipe.calibration, recipe_dir, cache_root, device)
    )
    baseline = quantize_variant(
        source, recipe.variant(recipe.baseline), recipe.calibration, recipe_dir, cache_root, device
    )
    stored, weights = _tensor_sizes(checkpoint.path), _tensor_sizes(baseline.path)
    bits, counts = {}, {}
    for group in groups:
        prefixes = tuple(f"{module}." for module in group.modules)
        bits[group.name] = sum(size for name, (size, _) in stored.items() if name.startswith(prefixes))
        counts[group.name] = sum(weights[f"{module}.weight"][1] for module in group.modules)
    return bits, counts


# safetensors' dtype names -> bits per element
_DTYPE_BITS = {"BF16": 16, "F16": 16, "F32": 32, "F64": 64, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8,
               "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "BOOL": 8}  # fmt: skip


def _tensor_sizes(checkpoint: Path) -> dict[str, tuple[int, int]]:
    """Each stored tensor of a checkpoint: (bits, elements), read from the safetensors headers."""
    from safetensors import safe_open

    sizes = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open has no iterator
                tensor = tensors.get_slice(name)
                elements = math.prod(tensor.get_shape())
                sizes[name] = (elements * _DTYPE_BITS[tensor.get_dtype()], elements)
    return sizes


def _write_mix(
    loaded: LoadedRecipe,
    formats: Sequence[str],
    measured: dict[str, str],
    groups: dict[str, LayerGroup],
    mix: Mix,
    options: SensitivityOptions,
) -> tuple[Path, str]:
    """The recipe with the mix as one more variant: with one quantized format, that format's variant keeping the
    other groups in BF16 (params.ignore, served as that format); with more, a `mixed` variant (a compressed-tensors
    config group per format)."""
    import yaml

    used = [fmt for fmt in measured if fmt in mix.chosen.values()]
    if not used:
        raise bad_input("--write-recipe", "", "the best mix keeps every group in BF16: nothing to write")
    target = options.write_recipe
    assert target is not None
    raws = {item["name"]: item for item in yaml.safe_load(loaded.text)["variants"]}
    raw = {fmt: raws.get(measured[fmt], {"name": measured[fmt], "method": fmt}) for fmt in used}
    number = f"{mix.bits_per_weight:.2f}".replace(".", "p")
    if len(used) == 1:
        name = f"{measured[used[0]]}-budget{number}"
        kept = [groups[group] for group, fmt in mix.chosen.items() if fmt not in measured]
        text = recipe_keeping(loaded.text, loaded.path.parent, target.parent, raw[used[0]], name, kept)
    else:
        name = f"mix-budget{number}"
        parts = [(raw[fmt], [groups[g] for g, chosen in mix.chosen.items() if chosen == fmt]) for fmt in used]
        text = recipe_with_variant(loaded.text, loaded.path.parent, target.parent, mixed_variant(name, parts))
    summary = ", ".join(f"{group}: {fmt}" for group, fmt in mix.chosen.items())
    header = (
        f"# Written by `quantlab sensitivity mix {loaded.path.name} --budget-bits ... --formats {','.join(formats)}`: "
        f"{name} ({summary}), {mix.bits_per_weight:.3f} stored bits per weight of the blocks' linear layers.\n"
    )
    return _write_validated(target, header + text, options.cache_root), name
