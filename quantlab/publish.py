"""From a sweep's logged runs to what reviewers and release managers read: frontier, report, decision.

Reads the runs back from MLflow, so `quantlab frontier/report/pick` work on any past sweep as the sweep itself did.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import ClassVar

import yaml

from quantlab import release_card, tracking
from quantlab.decision import Decision, DecisionError, pick
from quantlab.errors import BadInput, bad_input
from quantlab.evaluate.flips import (
    CHANGED_DIR,
    AnswerKey,
    ChangedAnswers,
    DocumentAnswer,
    answers_artifact,
    answers_from_jsonl,
    changed_answers,
    changed_artifact,
    table,
)
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
from quantlab.jobs import BaselineOutputs
from quantlab.metrics import EVAL_PREFIX, Shown, declared_from_tags, shown_in
from quantlab.paired import DocumentScores
from quantlab.policy import Policy, PolicyError
from quantlab.report import (
    DAMAGE_CHART,
    SERVING_CHART,
    Plot,
    decision_figures,
    policy_words,
    render_damage_chart,
    render_html,
    render_markdown,
    render_plots,
    render_serving_chart,
    reviewer_metrics,
)

DRAWN_FIGURES_DIR = "drawn-figures"  # under the cache root: a sweep's figures, kept by what they show


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
    groups: dict[str, Group] = field(default_factory=dict)  # lm-eval group score key -> its leaves and weights
    documents: dict[str, int] = field(default_factory=dict)  # lm-eval leaf task -> the documents it has, where known


def read_sweep(store: tracking.TrackingStore, parent_run_id: str) -> SweepView:
    parent = store.run(parent_run_id)
    # No recipe.yaml: a sweep logged by an older quantlab, defaults apply.
    recipe = yaml.safe_load(store.read_artifact(parent_run_id, "recipe.yaml") or b"") or {}
    runs = tracking.child_runs(store, parent_run_id)
    variants = [_summary(run) for run in runs]
    documents: dict[str, dict[str, DocumentScores]] = {}
    groups: dict[str, Group] = {}
    task_sizes: dict[str, int] = {}
    for run, variant in zip(runs, variants):
        if variant.succeeded and (samples := _samples(store, run.run_id)) is not None:
            documents[variant.name] = samples.documents
            groups |= samples.groups
        if variant.succeeded:  # the most any run scored: adaptive evaluation stops a variant's task early
            for task, count in task_documents(run.params).items():
                task_sizes[task] = max(task_sizes.get(task, 0), count)
    variants.sort(key=lambda v: (not v.is_baseline, v.name))
    settings = FrontierSettings.model_validate(recipe.get("frontier") or {})
    baseline = recipe.get("baseline") or next((v.name for v in variants if v.is_baseline), "")
    source = str((recipe.get("model") or {}).get("source", ""))
    model, noise = model_label(source or parent.experiment_id), paired_noise(variants, documents, groups)
    return SweepView(
        parent_run_id,
        parent.experiment_id,
        variants,
        settings,
        baseline,
        _notes(source),
        model,
        noise,
        groups,
        task_sizes,
    )


def task_documents(params: Mapping[str, str]) -> dict[str, int]:
    """lm-eval leaf task -> the documents it has, from a variant run's `eval.<task>.limit` and
    `eval.<task>.documents` params: known when it ran whole (no limit), or scored fewer than its limit."""
    found = {}
    for name, value in params.items():
        task, dot, setting = name.removeprefix("eval.").rpartition(".")
        if not name.startswith("eval.") or not dot or setting != "documents" or not value.isdigit():
            continue
        limit = params.get(f"eval.{task}.limit", "None")
        if limit == "None" or (limit.isdigit() and int(value) < int(limit)):
            found[task] = int(value)
    return found


def model_label(source: str) -> str:
    """A hub id as written; a file or packaged file by its name (a long path would crowd a title)."""
    if source.startswith(("/", ".", "~", "pkg://")) or source.endswith(".gguf"):
        return Path(source.removeprefix("pkg://")).name
    return source


def _samples(store: tracking.TrackingStore, run_id: str) -> BaselineOutputs | None:
    """The run's samples.json in this version's format; None otherwise (its noise comes from the logged paired figures)."""
    with suppress(ValueError, KeyError, TypeError, AttributeError):  # absent, not JSON, another version or format
        return BaselineOutputs.from_samples(json.loads(store.read_artifact(run_id, tracking.SAMPLES_ARTIFACT)), None)
    return None


def _summary(run: tracking.RunRecord) -> VariantSummary:
    tags = run.tags
    return VariantSummary(
        name=run.variant,
        method=tags.get(tracking.METHOD, "?"),
        succeeded=run.status == "FINISHED",
        metrics=dict(run.metrics),
        tags={key: value for key, value in tags.items() if key.startswith("quantlab.")},
        is_baseline=tags.get(tracking.BASELINE) == "true",
        declared=declared_from_tags(tags),
    )


def _notes(source: str) -> tuple[str, ...]:
    if not source.endswith(".gguf"):
        return ()
    return (
        f"The baseline comes from a GGUF file ({source}): its weights are that file's quantized values dequantized, "
        "so 'BF16' means BF16 of the dequantized GGUF, not of the original full-precision release.",
    )


def frontiers(view: SweepView) -> Frontiers:
    return compute_frontiers(view.variants, view.settings, view.noise)


def decide(view: SweepView, policy: Policy | None = None, objective: str | None = None) -> Decision:
    """`quantlab pick`: an explicit policy (the CLI's flags), or the recipe's default policy. Flags name limits
    only: a one-sided level, power or control of the candidates the explicit policy does not set comes from the
    recipe's policy."""
    declared = merged_declared(view.variants)
    recipe_policy = view.settings.default_policy
    if policy is not None:
        inherited = {"one_sided_alpha", "power", "candidates", "sequence"} - policy.model_fields_set
        policy = policy.model_copy(update={name: getattr(recipe_policy, name) for name in inherited})
    try:
        axis = Axis.of(objective, declared=declared) if objective else view.settings.objective_axis(declared)
        return pick(
            view.variants, view.baseline, policy or recipe_policy, axis, groups=view.groups, documents=view.documents
        )
    except PolicyError as error:  # names the recipe's field, or the policy field behind a CLI flag
        where = ("recipe", error.recipe_field) if policy is None else ("policy", error.field)
        raise bad_input(*where, str(error)) from None
    except (DecisionError, ValueError) as error:
        raise bad_input("--objective" if objective else "sweep", "", str(error)) from None


def recipe_decision(view: SweepView) -> Decision | None:
    """The decision under the recipe's own policy; None when it cannot be applied (the report then recommends
    nothing, and `quantlab pick` says why)."""
    with suppress(BadInput):
        return decide(view)
    return None


def render_artifacts(
    view: SweepView, out_dir: Path, decision: Decision | None = None, drawn_cache: Path | None = None
) -> list[Path]:
    """frontier.json, frontier.png, frontier.html, report.md, plots/ (PNG and SVG per frontier), and serving.png and
    damage.png where the sweep has their figures; `decision` defaults to the recipe's. `drawn_cache`: where drawn
    figures are kept by what they show."""
    out_dir.mkdir(parents=True, exist_ok=True)
    found = frontiers(view)
    decision = decision or recipe_decision(view)
    drawn = drawn_figures(view, found, out_dir, drawn_cache)
    (out_dir / "frontier.json").write_text(frontier_json(found, indent=2))
    render_html(
        found,
        drawn.plots,
        out_dir / "frontier.html",
        variants=view.variants,
        model=view.model,
        decision=decision,
        serving_chart=drawn.serving,
        damage_chart=drawn.damage,
    )
    (out_dir / "report.md").write_text(render_markdown(view.variants, found, decision, view.notes, model=view.model))
    return [out_dir / name for name in ("frontier.json", "frontier.png", "frontier.html", "report.md")] + drawn.files


@dataclass(frozen=True)
class Drawn:
    """A sweep's figures: the frontier plots, and the charts it has data for (None where it has none)."""

    plots: list[Plot]
    serving: Path | None
    damage: Path | None
    CHARTS: ClassVar[tuple[str, ...]] = ("serving", "damage")  # the fields above that hold a chart

    @property
    def charts(self) -> dict[str, Path | None]:
        return {name: getattr(self, name) for name in self.CHARTS}

    @property
    def files(self) -> list[Path]:
        charts = [path for path in self.charts.values() if path is not None]
        return [path for plot in self.plots for path in (plot.png, plot.svg)] + charts


def _charted(key: str) -> bool:
    """A figure the serving chart or the damage chart draws (its paired interval included)."""
    return key.startswith("cost/serving/") or "/on_policy/" in key or "/ctx" in key


def drawn_figures(view: SweepView, found: Frontiers, out_dir: Path, cache: Path | None) -> Drawn:
    """The frontier plots, the serving chart and the damage chart, drawn into `out_dir`, or copied from `cache`
    where the same figures were drawn before: an unchanged re-run publishes the same figures, and drawing its ~25
    took most of its time. They are kept under a hash of everything they show (frontier.json holds every point,
    interval and exclusion the plots draw; the charts draw the variants' figures that `_charted` names) and of the
    code that draws them."""
    import hashlib
    import shutil

    from quantlab import report
    from quantlab.serving import chart

    def draw() -> Drawn:
        return Drawn(
            render_plots(found, out_dir, view.model),
            render_serving_chart(view.variants, out_dir / SERVING_CHART, view.model),
            render_damage_chart(view.variants, out_dir / DAMAGE_CHART, view.model),
        )

    if cache is None:
        return draw()
    charted = {v.name: {k: x for k, x in v.metrics.items() if _charted(k)} for v in view.variants}
    shown = json.dumps([frontier_json(found), view.model, charted], sort_keys=True, default=str).encode()
    code = Path(report.__file__).read_bytes() + Path(chart.__file__).read_bytes()
    kept = cache / hashlib.sha256(shown + code).hexdigest()[:24]
    listing = kept / "figures.json"  # written last: a folder without it is incomplete
    if listing.is_file():
        names = json.loads(listing.read_text())
        shutil.copytree(kept / "files", out_dir, dirs_exist_ok=True)
        plots = [Plot(out_dir / png, out_dir / svg) for png, svg in names["plots"]]
        return Drawn(plots, *(out_dir / names[name] if names.get(name) else None for name in Drawn.CHARTS))
    drawn = draw()
    with suppress(OSError):  # a cache that cannot be written only costs the next re-run its drawing
        scratch = Path(tempfile.mkdtemp(prefix=".drawing-", dir=_made(cache)))
        for path in [*drawn.files, out_dir / "frontier.png"]:
            (scratch / "files" / path.relative_to(out_dir)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, scratch / "files" / path.relative_to(out_dir))
        relative = [[str(plot.png.relative_to(out_dir)), str(plot.svg.relative_to(out_dir))] for plot in drawn.plots]
        charts = {name: str(path.relative_to(out_dir)) if path else None for name, path in drawn.charts.items()}
        (scratch / "figures.json").write_text(json.dumps({"plots": relative, **charts}))
        if not listing.is_file():
            shutil.rmtree(kept, ignore_errors=True)
            scratch.rename(kept)
        shutil.rmtree(scratch, ignore_errors=True)
    return drawn


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def frontier_json(found: Frontiers, indent: int | None = None) -> str:
    return json.dumps(json_safe(frontiers_to_dict(found)), indent=indent, allow_nan=False)


def json_safe(value):
    """JSON has no NaN: an undefined figure (e.g. recovery against a zero baseline) becomes null."""
    return json.loads(json.dumps(value), parse_constant=lambda _: None)


def publish_sweep(store: tracking.TrackingStore, parent_run_id: str, drawn_cache: Path | None = None) -> SweepView:
    """Tag each variant run with quantlab.on_frontier and its verdict, put the decision on the parent (tags, the
    chosen variant's figures, the sweep's datasets, the report as its description) with the artifacts, and keep
    the experiment's runs-table view."""
    view = read_sweep(store, parent_run_id)
    on_front = frontiers(view).on_front
    for run in tracking.child_runs(store, parent_run_id):
        store.log_values(run.run_id, tags={tracking.ON_FRONTIER: str(run.variant in on_front).lower()})
    decision = recipe_decision(view)
    tracking.log_decision(
        store,
        parent_run_id,
        tags={
            tracking.CHOSEN: (decision.chosen if decision else None) or "none",
            tracking.POLICY: policy_words(decision),
            **({tracking.METRICS_OF: decision.chosen} if decision and decision.chosen else {}),
        },
        verdicts={v.name: v.status.words for v in decision.verdicts} if decision else {},
        metrics=decision_figures(decision, view.variants),
        columns=[f"tags.{tracking.CHOSEN}", f"tags.{tracking.VERDICT}", *reviewer_metrics(decision, view.variants)],
    )
    with tempfile.TemporaryDirectory() as scratch:
        artifacts = render_artifacts(view, Path(scratch), decision, drawn_cache)
        files = {str(path.relative_to(scratch)): path.read_bytes() for path in artifacts}
    store.log_files(parent_run_id, files)  # relative names: plots/ stays a folder
    # The run page shows its description (this tag) as Markdown: the report, where reviewers look, then a link to
    # each variant's changed answers.
    report = files["report.md"].decode("utf-8")
    links = log_changed_answers(store, view)
    store.log_values(parent_run_id, tags={tracking.NOTE: tracking.run_description(report, "report.md", links)})
    return view


CHANGED_TAG = "quantlab.changed_answers/"  # + task, on a variant run: what its changed-answers table holds, or why none


@dataclass(frozen=True)
class TaskChanges:
    """One task's changed answers of a variant against the baseline, or why there are none to show (`note`)."""

    task: str
    changed: ChangedAnswers | None = None
    note: str = ""

    def words(self) -> str:
        return self.changed.words() if self.changed is not None else f"no table: {self.note}"


def changes_between(
    store: tracking.TrackingStore,
    baseline: tracking.RunRecord,
    run: tracking.RunRecord,
    read: AnswersReader | None = None,
) -> list[TaskChanges]:
    """Each lm-eval leaf task either run scored (its `eval.<task>.documents` param), paired from their answers/
    artifacts; a task whose per-document answers either run lacks says so, never an empty table."""
    read = read or answers_reader(store)
    tasks = sorted({*task_scored(baseline.params), *task_scored(run.params)})
    found = []
    for task in tasks:
        base, mine = read(baseline.run_id, task), read(run.run_id, task)
        if base is None or mine is None:
            which = f"the baseline run ({baseline.variant})" if base is None else "this run"
            found.append(TaskChanges(task, note=f"{which} logged no per-document answers for it"))
            continue
        changed = changed_answers(task, base, mine)
        if changed.paired == 0:
            note = "no document that both runs scored right or wrong (its primary score is not 0/1 per document)"
            found.append(TaskChanges(task, note=note))
            continue
        found.append(TaskChanges(task, changed))
    return found


def task_scored(params: Mapping[str, str]) -> list[str]:
    """The lm-eval leaf tasks a variant run scored, from its `eval.<task>.documents` params."""
    return [
        name.removeprefix("eval.").removesuffix(".documents")
        for name in params
        if name.startswith("eval.") and name.endswith(".documents") and name.count(".") >= 2
    ]


AnswersReader = Callable[[str, str], "dict[AnswerKey, DocumentAnswer] | None"]  # (run id, task) -> its answers


def answers_reader(store: tracking.TrackingStore) -> AnswersReader:
    """Reads a run's answers/<task>.jsonl once (every variant is paired with the same baseline); None where the run
    has none, or what it has is not a run's answers."""
    read: dict[tuple[str, str], dict[AnswerKey, DocumentAnswer] | None] = {}

    def answers(run_id: str, task: str) -> dict[AnswerKey, DocumentAnswer] | None:
        if (run_id, task) not in read:
            text = store.read_artifact(run_id, answers_artifact(task))
            read[run_id, task] = None
            with suppress(ValueError, KeyError, TypeError):  # absent (a run of an older quantlab), or not answers
                read[run_id, task] = answers_from_jsonl(text.decode("utf-8")) if text is not None else None
        return read[run_id, task]

    return answers


DESCRIPTION_LINKS = 2000  # characters of per-task links the parent's description takes before a variant gets one link


def log_changed_answers(store: tracking.TrackingStore, view: SweepView) -> str:
    """Each finished variant's changed answers per task on its run (changed_answers/<task>.json, an MLflow table, and
    .csv; the tag quantlab.changed_answers/<task> in words), and the parent description's section linking them ("" for
    a sweep without lm-eval tasks): a link per task, or where that would crowd the description (a group's dozens of
    leaves), one per variant to its changed_answers/ folder."""
    runs = {run.variant: run for run in tracking.child_runs(store, view.parent_run_id)}
    if not any(task_scored(run.params) for run in runs.values()):
        return ""
    baseline, read = runs.get(view.baseline), answers_reader(store)
    detailed, compact = [], []
    for name, run in sorted(runs.items()):
        if name == view.baseline:
            continue
        if baseline is None or baseline.status != "FINISHED" or run.status != "FINISHED":
            failed = name if run.status != "FINISHED" else f"the baseline ({view.baseline})"
            detailed.append(line := f"- **{name}**: none, {failed} did not finish")
            compact.append(line)
            continue
        found = changes_between(store, baseline, run, read)
        if not found:
            continue
        tables = {f.task: table(f.changed, view.baseline, name) for f in found if f.changed is not None}
        tracking.log_tables(store, run.run_id, {changed_artifact(task, "json"): t for task, t in tables.items()})
        store.log_files(run.run_id, {changed_artifact(task, "csv"): _csv(*t) for task, t in tables.items()})
        store.log_values(run.run_id, tags={CHANGED_TAG + f.task: f.words() for f in found})
        link = partial(tracking.artifact_link, run.experiment_id, run.run_id)
        parts = [
            f"[{f.task}]({link(changed_artifact(f.task, 'csv'))}): {f.words()}"
            if f.task in tables
            else f"{f.task}: {f.words()}"
            for f in found
        ]
        detailed.append(f"- **{name}**: " + "; ".join(parts))
        shown = [f.changed for f in found if f.changed is not None]
        changed, paired = sum(len(c.rows) for c in shown), sum(c.paired for c in shown)
        missing = (
            f"; {len(found) - len(shown)} tasks without a table (the run's tags say why)"
            if len(shown) < len(found)
            else ""
        )
        folder = f"[{changed} of {paired} documents changed in {len(shown)} tasks]({link(CHANGED_DIR)})"
        compact.append(f"- **{name}**: {folder}{missing}")
    lines = detailed if sum(map(len, detailed)) <= DESCRIPTION_LINKS else compact
    return f"\n\n## Changed answers (against {view.baseline})\n\n" + "\n".join(lines) + "\n"


def _csv(columns: list[str], rows: list[list]) -> str:
    import csv
    import io

    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(columns)
    writer.writerows(rows)
    return text.getvalue()


# Metrics of the chosen run carried onto its registered model version, for the registry's own page.
_REGISTRY_SUMMARY = (EVAL_PREFIX, *shown_in(Shown.REGISTRY))  # each with its companions (_stderr, /ci95_*, _bs<N>)


def record_pick(
    store: tracking.TrackingStore,
    view: SweepView,
    decision: Decision,
    *,
    register: bool = False,
    alias: str = "production",
    model_name: str | None = None,
    command: str = "",
) -> dict:
    """`quantlab pick`'s record, logged on the parent run as decisions/pick-<time>.json; with `register`,
    the chosen checkpoint registered under `alias` (model name: the experiment's, unless given), with its release
    card (`command`: the pick as typed, the card's last step to reproduce it)."""
    record = json_safe(decision.to_dict())
    if decision.chosen and register:
        runs = tracking.child_runs(store, view.parent_run_id)
        run = next(r for r in runs if r.variant == decision.chosen)
        summary = {key: str(value) for key, value in run.metrics.items() if key.startswith(_REGISTRY_SUMMARY)}
        name = model_name or store.experiments()[view.experiment]
        version, created = tracking.register_checkpoint(store, name, alias, run, summary)
        card = write_release_card(store, view, decision, run, runs, (name, version, alias), command)
        record["registered"] = {
            "model": name,
            "version": version,
            "alias": alias,
            "new_version": created,
            "release_card": card,
        }
    store.log_files(view.parent_run_id, {f"decisions/pick-{int(time.time())}.json": json.dumps(record, indent=2)})
    return record


RELEASE_CARDS = "release-cards"  # on the sweep's parent run: <model>-v<version>.json and .md


def write_release_card(
    store: tracking.TrackingStore,
    view: SweepView,
    decision: Decision,
    run: tracking.RunRecord,
    runs: list[tracking.RunRecord],
    registered: tuple[str, str, str],
    command: str,
) -> str:
    """The chosen version's release card: JSON and Markdown artifacts on the sweep's parent run, the Markdown as the
    version's description (what the registry's page shows), the JSON's path as its tag; returns that path."""
    name, version, alias = registered
    parent = store.run(view.parent_run_id)
    recipe_text = (store.read_artifact(view.parent_run_id, "recipe.yaml") or b"").decode("utf-8")
    # The engine against itself is measured on the baseline's second served pass: the chosen run's own, if it has one.
    baseline = next((r for r in runs if r.variant == view.baseline), run)
    floor = run if any(key.startswith(release_card.ENGINE_FLOOR) for key in run.metrics) else baseline
    recipe_path = parent.params.get("recipe.path", "")
    sweep = f"quantlab sweep {recipe_path or 'RECIPE'} --tracking-uri {tracking.shown_uri(store.uri)}"
    card = release_card.build_card(
        decision,
        run,
        model=name,
        version=version,
        alias=alias,
        recipe_path=recipe_path,
        recipe_text=recipe_text,
        floor=floor,
        commands=[sweep, *([command] if command else [])],
    )
    stem = f"{RELEASE_CARDS}/{tracking.safe_key(name).replace('/', '_')}-v{version}"
    link = tracking.artifact_link(view.experiment, view.parent_run_id, f"{stem}.json")
    markdown = release_card.render_markdown(card)
    store.log_files(view.parent_run_id, {f"{stem}.json": card.to_json(), f"{stem}.md": markdown})
    tail = f"\nThe card as JSON: [{stem}.json]({link}), on the sweep's run.\n"
    description = tracking.run_description(markdown, f"{stem}.md", tail, limit=tracking.VERSION_DESCRIPTION)
    uri = f"runs:/{view.parent_run_id}/{stem}.json"
    store.describe_version(name, version, description, {tracking.RELEASE_CARD: uri})
    return uri
