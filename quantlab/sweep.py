"""A sweep: plan the variants, run each (baseline first), log each into MLflow, publish the frontier.

Resuming is by content: a finished run with the same run key (`run_keys`) is copied, not recomputed (`--force`
recomputes). Runs left RUNNING by a sweep that died on this host are marked KILLED when the next one starts.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil

from quantlab import cache, tracking
from quantlab.checks import remember_lookups
from quantlab.errors import BadInput, Problem
from quantlab.executors import EXECUTORS, VariantFailed, stop_variant_processes
from quantlab.jobs import SAMPLES_FORMAT, BaselineOutputs, VariantJob, VariantResult
from quantlab.recipe import LoadedRecipe
from quantlab.tracking import SAMPLES_ARTIFACT

HOST, PID = "quantlab.host", "quantlab.pid"
PID_STARTED = "quantlab.pid_started"  # the sweep process's start time: with host and pid, who it was
REFERENCE_DIR = "quantlab.reference_dir"


class SweepDisplay(Protocol):
    def sweep_started(self, experiment: str, run_id: str, variants: list[str]) -> None: ...
    def stage(self, variant: str, stage: str) -> None: ...
    def variant_finished(
        self, variant: str, result: VariantResult | None, failure: str | None, reused: bool = False
    ) -> None: ...


@dataclass(frozen=True)
class SweepOptions:
    tracking_uri: str
    cache_root: Path
    executor: str = "local"  # a key of EXECUTORS
    force: bool = False
    only: tuple[str, ...] = ()
    ray_address: str | None = None


def plan(loaded: LoadedRecipe, only: tuple[str, ...]) -> list[str]:
    """Variant names in run order: the baseline first, since the others compare against it."""
    recipe = loaded.recipe
    names = [variant.name for variant in recipe.variants]
    if unknown := [name for name in only if name not in names]:
        known = f"is not a variant of {loaded.path.name}; variants: {', '.join(names)}"
        raise BadInput([Problem("--only", "", f"'{name}' {known}") for name in unknown])
    return [recipe.baseline] + [name for name in names if name != recipe.baseline and (not only or name in only)]


def run_keys(loaded: LoadedRecipe, names: list[str]) -> dict[str, str]:
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
        name: cache.cache_key(
            {"checkpoint": checkpoint_identity(source, recipe.variant(name), recipe.calibration), **shared}
        )
        for name in names
    }


def run_sweep(loaded: LoadedRecipe, options: SweepOptions, display: SweepDisplay) -> SweepRuns:
    from quantlab.publish import publish_sweep

    order = plan(loaded, options.only)
    store = tracking.open_store(options.tracking_uri)
    remember_lookups(loaded, options.cache_root)
    experiment = store.experiment_id(loaded.recipe.name)
    mark_dead_sweeps(store, experiment)
    keys = run_keys(loaded, order)
    reusable = {} if options.force else tracking.finished_runs(store, experiment, set(keys.values()))
    if set(keys.values()) <= set(reusable):  # every variant is copied: the fork server's imports would only compete
        stop_variant_processes()
    who = {HOST: socket.gethostname(), PID: str(os.getpid()), PID_STARTED: str(psutil.Process().create_time())}
    parent = tracking.start_sweep(store, experiment, f"sweep {loaded.recipe.name}", who)
    sweep = SweepRuns(store, experiment, parent, loaded, options, display, keys)
    try:
        store.log_files(parent, {"recipe.yaml": loaded.text})
        store.log_values(parent, params={"recipe.path": str(loaded.path), "variants": ",".join(order)})
        display.sweep_started(loaded.recipe.name, parent, order)
        # Ray workers on other nodes write their logs where the driver can read them: under the
        # cache directory, which a cluster shares (a local /tmp path would not exist there).
        log_root = options.cache_root / "logs" if options.executor == "ray" else None
        if log_root is not None:
            log_root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="quantlab-logs-", dir=log_root) as logs:
            sweep.run_batch(order[:1], reusable, Path(logs))  # the baseline, which the others compare against
            sweep.run_batch(order[1:], reusable, Path(logs))
        publish_sweep(store, parent)
    except BaseException as error:
        status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        sweep.abandon(status)
        store.finish(parent, status)
        raise
    store.finish(parent, "FINISHED" if not sweep.failures else "FAILED")
    return sweep


@dataclass
class SweepRuns:
    """The bookkeeping of one sweep: which run belongs to which variant, and what came of it (`run_sweep` returns it)."""

    store: tracking.TrackingStore
    experiment_id: str
    parent_run_id: str
    loaded: LoadedRecipe
    options: SweepOptions
    display: SweepDisplay
    keys: dict[str, str]
    runs: dict[str, str] = field(default_factory=dict)  # variant -> its run in this sweep
    baseline: BaselineOutputs | None = None
    finished: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0

    def run_batch(self, names: list[str], reusable: dict[str, tracking.RunRecord], logs: Path) -> None:
        to_run = []
        for name in names:
            if self.keys[name] in reusable:
                self._copy(name, reusable[self.keys[name]])
            else:
                to_run.append(VariantJob(self.loaded, name, self.options.cache_root, self.baseline, self.options.force))
        if not to_run:  # every variant copied: no executor (a Ray cluster) to start
            return
        executor = EXECUTORS[self.options.executor](self.options.ray_address)
        for job, outcome, log_path in executor.run(to_run, logs, self._stage):
            if isinstance(outcome, VariantResult):
                try:
                    self._log_result(job, outcome, log_path)
                    continue
                except Exception as error:  # noqa: BLE001 - one variant's bad record must not end the sweep
                    outcome = VariantFailed(f"logging its result failed: {error}", traceback.format_exc())
            self._log_failure(job.variant, outcome, log_path)

    def _run_for(self, name: str) -> str:
        if name not in self.runs:
            method, baseline = self.loaded.recipe.variant(name).method, name == self.loaded.recipe.baseline
            self.runs[name] = tracking.start_variant(
                self.store,
                self.experiment_id,
                self.parent_run_id,
                name,
                method,
                baseline=baseline,
                run_key=self.keys[name],
            )
        return self.runs[name]

    def _stage(self, name: str, stage: str) -> None:
        self._run_for(name)
        self.display.stage(name, stage)

    def _log_result(self, job: VariantJob, result: VariantResult, log_path: Path) -> None:
        tracking.log_variant(
            self.store,
            self._run_for(job.variant),
            metrics=result.metrics
            | {f"time/{stage}_seconds": seconds for stage, seconds in result.stage_seconds.items()},
            params=result.params,
            tags=result.tags
            | {
                tracking.CHECKPOINT: result.checkpoint,
                tracking.CONTENT_KEY: result.content_key,
                "quantlab.checkpoint_reused": str(result.reused_checkpoint).lower(),
                REFERENCE_DIR: result.baseline_outputs.reference_dir or "",
            },
            datasets=result.datasets,
            files={
                **result.artifacts,
                **_log_artifact(log_path),
                SAMPLES_ARTIFACT: json.dumps(result.baseline_outputs.to_samples()),
                "stage_seconds.json": json.dumps(result.stage_seconds, indent=2),
            },
        )
        if job.is_baseline:
            self.baseline = result.baseline_outputs
        self.finished.append(job.variant)
        self.display.variant_finished(job.variant, result, None)

    def _log_failure(self, name: str, failed: VariantFailed, log_path: Path) -> None:
        tracking.log_failure(
            self.store,
            self._run_for(name),
            failed.reason,
            {"failure/traceback.txt": failed.details, **_log_artifact(log_path)},
        )
        self.failures[name] = failed.reason
        self.display.variant_finished(name, None, failed.reason)

    def _copy(self, name: str, previous: tracking.RunRecord) -> None:
        """A finished run with the same run key: its numbers hold for this sweep, under this sweep's name for it."""
        run_id = self._run_for(name)
        if name == self.loaded.recipe.baseline:  # read before the copy: a baseline without samples ends the sweep
            samples = self.store.read_artifact(previous.run_id, SAMPLES_ARTIFACT)
            if samples is None:
                raise ValueError(f"the reused baseline run has no {SAMPLES_ARTIFACT}")
            reference = previous.tags.get(REFERENCE_DIR)
            usable = reference if reference and Path(reference, "reference.json").is_file() else None
            self.baseline = BaselineOutputs.from_samples(json.loads(samples), usable)
        tracking.copy_run(self.store, previous, run_id)
        self.reused.append(name)
        self.display.variant_finished(name, None, None, reused=True)

    def abandon(self, status: str) -> None:
        """The sweep is dying: no run of it may stay RUNNING."""
        for run_id in self.runs.values():
            if self.store.run(run_id).status == "RUNNING":
                self.store.finish(run_id, status)


def mark_dead_sweeps(store: tracking.TrackingStore, experiment: str) -> list[str]:
    """Runs left RUNNING by a sweep process on this host that no longer exists become KILLED."""
    return tracking.kill_sweeps(store, experiment, _died_here, "its sweep process died")


def _died_here(tags: dict[str, str]) -> bool:
    """Whether the sweep that recorded these tags ran on this host and its process is gone: its pid and start time
    (a restarted container gives the next sweep the same small pid, this very one; a busy host reuses pids)."""
    if tags.get(HOST) != socket.gethostname():
        return False  # another host's processes cannot be seen from here
    pid = int(tags.get(PID, "0"))
    if pid <= 0 or pid == os.getpid():
        return True
    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # not ours to inspect, but there
        return False
    try:
        return abs(started - float(tags[PID_STARTED])) >= 1.0
    except (KeyError, ValueError):  # not recorded (a sweep from before start times were)
        return False


def _log_artifact(log_path: Path) -> dict[str, str]:
    return {"logs/variant.log": log_path.read_text(encoding="utf-8", errors="replace")} if log_path.is_file() else {}
