"""`quantlab sensitivity` in MLflow: a parent run of its own (role `sensitivity-sweep`, so that a sweep's tools never
take it for a sweep) holding one run of role `sensitivity` with each group's figures, the ranking as JSON and a bar
chart; and, when asked, a copy of the recipe with a variant that keeps the most damaging groups in BF16."""

from __future__ import annotations

import json
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from quantlab import tracking
from quantlab.errors import BadInput, Problem, bad_input, did_you_mean
from quantlab.logbook import mark_dead_sweeps, sweep_process_tags
from quantlab.quantize import METHODS
from quantlab.recipe import LoadedRecipe
from quantlab.report import sensitivity_chart
from quantlab.sensitivity.groups import (
    RANK_BY,
    By,
    GroupDamage,
    kept_variant_name,
    ranked,
    recipe_keeping,
)
from quantlab.sensitivity.probe import Progress, Sensitivity, SensitivityJob, measure_sensitivity, sensitivity_key

LOGGED_FIGURES = ("kld_mean", "kld_p99", "top1_agreement", "ppl")  # per group, of the quality/* a group gets
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
    problems = []
    if not recipe.quality.enabled:
        why = "sensitivity compares each group with the baseline's reference pass over the quality corpus"
        problems.append(Problem(shown, "quality.enabled", f"is false: {why}"))
    if (target := options.write_recipe) is not None:
        if not target.parent.is_dir():
            problems.append(Problem("--write-recipe", "", f"no such directory: {target.parent}"))
        elif target.resolve() == loaded.path:
            problems.append(Problem("--write-recipe", "", "is the recipe itself: write the copy elsewhere"))
    if problems:
        raise BadInput(problems)


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

    from quantlab.checks import validate

    target = options.write_recipe
    assert target is not None
    if options.keep >= len(ranking):
        raise bad_input("--keep", "", f"{options.keep} keeps every one of the {len(ranking)} groups: keep fewer")
    raw = next(item for item in yaml.safe_load(loaded.text)["variants"] if item["name"] == variant)
    name = kept_variant_name(variant, options.keep, options.by)
    kept = [item.group for item in ranking[: options.keep]]
    text = recipe_keeping(loaded.text, loaded.path.parent, target.parent, raw, name, kept)
    header = (
        f"# Written by `quantlab sensitivity {loaded.path.name} --variant {variant} --by {options.by} "
        f"--keep {options.keep}`: {name} keeps {', '.join(g.name for g in kept)} in BF16.\n"
    )
    staging = target.with_name(f".{target.name}.partial")
    staging.write_text(header + text, encoding="utf-8")
    try:
        validate(staging, options.cache_root)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    staging.replace(target)
    return target, name
