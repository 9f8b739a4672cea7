"""A sweep: plan the variants, run each (baseline first), log each into MLflow, publish the frontier."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from quantlab import tracking
from quantlab.errors import BadInput, Problem
from quantlab.executors import VariantFailed, run_local
from quantlab.recipe import LoadedRecipe
from quantlab.runner import BaselineOutputs, VariantJob, VariantResult


class SweepDisplay(Protocol):
    def sweep_started(self, experiment: str, run_id: str, variants: list[str]) -> None: ...
    def stage(self, variant: str, stage: str) -> None: ...
    def variant_finished(self, variant: str, result: VariantResult | None, failure: str | None) -> None: ...


@dataclass(frozen=True)
class SweepOptions:
    tracking_uri: str
    cache_root: Path
    executor: Literal["local", "ray"] = "local"
    force: bool = False
    only: tuple[str, ...] = ()
    ray_address: str | None = None


@dataclass(frozen=True)
class SweepOutcome:
    experiment_id: str
    parent_run_id: str
    results: dict[str, VariantResult]
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0


def default_cache_root() -> Path:
    return Path(os.environ.get("QUANTLAB_CACHE_DIR") or Path.home() / ".cache" / "quantlab")


def plan(loaded: LoadedRecipe, only: tuple[str, ...]) -> list[str]:
    """Variant names in run order: the baseline first, since the others compare against it."""
    recipe = loaded.recipe
    names = [variant.name for variant in recipe.variants]
    unknown = [name for name in only if name not in names]
    if unknown:
        raise BadInput([Problem("--only", "", f"'{name}' is not a variant of {loaded.path.name}; variants: {', '.join(names)}") for name in unknown])
    chosen = [name for name in names if not only or name in only or name == recipe.baseline]
    return [recipe.baseline] + [name for name in chosen if name != recipe.baseline]


def run_sweep(loaded: LoadedRecipe, options: SweepOptions, display: SweepDisplay) -> SweepOutcome:
    from quantlab.publish import publish_sweep

    order = plan(loaded, options.only)
    store = tracking.open_store(options.tracking_uri)
    experiment = tracking.experiment_id(store, loaded.recipe.name)
    parent = tracking.start_run(store, experiment, f"sweep {loaded.recipe.name}", {tracking.ROLE: "sweep"})
    results: dict[str, VariantResult] = {}
    failures: dict[str, str] = {}
    try:
        tracking.log_text_artifacts(store, parent, {"recipe.yaml": loaded.text})
        tracking.log_values(store, parent, params={"recipe.path": str(loaded.path), "variants": ",".join(order)})
        display.sweep_started(loaded.recipe.name, parent, order)
        baseline: BaselineOutputs | None = None
        with tempfile.TemporaryDirectory(prefix="quantlab-logs-") as logs:
            for name in order:
                job = VariantJob(loaded, name, options.cache_root, baseline, options.force)
                result, failure = _run_and_log(store, experiment, parent, job, Path(logs) / f"{name}.log", display)
                if result is not None:
                    results[name] = result
                    if job.is_baseline:
                        baseline = result.baseline_outputs
                else:
                    failures[name] = failure or "unknown failure"
        publish_sweep(store, parent, loaded)
    except BaseException:
        tracking.finish(store, parent, "KILLED" if _interrupted() else "FAILED")
        raise
    tracking.finish(store, parent, "FINISHED" if not failures else "FAILED")
    return SweepOutcome(experiment, parent, results, failures)


def _interrupted() -> bool:
    import sys

    return isinstance(sys.exc_info()[1], KeyboardInterrupt)


def _run_and_log(
    store: tracking.Store, experiment: str, parent: str, job: VariantJob, log_path: Path, display: SweepDisplay
) -> tuple[VariantResult | None, str | None]:
    variant = job.loaded.recipe.variant(job.variant)
    run_id = tracking.start_run(
        store, experiment, variant.name,
        {tracking.ROLE: "variant", tracking.VARIANT: variant.name, tracking.METHOD: variant.method,
         "quantlab.baseline": str(job.is_baseline).lower()},
        parent=parent,
    )
    try:
        result = run_local(job, log_path, display.stage)
    except VariantFailed as failed:
        tracking.log_text_artifacts(store, run_id, {"failure/traceback.txt": failed.details, **_log_artifact(log_path)})
        tracking.log_values(store, run_id, tags={"quantlab.failure": failed.reason[:5000]})
        tracking.finish(store, run_id, "FAILED")
        display.variant_finished(variant.name, None, failed.reason)
        return None, failed.reason
    except BaseException:
        tracking.finish(store, run_id, "KILLED")
        raise
    tracking.log_values(
        store, run_id,
        metrics=result.metrics | {f"time/{stage}_seconds": seconds for stage, seconds in result.stage_seconds.items()},
        params=result.params,
        tags=result.tags | {tracking.CHECKPOINT: result.checkpoint, tracking.CONTENT_KEY: result.content_key,
                            "quantlab.checkpoint_reused": str(result.reused_checkpoint).lower()},
    )
    tracking.log_text_artifacts(store, run_id, {**result.artifacts, **_log_artifact(log_path),
                                                 "stage_seconds.json": json.dumps(result.stage_seconds, indent=2)})
    tracking.finish(store, run_id, "FINISHED")
    display.variant_finished(variant.name, result, None)
    return result, None


def _log_artifact(log_path: Path) -> dict[str, str]:
    return {"logs/variant.log": log_path.read_text(encoding="utf-8", errors="replace")} if log_path.is_file() else {}
