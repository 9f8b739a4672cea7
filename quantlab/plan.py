"""A sweep's plan, made once before any work (`make_plan`): the recipe's model resolved once (a GGUF file hashed
once), and per variant, in run order (the baseline first: the others compare against it), its run key, its
checkpoint's key and folder, what happens to it (copied from a finished run, logged from the cache, computed)
and the cache bytes computing it writes. The disk check (`space_needs`), the sweep's dispatcher and the
command line's "what will run" line read it; nothing recomputes it.

It is made in one direction: the variants in run order, the model and each checkpoint's identity, the keys and
folders, what earlier sweeps left (kept in the cache, finished in the store), then the bytes (`disk`).

Resuming is by content: a finished run with the same run key is copied, not recomputed (`--force` recomputes).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

from quantlab import cache, disk, kept_results
from quantlab.errors import BadInput, Problem
from quantlab.jobs import SAMPLES_FORMAT, BaselineOutputs, VariantJob
from quantlab.kept_results import KeptResult
from quantlab.metrics import contract_digest
from quantlab.models import ModelSource, checkpoint_identity, materialized, resolve_source
from quantlab.recipe import LoadedRecipe
from quantlab.serving.engines import ENGINES
from quantlab.serving.environments import engine_identity
from quantlab.tracking import RESULTS_VERSION, RUN_KEY, SETTINGS_KEY, RunRecord

# Bumped by a review that changes how a logged figure is computed while the metric contract and the stored formats
# stay as they were (a figure's bug fixed): runs logged before are then recomputed, not copied.
RESULTS_REVIEW = 1


class Action(str, Enum):
    COPY = "copied"  # a finished run with the same run key: its numbers hold, copied under this sweep
    LOG_KEPT = "logged from the cache"  # computed by an earlier sweep that could not log it
    COMPUTE = "computed"


@dataclass(frozen=True)
class PlannedVariant:
    name: str
    run_key: str  # content hash of everything that decides its logged numbers
    checkpoint_key: str  # content hash of everything that decides its checkpoint's bytes
    checkpoint_dir: Path
    action: Action
    finished_run: RunRecord | None = None  # COPY: the run copied
    settings_key: str = ""  # the run key without the results version: the same recipe and checkpoint
    recomputed_because: str = ""  # COMPUTE: why a finished run of the same settings was not copied
    kept: KeptResult | None = None  # LOG_KEPT: the result logged
    builds_checkpoint: bool = False  # computed, and the cache lacks its checkpoint (or --force rebuilds it)
    checkpoint_bytes: int = 0  # the checkpoint it builds, modeled with a margin (0: none, or the shape is unknown)
    replaced_bytes: int = 0  # what --force removes first: the cached copy it rebuilds

    @property
    def cache_bytes(self) -> int:
        """What computing it adds to the cache."""
        return self.checkpoint_bytes - self.replaced_bytes


@dataclass(frozen=True)
class SweepPlan:
    loaded: LoadedRecipe
    source: ModelSource  # the recipe's model, resolved once
    cache_root: Path
    force: bool
    variants: tuple[PlannedVariant, ...]  # run order: the baseline first
    estimated: bool = False  # bytes estimated: a variant is computed and the model's shape is at hand
    # What the computed variants will write into the cache: a GGUF model's conversion when the cache lacks it, and
    # the checkpoints it lacks (with --force, each one, less the copy it replaces). Empty when nothing is estimated.
    space_needs: tuple[disk.Need, ...] = ()
    results_version: str = ""  # plan.results_version: part of every run key, tagged on every variant run

    @property
    def baseline(self) -> PlannedVariant:
        return self.variants[0]

    @property
    def others(self) -> tuple[PlannedVariant, ...]:
        return self.variants[1:]

    @property
    def names(self) -> list[str]:
        return [variant.name for variant in self.variants]

    def variant(self, name: str) -> PlannedVariant:
        return next(variant for variant in self.variants if variant.name == name)

    @property
    def computes(self) -> bool:
        return any(variant.action is Action.COMPUTE for variant in self.variants)

    def job(self, variant: PlannedVariant, baseline: BaselineOutputs | None, log_dir: Path) -> VariantJob:
        """What the executor runs for a computed variant; `baseline`: the baseline's outputs (None for itself)."""
        return VariantJob(self.loaded, variant.name, self.cache_root, baseline, self.force, log_dir, self.source)


# (experiment, keys, the tag they are values of) -> the newest finished variant run of each key there: what the plan
# asks the store (by run key; for variants it computes, by settings key)
FinishedRuns = Callable[[str, Collection[str], str], Mapping[str, RunRecord]]


def served_scoring_protocol(engine: str) -> dict[str, str] | None:
    """The scoring protocol of the recipe's engine (`Engine.scoring_protocol`), as a run key holds it."""
    protocol = ENGINES[engine].scoring_protocol
    return None if protocol is None else asdict(protocol)


def make_plan(
    loaded: LoadedRecipe, cache_root: Path, only: tuple[str, ...], force: bool, finished_runs: FinishedRuns
) -> SweepPlan:
    """The plan of a sweep of `loaded` (`only`: --only's variants, with the baseline). BadInput for an --only name
    that is no variant, before anything is resolved or looked up. `finished_runs` is asked once, unless `force`."""
    recipe = loaded.recipe
    names = run_order(loaded, only)
    source = resolve_source(recipe.model, loaded.path.parent)
    shape_from = materialized(source, cache_root)  # the model as the cache has it: a GGUF file until it is converted
    identities = {name: checkpoint_identity(source, recipe.variant(name), recipe.calibration) for name in names}
    # A variant's run key hashes everything that decides its logged numbers: its checkpoint's identity, what it
    # shares with the others, and how this quantlab computes and stores them (results_version).
    shared = {
        "evals": recipe.evals.model_dump(exclude={"include_path"}),
        "tasks_files": cache.tasks_digest(loaded.include_path),
        "quality": recipe.quality.model_dump(),
        "measure": recipe.measure.model_dump(),
        "serving": recipe.serving.model_dump(),
        "runtime": recipe.runtime.model_dump(),
        "baseline": identities[recipe.baseline],
    }
    if recipe.needs_server:
        shared["engine"] = engine_identity(recipe.serving, recipe.runtime.device, cache_root)
    if recipe.evals.engine != "reference":  # kept served scores came through the same requests
        shared["served_scoring"] = served_scoring_protocol(recipe.serving.engine)
    if recipe.evals.adaptive:  # where a variant's tasks stop depends on the limits they are checked against
        shared["stopping_policy"] = recipe.frontier.default_policy.model_dump(mode="json")
    settings_keys = {name: cache.cache_key({"checkpoint": identity, **shared}) for name, identity in identities.items()}
    results = results_version()
    run_keys = {name: cache.cache_key({"settings": key, "results": results}) for name, key in settings_keys.items()}
    keys = {name: cache.cache_key(identity) for name, identity in identities.items()}
    targets = {name: cache.checkpoint_dir(cache_root, name, keys[name]) for name in names}
    # What earlier sweeps left: results they computed but could not log (kept in the cache; one this version cannot
    # read counts as none), and finished runs. A finished run wins (its kept copy, when its removal failed, is unused).
    kept: dict[str, KeptResult] = {}
    finished: Mapping[str, RunRecord] = {}
    if not force:
        kept = {name: found for name in names if (found := kept_results.recall(cache_root, run_keys[name]))}
        finished = finished_runs(recipe.name, set(run_keys.values()), RUN_KEY)
    previous = {name: finished[run_keys[name]] for name in names if run_keys[name] in finished}
    logged = {name: result for name, result in kept.items() if name not in previous}
    computed = [name for name in names if name not in previous and name not in logged]
    # Runs of the same settings logged by another results version: said, so a figure this version adds is never
    # silently missing from a copy, nor recomputed without a word.
    outdated = {}
    if computed and not force:
        found = finished_runs(recipe.name, {settings_keys[name] for name in computed}, SETTINGS_KEY)
        outdated = {name: found[settings_keys[name]] for name in computed if settings_keys[name] in found}
    # The marker alone: reading a checkpoint is not using it (the cache inventory's last use).
    building = [name for name in computed if force or not (targets[name] / cache.COMPLETE_MARKER).is_file()]
    # The bytes, from the model's shape (a directory's config.json, a cached hub config, or a GGUF file's metadata,
    # which takes seconds to read), read only when a variant is computed; None when it is not at hand.
    writes = disk.cache_writes(shape_from, [recipe.variant(name) for name in building]) if computed else None
    modeled = writes.checkpoints if writes is not None else {}
    replaced = {  # what --force removes first: the cached copy it rebuilds
        name: sum(path.stat().st_size for path in targets[name].rglob("*") if path.is_file()) if force else 0
        for name in modeled
    }
    variants = tuple(
        PlannedVariant(
            name,
            run_keys[name],
            keys[name],
            targets[name],
            Action.COPY if name in previous else Action.LOG_KEPT if name in logged else Action.COMPUTE,
            finished_run=previous.get(name),
            settings_key=settings_keys[name],
            recomputed_because=_results_changed(outdated[name], results) if name in outdated else "",
            kept=logged.get(name),
            builds_checkpoint=name in building,
            checkpoint_bytes=modeled.get(name, 0),
            replaced_bytes=replaced.get(name, 0),
        )
        for name in names
    )
    needs = tuple(writes.needs(cache_root, sum(replaced.values()))) if writes is not None else ()
    return SweepPlan(loaded, source, cache_root, force, variants, writes is not None, needs, results)


def results_version() -> str:
    """How this quantlab computes and stores a variant's numbers, apart from any recipe: the metric contract's digest,
    the per-document records' format and the review number. Part of every run key."""
    return cache.cache_key({"contract": contract_digest(), "samples": SAMPLES_FORMAT, "review": RESULTS_REVIEW})[:12]


def _results_changed(run: RunRecord, results: str) -> str:
    before = run.tags.get(RESULTS_VERSION, "unrecorded")
    return f"recomputed: results changed since run {run.run_id} (results version {before} -> {results})"


def run_order(loaded: LoadedRecipe, only: tuple[str, ...]) -> list[str]:
    """Variant names in run order: the baseline first, since the others compare against it."""
    recipe = loaded.recipe
    names = [variant.name for variant in recipe.variants]
    if unknown := [name for name in only if name not in names]:
        known = f"is not a variant of {loaded.path.name}; variants: {', '.join(names)}"
        raise BadInput([Problem("--only", "", f"'{name}' {known}") for name in unknown])
    return [recipe.baseline] + [name for name in names if name != recipe.baseline and (not only or name in only)]
