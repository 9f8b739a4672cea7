"""A sweep's runs in MLflow: its parent run, a nested run per variant, and what each logs, retried while the
store fails. Every computed result is kept in the cache before the store is asked (`kept_results`): a store
that is down, slow or refusing when a variant finishes costs that variant its run for now, never its numbers.

Runs left RUNNING by a sweep that died on this host are marked KILLED when the next one starts (`Logbook.start`).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from quantlab import kept_results, tracking
from quantlab.errors import first_line
from quantlab.jobs import SIDE_PROCESSES, BaselineOutputs, VariantResult, side_log
from quantlab.kept_results import KeptResult
from quantlab.plan import FinishedRuns, PlannedVariant, SweepPlan
from quantlab.tracking import SAMPLES_ARTIFACT

HOST, PID = "quantlab.host", "quantlab.pid"
LOGGED_FROM_CACHE = "quantlab.logged_from_cache"  # when its numbers were computed, by a sweep that could not log them
PID_STARTED = "quantlab.pid_started"  # the sweep process's start time: with host and pid, who it was
REFERENCE_DIR = "quantlab.reference_dir"

Note = Callable[[str, str], None]  # (variant, text): a line under the variant on the sweep's display


def finished_runs_of(store: tracking.TrackingStore) -> FinishedRuns:
    """What the plan asks the store: the newest finished variant run of each key (a value of `tag`), in an
    experiment."""
    return lambda experiment, keys, tag: tracking.finished_runs(store, store.experiment_id(experiment), set(keys), tag)


@dataclass
class Logbook:
    """The runs of one sweep of `plan`, from `start` (its parent run) on. A variant's run is made at its first stage
    (or when its result is logged); each method that logs returns why the store does not have it yet (None: logged)."""

    store: tracking.TrackingStore
    plan: SweepPlan
    retry_seconds: float  # how long a finished variant's logging is retried while the store fails
    note: Note
    experiment_id: str = ""  # set by `start`
    parent_run_id: str = ""  # set by `start`
    runs: dict[str, str] = field(default_factory=dict)  # variant -> its run in this sweep

    def start(self) -> None:
        """The sweep's parent run, started once dead sweeps' runs are marked KILLED."""
        name = self.plan.loaded.recipe.name
        self.experiment_id = self.store.experiment_id(name)
        mark_dead_sweeps(self.store, self.experiment_id)
        self.parent_run_id = tracking.start_sweep(self.store, self.experiment_id, f"sweep {name}", sweep_process_tags())

    def describe_sweep(self) -> None:
        """The parent run's recipe and variants."""
        loaded = self.plan.loaded
        self.store.log_files(self.parent_run_id, {"recipe.yaml": loaded.text})
        variants = ",".join(self.plan.names)
        self.store.log_values(self.parent_run_id, params={"recipe.path": str(loaded.path), "variants": variants})

    def stage(self, name: str) -> None:
        """A variant reached a stage: its run exists from now on (if the store takes it; else when it is logged)."""
        try:
            self._run_for(name)
        except tracking.store_errors() as error:
            self.note(name, f"the tracking store failed ({first_line(error)}); the variant goes on")

    def log_result(self, variant: PlannedVariant, result: VariantResult, log_path: Path) -> str | None:
        """A computed variant's result: kept in the cache first, then logged."""
        kept = KeptResult(
            variant=variant.name,
            run_key=variant.run_key,
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
            kept_results.keep(self.plan.cache_root, kept)
        except OSError as error:  # a safety net that failed (a full disk): the store may still take it
            self.note(variant.name, f"could not keep its result in the cache ({error}); logging it directly")
        return self._logged(kept)

    def log_kept(self, variant: PlannedVariant) -> str | None:
        """A result an earlier sweep computed but could not log: logged now, under this sweep's name for it."""
        kept = variant.kept  # the plan's LOG_KEPT variants carry it
        renamed = {"variant.name": variant.name} if "variant.name" in kept.params else {}
        tags = kept.tags | {LOGGED_FROM_CACHE: kept.finished_at}
        return self._logged(replace(kept, variant=variant.name, params=kept.params | renamed, tags=tags))

    def log_failure(self, name: str, reason: str, details: str, log_path: Path) -> str | None:
        files = {"failure/traceback.txt": details, **_log_artifact(log_path)}
        try:
            tracking.with_retries(
                lambda: tracking.log_failure(self.store, self._run_for(name), reason, files), self.retry_seconds
            )
        except tracking.store_errors() as error:
            return f"{first_line(error)}; its failure is not logged"
        return None

    def copy(self, variant: PlannedVariant) -> None:
        """A finished run with the same run key: its numbers hold for this sweep, under this sweep's name for it."""
        if why := tracking.copy_run(self.store, variant.finished_run, self._run_for(variant.name)):
            self.note(variant.name, why)
        kept_results.discard(self.plan.cache_root, variant.run_key)

    def baseline_of(self, run: tracking.RunRecord) -> BaselineOutputs:
        """The baseline's outputs, read back from a finished run; ValueError if it has no samples (ends the sweep)."""
        samples = self.store.read_artifact(run.run_id, SAMPLES_ARTIFACT)
        if samples is None:
            raise ValueError(f"the reused baseline run has no {SAMPLES_ARTIFACT}")
        return BaselineOutputs.from_samples(json.loads(samples), usable_reference(run.tags.get(REFERENCE_DIR)))

    def publish(self) -> str | None:
        """The frontier and report over every variant, once all of them are logged (a later sweep publishes them)."""
        from quantlab.publish import DRAWN_FIGURES_DIR, publish_sweep

        try:
            drawn = self.plan.cache_root / DRAWN_FIGURES_DIR
            tracking.with_retries(lambda: publish_sweep(self.store, self.parent_run_id, drawn), self.retry_seconds)
        except tracking.store_errors() as error:
            return first_line(error)
        return None

    def finish(self, status: str) -> None:
        """End the parent run; a store still failing leaves it RUNNING, for the next sweep to mark KILLED."""
        with suppress(*tracking.store_errors()):
            tracking.with_retries(lambda: self.store.finish(self.parent_run_id, status), self.retry_seconds)

    def abandon(self, status: str, reason: str) -> None:
        """The sweep is dying (`reason`): no run of it may stay RUNNING (unless the store is what failed)."""
        tracking.end_unfinished(self.store, [*self.runs.values(), self.parent_run_id], status, reason)

    def _run_for(self, name: str) -> str:
        if name not in self.runs:
            recipe = self.plan.loaded.recipe
            self.runs[name] = tracking.start_variant(
                self.store,
                self.experiment_id,
                self.parent_run_id,
                name,
                recipe.variant(name).method,
                baseline=name == recipe.baseline,
                run_key=self.plan.variant(name).run_key,
                settings_key=self.plan.variant(name).settings_key,
                results_version=self.plan.results_version,
            )
        return self.runs[name]

    def _logged(self, kept: KeptResult) -> str | None:
        """Log a kept result, retrying while the store fails; once logged, it leaves the cache."""
        name = kept.variant

        def log() -> str | None:
            return tracking.log_variant(
                self.store,
                self._run_for(name),
                metrics=kept.metrics,
                params=kept.params,
                tags=kept.tags,
                datasets=kept.datasets,
                files=kept.files,
            )

        def retrying(error: BaseException, wait: float) -> None:
            self.note(name, f"logging failed ({first_line(error)}); trying again in {wait:.0f} s")

        try:
            if no_model := tracking.with_retries(log, self.retry_seconds, retrying):
                self.note(name, no_model)
        except tracking.store_errors() as error:
            where = kept_results.kept_dir(self.plan.cache_root, kept.run_key)
            why = f"{first_line(error)}; its result is kept in {where}"
            self.note(name, f"[red]not logged[/]: {why}")
            return why
        kept_results.discard(self.plan.cache_root, kept.run_key)
        return None


def kept_baseline(kept: KeptResult) -> BaselineOutputs:
    """The baseline's outputs from a result an earlier sweep kept."""
    samples = json.loads(kept.files[SAMPLES_ARTIFACT])
    return BaselineOutputs.from_samples(samples, usable_reference(kept.tags.get(REFERENCE_DIR)))


def usable_reference(reference_dir: str | None) -> str | None:
    """The baseline's reference pass directory, if it is still there to compare against."""
    return reference_dir if reference_dir and Path(reference_dir, "reference.json").is_file() else None


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


def _log_artifact(log_path: Path) -> dict[str, str]:
    """The variant's log, and those of the processes it ran beside it (its server, its load generator)."""
    beside = {f"logs/{name}.log": side_log(log_path.parent, log_path.stem, name) for name in SIDE_PROCESSES}
    logs = {"logs/variant.log": log_path, **beside}
    return {name: path.read_text(encoding="utf-8", errors="replace") for name, path in logs.items() if path.is_file()}
