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
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import psutil

from quantlab import cache, disk, kept_results, tracking
from quantlab.checks import remember_lookups
from quantlab.errors import BadInput, Problem, first_line
from quantlab.executors import EXECUTORS, VariantFailed, stop_variant_processes
from quantlab.jobs import SAMPLES_FORMAT, SIDE_PROCESSES, BaselineOutputs, VariantJob, VariantResult, side_log
from quantlab.kept_results import KeptResult
from quantlab.recipe import LoadedRecipe
from quantlab.tracking import SAMPLES_ARTIFACT

HOST, PID = "quantlab.host", "quantlab.pid"
LOGGED_FROM_CACHE = "quantlab.logged_from_cache"  # when its numbers were computed, by a sweep that could not log them
PID_STARTED = "quantlab.pid_started"  # the sweep process's start time: with host and pid, who it was
REFERENCE_DIR = "quantlab.reference_dir"


class SweepDisplay(Protocol):
    def sweep_started(self, experiment: str, run_id: str, variants: list[str]) -> None: ...
    def stage(self, variant: str, stage: str) -> None: ...
    def variant_finished(
        self, variant: str, result: VariantResult | None, failure: str | None, reused: str = ""
    ) -> None: ...  # `reused` says where the numbers of a variant that was not computed again came from
    def note(self, variant: str, text: str) -> None: ...


@dataclass(frozen=True)
class SweepOptions:
    tracking_uri: str
    cache_root: Path
    executor: str = "local"  # a key of EXECUTORS
    force: bool = False
    only: tuple[str, ...] = ()
    ray_address: str | None = None
    log_retry_seconds: float = 300.0  # how long a finished variant's logging is retried while the store fails
    parallel: int = 1  # variants at once in the local executor, after the baseline


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
        "serving": recipe.serving.model_dump(),
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
    order = plan(loaded, options.only)
    store = tracking.open_store(options.tracking_uri)
    remember_lookups(loaded, options.cache_root)
    experiment = store.experiment_id(loaded.recipe.name)
    mark_dead_sweeps(store, experiment)
    keys = run_keys(loaded, order)
    reusable = {} if options.force else tracking.finished_runs(store, experiment, set(keys.values()))
    kept = set() if options.force else {key for key in keys.values() if kept_results.has(options.cache_root, key)}
    if set(keys.values()) <= set(reusable) | kept:  # nothing to compute: the fork server's imports would only compete
        stop_variant_processes()
    from quantlab.stages.quantize import sweep_space_needs

    computed = [name for name in order if keys[name] not in set(reusable) | kept]
    space = sweep_space_needs(loaded, computed, options.cache_root, options.force)
    disk.refuse_sweep(space + disk.artifact_needs(store.uri, len(order) + 1))  # bad input, before any run
    parent = tracking.start_sweep(store, experiment, f"sweep {loaded.recipe.name}", sweep_process_tags())
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
        sweep.publish()
    except BaseException as error:
        status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        sweep.abandon(status)
        raise
    sweep.finish("FINISHED" if not (sweep.failures or sweep.unlogged) else "FAILED")
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
    logged_from_cache: list[str] = field(default_factory=list)
    unlogged: dict[str, str] = field(default_factory=dict)  # variant -> why the store does not have it yet

    @property
    def exit_code(self) -> int:
        return 1 if self.failures or self.unlogged else 0

    def run_batch(self, names: list[str], reusable: dict[str, tracking.RunRecord], logs: Path) -> None:
        to_run = []
        for name in names:
            if self.keys[name] in reusable:
                self._copy(name, reusable[self.keys[name]])
                kept_results.discard(self.options.cache_root, self.keys[name])
            elif not self.options.force and (kept := kept_results.recall(self.options.cache_root, self.keys[name])):
                self._log_kept_result(name, kept)
            else:
                job = VariantJob(self.loaded, name, self.options.cache_root, self.baseline, self.options.force, logs)
                to_run.append(job)
        if not to_run:  # every variant copied: no executor (a Ray cluster) to start
            return
        executor = EXECUTORS[self.options.executor](self.options.ray_address, self.options.parallel)
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
        try:
            self._run_for(name)
        except tracking.store_errors() as error:  # the run is made when its result is logged
            self.display.note(name, f"the tracking store failed ({first_line(error)}); the variant goes on")
        self.display.stage(name, stage)

    def _log_result(self, job: VariantJob, result: VariantResult, log_path: Path) -> None:
        if job.is_baseline:  # the other variants compare against it, logged or not
            self.baseline = result.baseline_outputs
        kept = KeptResult(
            variant=job.variant,
            run_key=self.keys[job.variant],
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
            datasets=tuple(tracking.DatasetRecord.of(item) for item in result.datasets),
            files={
                **result.artifacts,
                **_log_artifact(log_path),
                SAMPLES_ARTIFACT: json.dumps(result.baseline_outputs.to_samples()),
                "stage_seconds.json": json.dumps(result.stage_seconds, indent=2),
            },
        )
        try:  # before the store is asked: it may be down
            kept_results.keep(self.options.cache_root, kept)
        except OSError as error:  # a safety net that failed (a full disk): the store may still take it
            self.display.note(job.variant, f"could not keep its result in the cache ({error}); logging it directly")
        if self._logged(kept):
            self.finished.append(job.variant)
            self.display.variant_finished(job.variant, result, None)

    def _log_kept_result(self, name: str, kept: KeptResult) -> None:
        """A result an earlier sweep computed but could not log: logged now, not recomputed."""
        if name == self.loaded.recipe.baseline:
            samples = json.loads(kept.files[SAMPLES_ARTIFACT])
            self.baseline = BaselineOutputs.from_samples(samples, _usable_reference(kept.tags.get(REFERENCE_DIR)))
        renamed = {"variant.name": name} if "variant.name" in kept.params else {}
        kept = replace(kept, params=kept.params | renamed, tags=kept.tags | {LOGGED_FROM_CACHE: kept.finished_at})
        if self._logged(kept):
            self.logged_from_cache.append(name)
            how = f"computed at {kept.finished_at} by a sweep that could not log it; logged now from the cache"
            self.display.variant_finished(name, None, None, reused=how)

    def _logged(self, kept: KeptResult) -> bool:
        """Log a kept result, retrying while the store fails; once logged, it leaves the cache."""
        name = kept.variant

        def log() -> None:
            tracking.log_variant(
                self.store,
                self._run_for(name),
                metrics=kept.metrics,
                params=kept.params,
                tags=kept.tags,
                datasets=kept.datasets,
                files=kept.files,
            )

        def retrying(error: BaseException, wait: float) -> None:
            self.display.note(name, f"logging failed ({first_line(error)}); trying again in {wait:.0f} s")

        try:
            tracking.with_retries(log, self.options.log_retry_seconds, retrying)
        except tracking.store_errors() as error:
            where = kept_results.kept_dir(self.options.cache_root, kept.run_key)
            self.unlogged[name] = f"{first_line(error)}; its result is kept in {where}"
            self.display.note(name, f"[red]not logged[/]: {self.unlogged[name]}")
            return False
        kept_results.discard(self.options.cache_root, kept.run_key)
        return True

    def _log_failure(self, name: str, failed: VariantFailed, log_path: Path) -> None:
        self.failures[name] = failed.reason
        files = {"failure/traceback.txt": failed.details, **_log_artifact(log_path)}
        try:
            tracking.with_retries(
                lambda: tracking.log_failure(self.store, self._run_for(name), failed.reason, files),
                self.options.log_retry_seconds,
            )
        except tracking.store_errors() as error:
            self.unlogged[name] = f"{first_line(error)}; its failure is not logged"
        self.display.variant_finished(name, None, failed.reason)

    def _copy(self, name: str, previous: tracking.RunRecord) -> None:
        """A finished run with the same run key: its numbers hold for this sweep, under this sweep's name for it."""
        run_id = self._run_for(name)
        if name == self.loaded.recipe.baseline:  # read before the copy: a baseline without samples ends the sweep
            samples = self.store.read_artifact(previous.run_id, SAMPLES_ARTIFACT)
            if samples is None:
                raise ValueError(f"the reused baseline run has no {SAMPLES_ARTIFACT}")
            self.baseline = BaselineOutputs.from_samples(
                json.loads(samples), _usable_reference(previous.tags.get(REFERENCE_DIR))
            )
        tracking.copy_run(self.store, previous, run_id)
        self.reused.append(name)
        self.display.variant_finished(name, None, None, reused="unchanged since a finished run, copied from it")

    def publish(self) -> None:
        """The frontier and report over every variant, once all of them are logged (a later sweep publishes them)."""
        from quantlab.publish import publish_sweep

        if self.unlogged:
            return
        try:
            tracking.with_retries(lambda: publish_sweep(self.store, self.parent_run_id), self.options.log_retry_seconds)
        except tracking.store_errors() as error:
            self.unlogged["frontier and report"] = first_line(error)

    def finish(self, status: str) -> None:
        """End the parent run; a store still failing leaves it RUNNING, for the next sweep to mark KILLED."""
        with suppress(*tracking.store_errors()):
            tracking.with_retries(lambda: self.store.finish(self.parent_run_id, status), self.options.log_retry_seconds)

    def abandon(self, status: str) -> None:
        """The sweep is dying: no run of it may stay RUNNING (unless the store is what failed)."""
        tracking.end_unfinished(self.store, [*self.runs.values(), self.parent_run_id], status)


def sweep_process_tags() -> dict[str, str]:
    """Who runs this sweep: host, pid and the process's start time (`mark_dead_sweeps` reads them)."""
    return {HOST: socket.gethostname(), PID: str(os.getpid()), PID_STARTED: str(psutil.Process().create_time())}


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


def _usable_reference(reference_dir: str | None) -> str | None:
    """The baseline's reference pass directory, if it is still there to compare against."""
    return reference_dir if reference_dir and Path(reference_dir, "reference.json").is_file() else None


def _log_artifact(log_path: Path) -> dict[str, str]:
    """The variant's log, and those of the processes it ran beside it (its server, its load generator)."""
    beside = {f"logs/{name}.log": side_log(log_path.parent, log_path.stem, name) for name in SIDE_PROCESSES}
    logs = {"logs/variant.log": log_path, **beside}
    return {name: path.read_text(encoding="utf-8", errors="replace") for name, path in logs.items() if path.is_file()}
