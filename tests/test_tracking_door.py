"""Sweep bookkeeping, publish and pick through quantlab.tracking's door, without a model.

Every test runs twice: on the in-memory fake (tests/memory_store.py) and on a real MLflow store
in SQLite, so the fake stays faithful to what the sweep relies on (newest first, tags, artifacts,
datasets, registry). The end-to-end sweeps in test_sweep.py / test_resilience.py cover the rest.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml
from memory_store import MemoryStore

from quantlab import publish, tracking
from quantlab.executors import LocalExecutor
from quantlab.jobs import BaselineOutputs
from quantlab.logbook import HOST, PID, PID_STARTED, REFERENCE_DIR, Logbook, mark_dead_sweeps
from quantlab.metrics import Declared, Scale, declared_tags, paired_key
from quantlab.models import ModelSource
from quantlab.paired import Aggregation, DocumentScores, compare
from quantlab.plan import Action, PlannedVariant, SweepPlan
from quantlab.recipe import LoadedRecipe, Recipe
from quantlab.sweep import Dispatch, SweepOptions, SweepOutcome
from quantlab.tracking import SAMPLES_ARTIFACT
from recipes import tiny_recipe

MMLU = "eval/mmlu_dev/acc"
MMLU_DATA = tracking.DatasetRecord("mmlu_dev", "4935ca6785085dfa", "lm-eval", "")


@pytest.fixture(params=["memory", "mlflow"])
def store(request, tmp_path) -> tracking.TrackingStore:
    if request.param == "memory":
        return MemoryStore()
    return tracking.open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")


class Recorder:
    """A SweepDisplay that remembers what it was told."""

    def __init__(self):
        self.finished: list[tuple[str, bool]] = []

    def sweep_started(self, experiment, run_id, plan):
        pass

    def stage(self, variant, stage):
        pass

    def variant_finished(self, variant, result, failure, reused=""):
        self.finished.append((variant, bool(reused)))

    def note(self, variant, text):
        pass


def _loaded(tmp_path: Path, variants: list[dict]) -> LoadedRecipe:
    recipe = tiny_recipe(tmp_path, variants=variants)
    return LoadedRecipe(tmp_path / "recipe.yaml", Recipe.model_validate(recipe), yaml.safe_dump(recipe))


def _copying(store, tmp_path, experiment, variants, keys) -> Dispatch:
    """A sweep whose plan copies every variant from the finished run of its run key (`keys`: variant -> run key)."""
    finished = tracking.finished_runs(store, experiment, set(keys.values()))
    planned = tuple(
        PlannedVariant(name, key, f"checkpoint-{key}", tmp_path / name, Action.COPY, finished[key])
        for name, key in keys.items()
    )
    source = ModelSource("local_dir", str(tmp_path), None, None, False, "dir:tiny")
    plan = SweepPlan(_loaded(tmp_path, variants), source, tmp_path / "cache", False, planned)
    parent = tracking.start_sweep(store, experiment, "sweep tiny", {})
    display = Recorder()
    log = Logbook(store, plan, 300.0, display.note, experiment, parent)
    options = SweepOptions(tracking_uri=store.uri, cache_root=tmp_path / "cache")
    executor = LocalExecutor()  # never asked: every variant is copied
    return Dispatch(plan, options, log, display, SweepOutcome(experiment, parent), tmp_path, executor)


def _finished_variant(store, experiment, parent, name, key, status="FINISHED") -> str:
    run = tracking.start_variant(store, experiment, parent, name, "fp8", baseline=name == "bf16", run_key=key)
    store.finish(run, status)
    return run


def test_finished_runs_finds_the_newest_finished_run_of_each_key(store):
    experiment = store.experiment_id("tiny")
    parent = tracking.start_sweep(store, experiment, "sweep tiny", {})
    _finished_variant(store, experiment, parent, "fp8", "A")
    newest = _finished_variant(store, experiment, parent, "fp8", "A")
    _finished_variant(store, experiment, parent, "fp8", "A", status="FAILED")  # newer, but failed
    _finished_variant(store, experiment, parent, "awq", "B", status="RUNNING")
    other = tracking.start_sweep(store, experiment, "sweep", {tracking.RUN_KEY: "C"})  # a sweep run is no variant
    store.finish(other, "FINISHED")
    _finished_variant(store, experiment, parent, "bf16", "D")  # a key nobody asked for

    found = tracking.finished_runs(store, experiment, {"A", "B", "C"})

    assert {key: run.run_id for key, run in found.items()} == {"A": newest}
    assert found["A"].variant == "fp8" and found["A"].status == "FINISHED"


def _previous_sweep(store, experiment, tmp_path) -> dict[str, str]:
    """A finished sweep of bf16 and fp8, as a real one logs them: figures, params, tags, datasets, artifacts."""
    parent = tracking.start_sweep(store, experiment, "sweep tiny", {})
    runs = {}
    for name, key, acc in (("bf16", "K-bf16", 0.6), ("fp8", "K-fp8", 0.59)):
        run = tracking.start_variant(store, experiment, parent, name, name, baseline=name == "bf16", run_key=key)
        samples = BaselineOutputs(None, scores={MMLU: acc}, primary={"mmlu_dev": MMLU}).to_samples()
        tracking.log_variant(
            store,
            run,
            metrics={MMLU: acc, "cost/weight_bytes": 1e6},
            params={"variant.name": name, "method.scheme": name.upper()},
            tags={
                tracking.CHECKPOINT: str(tmp_path / name),
                tracking.CONTENT_KEY: f"content-{name}",
                REFERENCE_DIR: str(tmp_path / "gone"),
            },
            datasets=[tracking.DatasetRecord("mmlu_dev", "d1g3st", "lm-eval", "evals/mmlu_dev.yaml", '{"limit": 4}')],
            files={SAMPLES_ARTIFACT: json.dumps(samples), "logs/variant.log": "quantized in 3 s\n"},
        )
        runs[name] = run
    store.log_values(runs["fp8"], tags={tracking.ON_FRONTIER: "true"})  # publish's verdict on that sweep, not on copies
    store.finish(parent, "FINISHED")
    return runs


def test_a_renamed_variant_is_copied_under_its_new_name_with_its_numbers_and_files(store, tmp_path):
    experiment = store.experiment_id("tiny")
    before = _previous_sweep(store, experiment, tmp_path)
    keys = {"bf16": "K-bf16", "fp8-dynamic": "K-fp8"}  # fp8 renamed; same content, same run key
    variants = [{"name": "bf16", "method": "bf16"}, {"name": "fp8-dynamic", "method": "fp8"}]
    sweep = _copying(store, tmp_path, experiment, variants, keys)

    baseline = sweep.baseline()
    sweep.others(baseline)

    assert sweep.outcome.reused == ["bf16", "fp8-dynamic"] and not sweep.outcome.failures
    assert sweep.display.finished == [("bf16", True), ("fp8-dynamic", True)]
    # The baseline's per-document outputs come back from its samples.json; its reference dir is gone.
    assert baseline == BaselineOutputs(None, scores={MMLU: 0.6}, primary={"mmlu_dev": MMLU})
    original, copy = store.run(before["fp8"]), store.run(sweep.log.runs["fp8-dynamic"])
    assert copy.status == "FINISHED" and copy.run_id != original.run_id
    assert copy.variant == copy.name == "fp8-dynamic" and copy.tags[tracking.PARENT] == sweep.log.parent_run_id
    assert copy.params == original.params | {"variant.name": "fp8-dynamic"}
    assert copy.metrics == original.metrics and copy.datasets == original.datasets
    assert copy.tags[tracking.REUSED_FROM] == original.run_id
    assert copy.tags[tracking.CHECKPOINT] == original.tags[tracking.CHECKPOINT]
    assert tracking.ON_FRONTIER not in copy.tags
    assert (
        store.run(sweep.log.runs["bf16"]).tags[tracking.BASELINE] == "true" and copy.tags[tracking.BASELINE] == "false"
    )
    for name in (SAMPLES_ARTIFACT, "logs/variant.log"):
        assert store.read_artifact(copy.run_id, name) == store.read_artifact(original.run_id, name)

    # A copy of a copy names the run that computed the numbers.
    again = _copying(store, tmp_path, experiment, variants, keys)
    again.others(again.baseline())
    assert store.run(again.log.runs["fp8-dynamic"]).tags[tracking.REUSED_FROM] == original.run_id


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_runs_of_dead_sweeps_on_this_host_are_killed_and_live_ones_left(store):
    experiment = store.experiment_id("tiny")
    parent_pid = os.getppid()  # alive for the whole test
    started = psutil.Process(parent_pid).create_time()
    here = socket.gethostname()

    def sweep(host: str, pid: int, started_at: float) -> str:
        return tracking.start_sweep(
            store, experiment, "sweep tiny", {HOST: host, PID: str(pid), PID_STARTED: str(started_at)}
        )

    dead = sweep(here, _dead_pid(), started)
    reused_pid = sweep(here, parent_pid, started - 100)  # the pid now belongs to another process
    alive = sweep(here, parent_pid, started)
    elsewhere = sweep("another-host", _dead_pid(), started)  # this host cannot tell
    running = _finished_variant(store, experiment, dead, "fp8", "A", status="RUNNING")
    done = _finished_variant(store, experiment, dead, "bf16", "B")

    killed = mark_dead_sweeps(store, experiment)

    assert sorted(killed) == sorted([dead, reused_pid])
    status = {run: store.run(run).status for run in (dead, reused_pid, alive, elsewhere, running, done)}
    assert status == {
        dead: "KILLED",
        reused_pid: "KILLED",
        alive: "RUNNING",
        elsewhere: "RUNNING",
        running: "KILLED",
        done: "FINISHED",
    }
    assert store.run(running).tags[tracking.FAILURE] == "its sweep process died"
    assert tracking.FAILURE not in store.run(done).tags


def _scores(right: int, n: int = 2000) -> DocumentScores:
    return DocumentScores(Aggregation.MEAN, {d: float(d < right) for d in range(n)})


def _logged_sweep(store, tmp_path) -> str:
    """A finished sweep with per-document scores: fp8 loses one answer of 2000, int4 loses 15 points,
    w8 loses 10 points and costs more than fp8."""
    experiment = store.experiment_id("tiny")
    parent = tracking.start_sweep(store, experiment, "sweep tiny", {})
    store.log_files(
        parent,
        {
            "recipe.yaml": "name: tiny\nbaseline: bf16\nmodel:\n  source: HuggingFaceTB/SmolLM2-135M\n"
            # fp8 first: w8, tested next and shown over, ends the fixed sequence (int4 is never tested)
            "frontier:\n  default_policy:\n    sequence: [fp8, w8, int4]\n"
        },
    )
    baseline = _scores(1200)
    for name, right, size in (("bf16", 1200, 270e6), ("fp8", 1199, 170e6), ("int4", 900, 100e6), ("w8", 1000, 200e6)):
        run = tracking.start_variant(store, experiment, parent, name, name, baseline=name == "bf16", run_key=name)
        docs = _scores(right)
        # What the sweep logs beside each score: the paired figures against the baseline (pick judges on these).
        paired = {paired_key(MMLU, stat): value for stat, value in compare(MMLU, baseline, docs).statistics().items()}
        tracking.log_variant(
            store,
            run,
            metrics={MMLU: docs.aggregate(), "cost/weight_bytes": size, **(paired if name != "bf16" else {})},
            params={},
            tags={
                **declared_tags({MMLU: Declared(True, Scale.FRACTION)}),
                tracking.CHECKPOINT: str(tmp_path / name),
                tracking.CONTENT_KEY: f"content-{name}",
            },
            datasets=[MMLU_DATA],
            files={SAMPLES_ARTIFACT: json.dumps(BaselineOutputs(None, {MMLU: docs}).to_samples())},
        )
    store.finish(parent, "FINISHED")
    return parent


def test_publish_tags_the_frontier_and_attaches_the_report_to_the_parent(store, tmp_path):
    parent = _logged_sweep(store, tmp_path)

    view = publish.publish_sweep(store, parent)

    assert [v.name for v in view.variants] == [
        "bf16",
        "fp8",
        "int4",
        "w8",
    ] and view.model == "HuggingFaceTB/SmolLM2-135M"
    # fp8 is cheaper than bf16 and not shown worse (one flip in 2,000), cheaper than w8 and better beyond the noise
    assert publish.frontiers(view).on_front == {"fp8", "int4"}
    tags = {run.variant: run.tags[tracking.ON_FRONTIER] for run in tracking.child_runs(store, parent)}
    assert tags == {"bf16": "false", "fp8": "true", "int4": "true", "w8": "false"}
    report = store.read_artifact(parent, "report.md").decode()
    assert store.run(parent).tags[tracking.NOTE] == report and "fp8" in report
    (frontier,) = json.loads(store.read_artifact(parent, "frontier.json"))["frontiers"]
    assert frontier["no_paired_noise"] == []  # the documents were read back from each run's samples.json
    for name in ("frontier.png", "frontier.html", "plots/eval-mmlu-dev-acc-vs-cost-weight-bytes.svg"):
        assert store.read_artifact(parent, name), name
    assert tracking.latest_sweep(store, "tiny").run_id == parent


def test_publish_puts_the_decision_on_the_parent_and_keeps_the_runs_view(store, tmp_path):
    parent = _logged_sweep(store, tmp_path)

    publish.publish_sweep(store, parent)
    publish.publish_sweep(store, parent)  # a second publish adds nothing twice

    run = store.run(parent)
    assert run.tags[tracking.CHOSEN] == run.tags[tracking.METRICS_OF] == "fp8"  # as pick decides below
    assert run.tags[tracking.POLICY].startswith("eval/mmlu_dev/acc at most 1 pt worse than the baseline; then")
    verdicts = {run.variant: run.tags[tracking.VERDICT] for run in tracking.child_runs(store, parent)}
    costs_more = "passes every limit, costs more"  # w8 loses 10 points, int4 15: both over 1 point
    assert verdicts == {"fp8": "chosen", "bf16": costs_more, "int4": "rejected", "w8": "rejected"}
    assert {name: run.tags[f"{tracking.VERDICT}.{name}"] for name in verdicts} == verdicts
    assert run.metrics["cost/weight_bytes"] == 170e6 and run.metrics[paired_key(MMLU, "diff")] < 0
    assert run.datasets == (MMLU_DATA,)  # each variant's, once
    assert run.tags[tracking.NOTE].startswith("**Ship fp8: weight size 170.0 MB, 63% of the baseline bf16's")
    experiment = store.experiment_id("tiny")
    view = json.loads(store.experiment_tags(experiment)[tracking.VIEW_TAG])
    assert view["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": tracking.SWEEP}]
    assert view["selectedColumns"] == [
        "tags.`quantlab.chosen`",
        "tags.`quantlab.verdict`",
        "attributes.`Dataset`",
        f"metrics.`{MMLU}`",
        f"metrics.`{paired_key(MMLU, 'diff')}`",
        "metrics.`cost/weight_bytes`",
    ]
    sweep_label = run.tags[tracking.SWEEP]  # every run of the sweep in one group of the runs table
    assert {child.tags[tracking.SWEEP] for child in tracking.child_runs(store, parent)} == {sweep_label}
    base = f"http://127.0.0.1:5000/#/experiments/{experiment}"
    assert tracking.ui_addresses(store, "127.0.0.1", 5000) == [
        ("tiny: runs", f"{base}/runs?workflowType=machine_learning&viewStateShareKey=quantlab"),
        ("tiny: newest sweep", f"{base}/runs/{parent}?workflowType=machine_learning"),
        ("tiny: frontier", f"{base}/runs/{parent}/artifacts/frontier.html?workflowType=machine_learning"),
    ]


def test_experiments_open_in_mlflows_classic_view(tmp_path):
    """MLflow versions before 3.17 chose the view by this tag; it is set on new experiments and older ones."""
    store = tracking.open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    new = store.experiment_id("new")
    from mlflow.tracking import MlflowClient

    older = MlflowClient(store.uri).create_experiment("older")  # as an older quantlab made it
    assert tracking.EXPERIMENT_KIND not in store.experiment_tags(older)

    assert store.experiment_id("older") == older
    for experiment in (new, older):
        assert store.experiment_tags(experiment)[tracking.EXPERIMENT_KIND] == "custom_model_development"
    address = tracking.run_address("http://user:pw@host:5000/", new, "r1")
    assert address == f"http://user:***@host:5000/#/experiments/{new}/runs/r1?workflowType=machine_learning"


ROWS = "# report\n" + "".join(f"| row {n:04} of a table |\n" for n in range(1000))


@pytest.mark.parametrize(
    ("markdown", "cut"),
    [
        ("# short\n\nall of it", False),
        ("x" * 8000, False),  # exactly MLflow's limit
        (ROWS, True),
        ("y" * 9000, True),  # no line end to cut at
    ],
)
def test_a_long_run_description_is_cut_at_a_line_with_a_pointer_to_the_whole(store, markdown, cut) -> None:
    description = tracking.run_description(markdown, "report.md")

    assert len(description) <= 8000
    if not cut:
        assert description == markdown
    else:
        kept, pointer = description.split("\n\n*Cut to fit MLflow's 8,000-character description: ")
        assert pointer == "all of it is the artifact `report.md`.*"
        assert markdown.startswith(kept) and len(kept) > 7800
        assert "\n" not in markdown or markdown[len(kept)] == "\n"  # whole lines only
    # What the store keeps is what was written: MLflow does not cut it again.
    run = store.start_run(store.experiment_id("description"), "run", {tracking.NOTE: description})
    assert store.run(run).tags[tracking.NOTE] == description


def test_pick_registers_the_chosen_checkpoint_once_and_logs_each_decision(store, tmp_path, monkeypatch):
    parent = _logged_sweep(store, tmp_path)
    view = publish.read_sweep(store, parent)
    decision = publish.decide(view)  # the recipe's default policy: at most 1 point lost on any task
    assert decision.chosen == "fp8"

    monkeypatch.setattr(publish.time, "time", lambda: 1000.0)
    first = publish.record_pick(store, view, decision, register=True, alias="prod")
    monkeypatch.setattr(publish.time, "time", lambda: 2000.0)
    second = publish.record_pick(store, view, decision, register=True, alias="prod")

    card = f"runs:/{parent}/release-cards/tiny-v1.json"  # the version's release card, on the sweep's run
    expected = {"model": "tiny", "version": "1", "alias": "prod", "release_card": card}
    assert first["registered"] == expected | {"new_version": True}
    assert second["registered"] == expected | {"new_version": False}
    assert store.version_description("tiny", "1").startswith("# tiny v1 (@prod): fp8\n")
    assert json.loads(store.read_artifact(parent, "release-cards/tiny-v1.json"))["checkpoint_hash"] == "content-fp8"
    (version_tags,) = store.model_versions("tiny").values()
    assert version_tags[tracking.CONTENT_KEY] == "content-fp8" and version_tags[tracking.CHECKPOINT] == str(
        tmp_path / "fp8"
    )
    assert version_tags[MMLU] == "0.5995"  # the chosen run's scores travel with the version
    assert json.loads(store.read_artifact(parent, "decisions/pick-1000.json")) == first
    assert json.loads(store.read_artifact(parent, "decisions/pick-2000.json"))["chosen"] == "fp8"


def test_no_sweep_is_bad_input_naming_the_flag(store):
    from quantlab.errors import BadInput

    with pytest.raises(BadInput, match="no experiment named 'nothing'"):
        tracking.latest_sweep(store, "nothing")
    store.experiment_id("empty")
    with pytest.raises(BadInput, match="has no sweep runs"):
        tracking.latest_sweep(store, "empty")


def test_quantlab_frontier_reads_in_an_80_column_terminal(tmp_path):
    """The decision first, then the variants table cut into tables that fit $COLUMNS, the figure names repeated
    (wider terminals: test_report's text_tables)."""
    columns = 80
    from test_sweep import quantlab

    store = tracking.open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    _logged_sweep(store, tmp_path)

    result = quantlab("frontier", "--tracking-uri", store.uri, cwd=tmp_path, env={"COLUMNS": str(columns)})

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Ship fp8: weight size 170.0 MB")
    assert max(map(len, lines)) <= columns
    tables = sum(line.startswith("┏") for line in lines)
    assert tables == 2  # 4 variants, a row per figure: two a table
    assert sum("weight size" in line for line in lines if line.startswith(("│", "┃"))) == tables  # named in each
