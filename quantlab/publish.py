"""From a sweep's logged runs to what reviewers and release managers read: frontier, report, decision.

Reads the variant runs back from MLflow (so `quantlab frontier/report/pick` work on any past
sweep exactly as the sweep itself did), computes with the pure modules, writes artifacts.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from quantlab import tracking
from quantlab.decision import Decision, DecisionError, pick
from quantlab.errors import BadInput, Problem
from quantlab.frontier import (
    Axis,
    Frontiers,
    FrontierSettings,
    Group,
    Noise,
    VariantSummary,
    compute_frontiers,
    frontiers_to_dict,
    merged_declared,
    paired_noise,
)
from quantlab.metrics import declared_from_tags
from quantlab.paired import DocumentScores, documents_from_json
from quantlab.policy import Policy, PolicyError
from quantlab.report import render_html, render_markdown, render_plots

SAMPLES_ARTIFACT = "samples.json"
SAMPLES_VERSION = 2  # per-document scores of every metric, and the groups' leaves and weights


@dataclass(frozen=True)
class SweepView:
    parent_run_id: str
    experiment: str
    variants: list[VariantSummary]
    settings: FrontierSettings
    baseline: str
    notes: tuple[str, ...]
    model: str  # the recipe's model.source, as figures and the report name it
    noise: Noise  # paired comparisons between variants, from their runs' per-document scores


def read_sweep(store: tracking.Store, parent_run_id: str) -> SweepView:
    parent = store.client.get_run(parent_run_id)
    recipe = _logged_recipe(store, parent_run_id)
    runs = tracking.child_runs(store, parent_run_id)
    variants = [_summary(run) for run in runs]
    documents: dict[str, dict[str, DocumentScores]] = {}
    groups: dict[str, Group] = {}
    for run, variant in zip(runs, variants):
        samples = _samples(store, run.info.run_id) if variant.succeeded else None
        if samples is not None:
            documents[variant.name] = documents_from_json(samples.get("documents") or {})
            groups.update({key: Group(tuple(g["leaves"]), tuple(g["weights"])) for key, g in (samples.get("groups") or {}).items()})
    variants.sort(key=lambda v: (not v.is_baseline, v.name))
    settings = FrontierSettings.model_validate(recipe.get("frontier") or {})
    baseline = recipe.get("baseline") or next((v.name for v in variants if v.is_baseline), "")
    model = model_label(str((recipe.get("model") or {}).get("source", "")) or parent.info.experiment_id)
    return SweepView(parent_run_id, parent.info.experiment_id, variants, settings, baseline, _notes(recipe),
                     model, paired_noise(variants, documents, groups))


def model_label(source: str) -> str:
    """A hub id as written; a file or packaged file by its name (a long path would crowd a title)."""
    if source.startswith(("/", ".", "~", "pkg://")) or source.endswith(".gguf"):
        return Path(source.removeprefix("pkg://")).name
    return source


def _samples(store: tracking.Store, run_id: str) -> dict | None:
    """The run's samples.json when it is version 2 (per-document scores); None otherwise."""
    with tempfile.TemporaryDirectory() as scratch:
        try:
            data = json.loads(Path(store.client.download_artifacts(run_id, SAMPLES_ARTIFACT, scratch)).read_text())
        except Exception:  # noqa: BLE001 - no samples (an older run): its noise comes from logged figures
            return None
    return data if isinstance(data, dict) and data.get("version") == SAMPLES_VERSION else None


def _summary(run) -> VariantSummary:
    tags = run.data.tags
    return VariantSummary(
        name=tags.get(tracking.VARIANT, run.info.run_name),
        method=tags.get(tracking.METHOD, "?"),
        succeeded=run.info.status == "FINISHED",
        metrics=dict(run.data.metrics),
        tags={key: value for key, value in tags.items() if key.startswith("quantlab.")},
        is_baseline=tags.get("quantlab.baseline") == "true",
        declared=declared_from_tags(tags),
    )


def _logged_recipe(store: tracking.Store, run_id: str) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        try:
            path = store.client.download_artifacts(run_id, "recipe.yaml", scratch)
        except Exception:  # noqa: BLE001 - a sweep logged by an older quantlab: defaults apply
            return {}
        return yaml.safe_load(Path(path).read_text()) or {}


def _notes(recipe: dict) -> tuple[str, ...]:
    source = str((recipe.get("model") or {}).get("source", ""))
    if source.endswith(".gguf"):
        return ((f"The baseline comes from a GGUF file ({source}): its weights are that file's "
                 "quantized values dequantized, so 'BF16' means BF16 of the dequantized GGUF, "
                 "not of the original full-precision release."),)
    return ()


def frontiers(view: SweepView) -> Frontiers:
    return compute_frontiers(view.variants, view.settings, view.noise)


def decide(view: SweepView, policy: Policy | None = None, objective: str | None = None) -> Decision:
    """`quantlab pick`: an explicit policy (the CLI's flags), or the recipe's default policy."""
    declared = merged_declared(view.variants)
    try:
        axis = Axis.of(objective, declared=declared) if objective else view.settings.objective_axis(declared)
        return pick(view.variants, view.baseline, policy or view.settings.default_policy, axis)
    except PolicyError as error:  # names the recipe's field, or the policy field behind a CLI flag
        raise BadInput([Problem("recipe" if policy is None else "policy", error.recipe_field if policy is None else error.field,
                                str(error))]) from None
    except (DecisionError, ValueError) as error:
        raise BadInput([Problem("--objective" if objective else "sweep", "", str(error))]) from None


def render_artifacts(view: SweepView, out_dir: Path) -> list[Path]:
    """frontier.json, frontier.png, frontier.html, report.md and plots/ (PNG and SVG per frontier)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    found = frontiers(view)
    try:
        decision = decide(view)
    except BadInput:
        decision = None
    plots = render_plots(found, out_dir, view.model)
    (out_dir / "frontier.json").write_text(json.dumps(json_safe(frontiers_to_dict(found)), indent=2, allow_nan=False))
    render_html(found, plots, out_dir / "frontier.html", variants=view.variants, model=view.model)
    (out_dir / "report.md").write_text(render_markdown(view.variants, found, decision, view.notes, model=view.model))
    return [out_dir / name for name in ("frontier.json", "frontier.png", "frontier.html", "report.md")] + [
        path for plot in plots for path in (plot.png, plot.svg)]


def json_safe(value):
    """JSON has no NaN: an undefined figure (e.g. recovery against a zero baseline) becomes null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def publish_sweep(store: tracking.Store, parent_run_id: str) -> SweepView:
    """Tag each variant run with quantlab.on_frontier and attach the four artifacts to the parent."""
    view = read_sweep(store, parent_run_id)
    on_front = frontiers(view).on_front
    for run in tracking.child_runs(store, parent_run_id):
        name = run.data.tags.get(tracking.VARIANT, run.info.run_name)
        tracking.log_values(store, run.info.run_id, tags={tracking.ON_FRONTIER: str(name in on_front).lower()})
    with tempfile.TemporaryDirectory() as scratch:
        render_artifacts(view, Path(scratch))
        store.client.log_artifacts(parent_run_id, scratch)  # keeps plots/ as a folder
        # The run page shows its description (this tag) as Markdown: the report, where reviewers look.
        tracking.log_values(store, parent_run_id, tags={tracking.NOTE: (Path(scratch) / "report.md").read_text()[:60000]})
    return view
