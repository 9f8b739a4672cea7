"""A sweep: plan the variants, run each (baseline first), log each into MLflow, publish the frontier.

Resuming is by content: every variant has a run key, a hash of everything that decides its
numbers (checkpoint identity, eval / quality / measure settings, the baseline it is compared
with). A finished run with the same key in the experiment is copied into the new sweep in
seconds instead of being recomputed (`--force` recomputes). Runs left RUNNING by a sweep that
died on this host (SIGKILL, power loss) are marked KILLED when the next sweep starts.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from quantlab import cache, tracking
from quantlab.checks import remember_lookups
from quantlab.errors import BadInput, Problem
from quantlab.executors import VariantFailed, make_executor
from quantlab.jobs import SAMPLES_FORMAT, BaselineOutputs, VariantJob, VariantResult
from quantlab.recipe import LoadedRecipe

RUN_KEY = "quantlab.run_key"
REUSED_FROM = "quantlab.reused_from"
PID_STARTED = "quantlab.pid_started"  # the sweep process's start time: with host and pid, who it was
REFERENCE_DIR = "quantlab.reference_dir"
SAMPLES_ARTIFACT = "samples.json"  # per-document scores; format: runner.BaselineOutputs


class SweepDisplay(Protocol):
    def sweep_started(self, experiment: str, run_id: str, variants: list[str]) -> None: ...
    def stage(self, variant: str, stage: str) -> None: ...
    def variant_finished(self, variant: str, result: VariantResult | None, failure: str | None, reused: bool = False) -> None: ...


@dataclass(frozen=True)
class SweepOptions:
    tracking_uri: str
    cache_root: Path
    executor: Literal["local", "inprocess", "ray"] = "local"
    force: bool = False
    only: tuple[str, ...] = ()
    ray_address: str | None = None


@dataclass(frozen=True)
class SweepOutcome:
    experiment_id: str
    parent_run_id: str
    finished: list[str]
    reused: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0


def plan(loaded: LoadedRecipe, only: tuple[str, ...]) -> list[str]:
    """Variant names in run order: the baseline first, since the others compare against it."""
    recipe = loaded.recipe
    names = [variant.name for variant in recipe.variants]
    unknown = [name for name in only if name not in names]
    if unknown:
        raise BadInput([Problem("--only", "", f"'{name}' is not a variant of {loaded.path.name}; variants: {', '.join(names)}") for name in unknown])
    chosen = [name for name in names if not only or name in only or name == recipe.baseline]
    return [recipe.baseline] + [name for name in chosen if name != recipe.baseline]


def run_keys(loaded: LoadedRecipe, names: list[str], cache_root: Path) -> dict[str, str]:
    """Content hash per variant of everything that decides its logged numbers."""
    from quantlab.models import resolve_source
    from quantlab.stages.quantize import checkpoint_identity

    recipe = loaded.recipe
    source = resolve_source(recipe.model, loaded.path.parent)
    shared = {
        "evals": recipe.evals.model_dump(exclude={"include_path"}),
        "tasks_files": cache.tasks_digest(loaded.include_path),
        "quality": recipe.quality.model_dump(),
        "measure": recipe.measure.model_dump(),
        "runtime": recipe.runtime.model_dump(),
        "baseline": checkpoint_identity(source, recipe.variant(recipe.baseline), recipe.calibration),
        # A run whose samples.json this version cannot read is not reused (its baseline could not be compared against).
        "samples_format": SAMPLES_FORMAT,
    }
    return {
        name: cache.cache_key({"checkpoint": checkpoint_identity(source, recipe.variant(name), recipe.calibration), **shared})
        for name in names
    }


def run_sweep(loaded: LoadedRecipe, options: SweepOptions, display: SweepDisplay) -> SweepOutcome:
    from quantlab.publish import publish_sweep

    order = plan(loaded, options.only)
    store = tracking.open_store(options.tracking_uri)
    remember_lookups(loaded, options.cache_root)
    experiment = tracking.experiment_id(store, loaded.recipe.name)
    mark_dead_sweeps(store, experiment)
    keys = run_keys(loaded, order, options.cache_root)
    reusable = {} if options.force else finished_runs(store, experiment, set(keys.values()))
    parent = tracking.start_run(store, experiment, f"sweep {loaded.recipe.name}", {
        tracking.ROLE: "sweep", "quantlab.host": socket.gethostname(), "quantlab.pid": str(os.getpid()),
        PID_STARTED: str(_started_at(os.getpid())),
    })
    sweep = _Sweep(store, experiment, parent, loaded, options, display, keys)
    try:
        tracking.log_text_artifacts(store, parent, {"recipe.yaml": loaded.text})
        tracking.log_values(store, parent, params={"recipe.path": str(loaded.path), "variants": ",".join(order)})
        display.sweep_started(loaded.recipe.name, parent, order)
        # Ray workers on other nodes write their logs where the driver can read them: under the
        # cache directory, which a cluster shares (a local /tmp path would not exist there).
        log_root = options.cache_root / "logs" if options.executor == "ray" else None
        if log_root is not None:
            log_root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="quantlab-logs-", dir=log_root) as logs:
            baseline_name, others = order[0], order[1:]
            sweep.run_batch([baseline_name], reusable, Path(logs))
            sweep.run_batch(others, reusable, Path(logs))
        publish_sweep(store, parent)
    except BaseException as error:
        status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        sweep.abandon(status)
        tracking.finish(store, parent, status)
        raise
    tracking.finish(store, parent, "FINISHED" if not sweep.failures else "FAILED")
    return SweepOutcome(experiment, parent, sweep.finished, sweep.reused, sweep.failures)


class _Sweep:
    """The bookkeeping of one sweep: which run belongs to which variant, and what came of it."""

    def __init__(self, store, experiment, parent, loaded, options, display, keys):
        self.store, self.experiment, self.parent = store, experiment, parent
        self.loaded, self.options, self.display, self.keys = loaded, options, display, keys
        self.runs: dict[str, str] = {}
        self.baseline: BaselineOutputs | None = None
        self.finished: list[str] = []
        self.reused: list[str] = []
        self.failures: dict[str, str] = {}

    def run_batch(self, names: list[str], reusable: dict[str, object], logs: Path) -> None:
        to_run = []
        for name in names:
            previous = reusable.get(self.keys[name])
            if previous is not None:
                self._copy(name, previous)
            else:
                to_run.append(VariantJob(self.loaded, name, self.options.cache_root, self.baseline, self.options.force))
        executor = make_executor(self.options.executor, self.options.ray_address)
        for job, outcome, log_path in executor.run(to_run, logs, self._stage) if to_run else ():
            if isinstance(outcome, VariantResult):
                try:
                    self._log_result(job, outcome, log_path)
                    continue
                except Exception as error:  # noqa: BLE001 - one variant's bad record must not end the sweep
                    import traceback

                    outcome = VariantFailed(f"logging its result failed: {error}", traceback.format_exc())
            self._log_failure(job.variant, outcome, log_path)

    def _run_for(self, name: str) -> str:
        if name not in self.runs:
            variant = self.loaded.recipe.variant(name)
            self.runs[name] = tracking.start_run(self.store, self.experiment, name, {
                tracking.ROLE: "variant", tracking.VARIANT: name, tracking.METHOD: variant.method,
                "quantlab.baseline": str(name == self.loaded.recipe.baseline).lower(), RUN_KEY: self.keys[name],
            }, parent=self.parent)
        return self.runs[name]

    def _stage(self, name: str, stage: str) -> None:
        self._run_for(name)
        self.display.stage(name, stage)

    def _log_result(self, job: VariantJob, result: VariantResult, log_path: Path) -> None:
        run_id = self._run_for(job.variant)
        tracking.log_values(
            self.store, run_id,
            metrics=result.metrics | {f"time/{stage}_seconds": seconds for stage, seconds in result.stage_seconds.items()},
            params=result.params,
            tags=result.tags | {tracking.CHECKPOINT: result.checkpoint, tracking.CONTENT_KEY: result.content_key,
                                "quantlab.checkpoint_reused": str(result.reused_checkpoint).lower(),
                                REFERENCE_DIR: result.baseline_outputs.reference_dir or ""},
        )
        tracking.log_dataset_inputs(self.store, run_id, result.datasets)
        tracking.log_text_artifacts(self.store, run_id, {
            **result.artifacts, **_log_artifact(log_path), SAMPLES_ARTIFACT: json.dumps(result.baseline_outputs.to_samples()),
            "stage_seconds.json": json.dumps(result.stage_seconds, indent=2),
        })
        tracking.finish(self.store, run_id, "FINISHED")
        if job.is_baseline:
            self.baseline = result.baseline_outputs
        self.finished.append(job.variant)
        self.display.variant_finished(job.variant, result, None)

    def _log_failure(self, name: str, failed: VariantFailed, log_path: Path) -> None:
        run_id = self._run_for(name)
        tracking.log_text_artifacts(self.store, run_id, {"failure/traceback.txt": failed.details, **_log_artifact(log_path)})
        tracking.log_values(self.store, run_id, tags={"quantlab.failure": failed.reason[:5000]})
        tracking.finish(self.store, run_id, "FAILED")
        self.failures[name] = failed.reason
        self.display.variant_finished(name, None, failed.reason)

    def _copy(self, name: str, previous) -> None:
        """A finished run with the same run key: its numbers hold for this sweep too."""
        run_id = self._run_for(name)
        # The numbers are the content's; who the run is (variant name, baseline or not) is this
        # sweep's, set by _run_for: a renamed variant is copied under its new name. reused_from
        # names the run that computed the numbers, not a copy of a copy.
        own = {tracking.ON_FRONTIER, tracking.ROLE, tracking.VARIANT, "quantlab.baseline"}
        tags = {k: v for k, v in previous.data.tags.items() if not k.startswith("mlflow.") and k not in own}
        params = dict(previous.data.params) | ({"variant.name": name} if "variant.name" in previous.data.params else {})
        origin = previous.data.tags.get(REUSED_FROM, previous.info.run_id)
        tracking.log_values(self.store, run_id, metrics=dict(previous.data.metrics), params=params,
                            tags=tags | {REUSED_FROM: origin})
        # The copy was scored on what the original was: the runs table lists the same datasets.
        inputs = previous.inputs.dataset_inputs if previous.inputs is not None else []
        tracking.log_dataset_inputs(self.store, run_id, [item.dataset for item in inputs])
        with tempfile.TemporaryDirectory() as scratch:
            local = self.store.client.download_artifacts(previous.info.run_id, "", scratch)
            self.store.client.log_artifacts(run_id, local)
            if name == self.loaded.recipe.baseline:
                self.baseline = _baseline_outputs(Path(local) / SAMPLES_ARTIFACT, previous.data.tags.get(REFERENCE_DIR))
        tracking.finish(self.store, run_id, "FINISHED")
        self.reused.append(name)
        self.display.variant_finished(name, None, None, reused=True)

    def abandon(self, status: str) -> None:
        """The sweep is dying: no run of it may stay RUNNING."""
        for name, run_id in self.runs.items():
            if self.store.client.get_run(run_id).info.status == "RUNNING":
                tracking.finish(self.store, run_id, status)


def _baseline_outputs(samples_path: Path, reference_dir: str | None) -> BaselineOutputs:
    usable_reference = reference_dir if reference_dir and Path(reference_dir, "reference.json").is_file() else None
    return BaselineOutputs.from_samples(json.loads(samples_path.read_text()), usable_reference)


def finished_runs(store: tracking.Store, experiment: str, keys: set[str]) -> dict[str, object]:
    """The newest FINISHED variant run for each run key."""
    found: dict[str, object] = {}
    runs = store.client.search_runs(
        [experiment], filter_string=f"tags.`{tracking.ROLE}` = 'variant' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"], max_results=5000,
    )
    for run in runs:
        key = run.data.tags.get(RUN_KEY)
        if key in keys and key not in found:
            found[key] = run
    return found


def mark_dead_sweeps(store: tracking.Store, experiment: str) -> list[str]:
    """Runs left RUNNING by a sweep process on this host that no longer exists become KILLED."""
    host = socket.gethostname()
    sweeps = store.client.search_runs(
        [experiment], filter_string=f"tags.`{tracking.ROLE}` = 'sweep' and attributes.status = 'RUNNING'", max_results=1000
    )
    killed = []
    for sweep in sweeps:
        tags = sweep.data.tags
        if tags.get("quantlab.host") != host or _process_alive(int(tags.get("quantlab.pid", "0")), tags.get(PID_STARTED)):
            continue
        for child in tracking.child_runs(store, sweep.info.run_id):
            if child.info.status == "RUNNING":
                tracking.log_values(store, child.info.run_id, tags={"quantlab.failure": "its sweep process died"})
                tracking.finish(store, child.info.run_id, "KILLED")
        tracking.finish(store, sweep.info.run_id, "KILLED")
        killed.append(sweep.info.run_id)
    return killed


def _process_alive(pid: int, started: str | None = None) -> bool:
    """Whether the sweep process that recorded (pid, start time) still runs.

    A pid alone is not enough: a restarted container gives the next sweep the same small pid
    (then it is this very process), and a busy host reuses pids.
    """
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        recorded = float(started)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # not recorded (a sweep from before start times were)
        return True
    now = _started_at(pid)
    return now is None or abs(now - recorded) < 1.0


def _started_at(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def _log_artifact(log_path: Path) -> dict[str, str]:
    return {"logs/variant.log": log_path.read_text(encoding="utf-8", errors="replace")} if log_path.is_file() else {}
