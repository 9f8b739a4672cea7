"""A sweep, top to bottom (`run_sweep`): plan it, check the plan fits, start the parent run, run the baseline, run
the others, publish the frontier and report.

The plan (`quantlab.plan`) says what happens to each variant; the dispatch here does it (copies a finished run,
logs a kept result, or runs the variant on the executor) and records what came of it in the outcome that the
command line reads; the logbook (`quantlab.logbook`) is its MLflow side. The baseline runs first, alone, and its
outputs are handed to the others' jobs. When it fails there is nothing to compare against: the variants still
to compute are not run (each fails saying so; the next sweep runs them), those copied or logged from the cache
are logged as usual.
"""

from __future__ import annotations

import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from quantlab import disk, stopping, tracking
from quantlab.checks import remember_lookups
from quantlab.executors import (
    EXECUTORS,
    InProcessExecutor,
    LocalExecutor,
    RayExecutor,
    VariantFailed,
    stop_variant_processes,
)
from quantlab.jobs import BaselineOutputs, VariantResult
from quantlab.logbook import Logbook, finished_runs_of, kept_baseline
from quantlab.plan import Action, PlannedVariant, SweepPlan, make_plan
from quantlab.recipe import LoadedRecipe


class SweepDisplay(Protocol):
    def sweep_started(self, experiment: str, run_id: str, plan: SweepPlan) -> None: ...
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


@dataclass
class SweepOutcome:
    """What came of a sweep, variant by variant (`run_sweep` returns it; the command line reads it)."""

    experiment_id: str
    parent_run_id: str
    finished: list[str] = field(default_factory=list)  # computed and logged
    reused: list[str] = field(default_factory=list)  # copied from a finished run
    logged_from_cache: list[str] = field(default_factory=list)  # computed by an earlier sweep, logged by this one
    failures: dict[str, str] = field(default_factory=dict)  # variant -> why it failed
    unlogged: dict[str, str] = field(default_factory=dict)  # variant (or the report) -> why the store lacks it yet

    @property
    def exit_code(self) -> int:
        return 1 if self.failures or self.unlogged else 0


@dataclass(frozen=True)
class NoBaseline:
    """What the other variants get when the baseline failed: nothing to compare against."""

    variant: str
    reason: str

    @property
    def not_run(self) -> str:
        return f"not run: the baseline {self.variant} failed, and every variant is compared against it ({self.reason})"


def run_sweep(loaded: LoadedRecipe, options: SweepOptions, display: SweepDisplay) -> SweepOutcome:
    store = tracking.open_store(options.tracking_uri)
    plan = make_plan(loaded, options.cache_root, options.only, options.force, finished_runs_of(store))
    needs = [*plan.space_needs, *disk.artifact_needs(store.uri, runs=len(plan.variants) + 1)]  # + the parent run
    disk.refuse_sweep(needs)  # bad input, before any run
    if not plan.computes:  # the fork server's imports would only compete
        stop_variant_processes()
    remember_lookups(loaded, options.cache_root)
    log = Logbook(store, plan, options.log_retry_seconds, display.note)
    log.start()
    outcome = SweepOutcome(log.experiment_id, log.parent_run_id)
    # A stop that cannot wait for this block (or for the abandoning below) ends the runs itself.
    with stopping.on_force(lambda why: log.abandon("KILLED", why)):
        try:
            log.describe_sweep()
            display.sweep_started(loaded.recipe.name, log.parent_run_id, plan)
            with _log_folder(options) as logs:
                executor = EXECUTORS[options.executor](options.ray_address, options.parallel)
                dispatch = Dispatch(plan, options, log, display, outcome, logs, executor)
                try:
                    baseline = dispatch.baseline()
                    dispatch.others(baseline)
                finally:
                    executor.close()
            if not outcome.unlogged and (why := log.publish()) is not None:  # else a later sweep publishes them
                outcome.unlogged["frontier and report"] = why
        except BaseException as error:
            log.abandon("KILLED" if stopping.stopped(error) else "FAILED", stopping.reason(error))
            raise
    log.finish("FINISHED" if outcome.exit_code == 0 else "FAILED")
    return outcome


@contextmanager
def _log_folder(options: SweepOptions) -> Iterator[Path]:
    """Where the variants write their logs for the sweep's lifetime. Ray workers on other nodes write theirs where
    the driver can read them: under the cache directory, which a cluster shares (a local /tmp would not be there)."""
    log_root = options.cache_root / "logs" if options.executor == "ray" else None
    if log_root is not None:
        log_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="quantlab-logs-", dir=log_root) as logs:
        yield Path(logs)


@dataclass
class Dispatch:
    """Does to each variant what the plan says (copy a finished run, log a kept result, or run it on the executor)
    and records what came of it in the outcome."""

    plan: SweepPlan
    options: SweepOptions
    log: Logbook
    display: SweepDisplay
    outcome: SweepOutcome
    logs: Path  # the folder of the variants' log files
    executor: LocalExecutor | InProcessExecutor | RayExecutor  # one for the sweep: it may keep the baseline waiting

    def baseline(self) -> BaselineOutputs | NoBaseline:
        """The baseline, alone: what the others compare against, from its result (logged or not), its copied run
        or its kept result."""
        variant = self.plan.baseline
        if variant.action is Action.COMPUTE:
            # Held where the executor interleaves serving: the baseline serves in turn with the others, later.
            computed = self._compute([variant], None, hold=True)[variant.name]
            if isinstance(computed, VariantFailed):
                return NoBaseline(variant.name, computed.reason)
            return computed if isinstance(computed, BaselineOutputs) else computed.baseline_outputs
        if variant.action is Action.COPY:  # read before the copy: a baseline run without samples ends the sweep
            outputs = self.log.baseline_of(variant.finished_run)
        else:
            outputs = kept_baseline(variant.kept)
        self._reuse(variant)
        return outputs

    def others(self, baseline: BaselineOutputs | NoBaseline) -> None:
        """Every other variant, compared against `baseline`; those copied or logged from the cache first."""
        to_compute = []
        for variant in self.plan.others:
            if variant.action is not Action.COMPUTE:
                self._reuse(variant)
            elif isinstance(baseline, NoBaseline):
                self._failed(variant.name, VariantFailed(baseline.not_run, ""), self.logs / f"{variant.name}.log")
            else:
                to_compute.append(variant)
        to_compute = to_compute if isinstance(baseline, BaselineOutputs) else []
        if to_compute or self.plan.baseline.action is Action.COMPUTE:  # the executor may keep the baseline waiting
            self._compute(to_compute, baseline)

    def _reuse(self, variant: PlannedVariant) -> None:
        if variant.action is Action.COPY:
            self.log.copy(variant)
            self.outcome.reused.append(variant.name)
            how = "unchanged since a finished run, copied from it"
            self.display.variant_finished(variant.name, None, None, reused=how)
        elif (why := self.log.log_kept(variant)) is not None:
            self.outcome.unlogged[variant.name] = why
        else:
            self.outcome.logged_from_cache.append(variant.name)
            how = f"computed at {variant.kept.finished_at} by a sweep that could not log it; logged now from the cache"
            self.display.variant_finished(variant.name, None, None, reused=how)

    def _compute(
        self, variants: list[PlannedVariant], baseline: BaselineOutputs | NoBaseline | None, hold: bool = False
    ) -> dict[str, VariantResult | VariantFailed | BaselineOutputs]:
        """Run the variants on the executor, logging each outcome as it comes (a variant it kept waiting from an earlier
        run too); every outcome by variant: its outputs where it is still kept waiting (`hold`)."""
        compared = baseline if isinstance(baseline, BaselineOutputs) else None
        jobs = [self.plan.job(variant, compared, self.logs) for variant in variants]
        outcomes: dict[str, VariantResult | VariantFailed | BaselineOutputs] = {}
        for job, outcome, log_path in self.executor.run(jobs, self.logs, self._stage, hold=hold):
            outcomes[job.variant] = outcome
            if isinstance(outcome, BaselineOutputs):  # scored; its result comes once it has served
                continue
            if isinstance(outcome, VariantResult):
                try:
                    self._finished(self.plan.variant(job.variant), outcome, log_path)
                    continue
                except Exception as error:  # noqa: BLE001 - one variant's bad record must not end the sweep
                    outcome = VariantFailed(f"logging its result failed: {error}", traceback.format_exc())
            self._failed(job.variant, outcome, log_path)
        return outcomes

    def _stage(self, name: str, stage: str) -> None:
        stopping.raise_if_stopped()  # a stop whose first raise was swallowed (quantlab.stopping.raise_if_stopped)
        self.log.stage(name)
        self.display.stage(name, stage)

    def _finished(self, variant: PlannedVariant, result: VariantResult, log_path: Path) -> None:
        if (why := self.log.log_result(variant, result, log_path)) is not None:
            self.outcome.unlogged[variant.name] = why
            return
        self.outcome.finished.append(variant.name)
        self.display.variant_finished(variant.name, result, None)

    def _failed(self, name: str, failed: VariantFailed, log_path: Path) -> None:
        self.outcome.failures[name] = failed.reason
        if (why := self.log.log_failure(name, failed.reason, failed.details, log_path)) is not None:
            self.outcome.unlogged[name] = why
        self.display.variant_finished(name, None, failed.reason)
