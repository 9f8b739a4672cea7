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
from quantlab.decision import Constraints, Decision, DecisionError, pick
from quantlab.errors import BadInput, Problem
from quantlab.metrics import declared_from_tags
from quantlab.frontier import FrontierResult, FrontierSettings, VariantSummary, compute_frontiers, frontiers_to_dict, on_frontier_names
from quantlab.report import render_html, render_markdown, render_png


@dataclass(frozen=True)
class SweepView:
    parent_run_id: str
    experiment: str
    variants: list[VariantSummary]
    settings: FrontierSettings
    baseline: str
    notes: tuple[str, ...]


def read_sweep(store: tracking.Store, parent_run_id: str) -> SweepView:
    parent = store.client.get_run(parent_run_id)
    recipe = _logged_recipe(store, parent_run_id)
    variants = [_summary(run) for run in tracking.child_runs(store, parent_run_id)]
    variants.sort(key=lambda v: (not v.is_baseline, v.name))
    settings = FrontierSettings.model_validate(recipe.get("frontier") or {})
    baseline = recipe.get("baseline") or next((v.name for v in variants if v.is_baseline), "")
    return SweepView(parent_run_id, parent.info.experiment_id, variants, settings, baseline, _notes(recipe))


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
        return (f"The baseline comes from a GGUF file ({source}): its weights are that file's "
                "quantized values dequantized, so 'BF16' means BF16 of the dequantized GGUF, "
                "not of the original full-precision release.",)
    return ()


def frontiers(view: SweepView) -> tuple[FrontierResult, ...]:
    return compute_frontiers(view.variants, view.settings)


def decide(view: SweepView, constraints: Constraints | None = None, objective: str | None = None) -> Decision:
    """`quantlab pick`: explicit constraints, or the recipe's default policy."""
    from quantlab.frontier import Axis

    try:
        axis = Axis.of(objective) if objective else view.settings.objective_axis()
        chosen_constraints = constraints or Constraints.from_policy(view.settings.default_policy)
        return pick(view.variants, view.baseline, chosen_constraints, axis)
    except (DecisionError, ValueError) as error:
        raise BadInput([Problem("--objective" if objective else "sweep", "", str(error))]) from None


def render_artifacts(view: SweepView, out_dir: Path) -> dict[str, Path]:
    """frontier.json, frontier.png, frontier.html and report.md for a sweep, into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = frontiers(view)
    try:
        decision = decide(view)
    except BadInput:
        decision = None
    files = {
        "frontier.json": out_dir / "frontier.json",
        "frontier.png": render_png(results, out_dir / "frontier.png", title=f"{view.baseline} and its variants"),
        "frontier.html": render_html(results, out_dir / "frontier.html", variants=view.variants),
        "report.md": out_dir / "report.md",
    }
    files["frontier.json"].write_text(json.dumps(json_safe(frontiers_to_dict(results)), indent=2, allow_nan=False))
    files["report.md"].write_text(render_markdown(view.variants, results, decision, view.notes))
    return files


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
    on_front = on_frontier_names(frontiers(view))
    for run in tracking.child_runs(store, parent_run_id):
        name = run.data.tags.get(tracking.VARIANT, run.info.run_name)
        tracking.log_values(store, run.info.run_id, tags={tracking.ON_FRONTIER: str(name in on_front).lower()})
    with tempfile.TemporaryDirectory() as scratch:
        files = render_artifacts(view, Path(scratch))
        for path in files.values():
            store.client.log_artifact(parent_run_id, str(path))
        # The run page shows its description (this tag) as Markdown: the report, where reviewers look.
        tracking.log_values(store, parent_run_id, tags={tracking.NOTE: files["report.md"].read_text()[:60000]})
    return view
