"""Run one variant top to bottom: quantize -> load -> evaluate -> damage -> measure -> result.

This runs inside the variant's own process (see executors.py). It never talks to MLflow: it
returns a `VariantResult` that the sweep logs, so any executor can run it anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quantlab.paired import DocumentScores, documents_from_json, documents_to_json
from quantlab.recipe import LoadedRecipe

if TYPE_CHECKING:
    from quantlab.evaluate.lm_eval_runner import TaskDataset

StageReporter = Callable[[str], None]


SAMPLES_FORMAT = 2  # version of the per-document record a variant run keeps (samples.json)


@dataclass(frozen=True)
class GroupParts:
    """An lm-eval group score as lm-eval computed it: sum(weight * leaf score)."""

    leaves: tuple[str, ...]  # leaf score keys, eval/<leaf>/<metric>[:<filter>]
    weights: tuple[float, ...]


@dataclass(frozen=True)
class BaselineOutputs:
    """What later variants compare themselves against; every variant run keeps its own as
    `samples.json`, and a reused baseline run is read back from it.

    samples.json (version 2)::

        {"version": 2,
         "documents": paired.documents_to_json({score key: DocumentScores}),  # every analysable lm-eval score,
                                                                              # and quality/{ppl,kld_mean,top1_agreement} per token
         "groups": {group score key: {"leaves": [leaf score key, ...], "weights": [w, ...]}},
         "scores": {score key: value},          # every lm-eval score logged (recovery's input)
         "primary": {task: score key}}          # each task's primary score (flips' input)

    Score keys are `eval/<task>/<metric>[:<filter>]` (quantlab.metrics); a group's paired
    comparison is `paired.combine` of its leaves' with these weights.
    """

    reference_dir: str | None
    documents: dict[str, DocumentScores] = field(default_factory=dict)
    groups: dict[str, GroupParts] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    primary: dict[str, str] = field(default_factory=dict)

    def to_samples(self) -> dict:
        return {
            "version": SAMPLES_FORMAT,
            "documents": documents_to_json(self.documents),
            "groups": {key: {"leaves": list(g.leaves), "weights": list(g.weights)} for key, g in self.groups.items()},
            "scores": dict(self.scores),
            "primary": dict(self.primary),
        }

    @classmethod
    def from_samples(cls, data: dict, reference_dir: str | None) -> BaselineOutputs:
        if data.get("version") != SAMPLES_FORMAT:
            raise ValueError(f"samples.json of version {data.get('version', 1)}; this quantlab reads version {SAMPLES_FORMAT}")
        return cls(
            reference_dir,
            documents_from_json(data["documents"]),
            {key: GroupParts(tuple(g["leaves"]), tuple(float(w) for w in g["weights"])) for key, g in data["groups"].items()},
            {key: float(value) for key, value in data["scores"].items()},
            dict(data["primary"]),
        )


@dataclass(frozen=True)
class VariantJob:
    loaded: LoadedRecipe
    variant: str
    cache_root: Path
    baseline: BaselineOutputs | None  # None for the baseline itself
    force: bool = False  # rebuild the checkpoint and the baseline's reference pass even when cached

    @property
    def is_baseline(self) -> bool:
        return self.variant == self.loaded.recipe.baseline


@dataclass(frozen=True)
class VariantResult:
    name: str
    method: str
    checkpoint: str
    content_key: str
    reused_checkpoint: bool
    stage_seconds: dict[str, float]
    metrics: dict[str, float]
    params: dict[str, str]
    tags: dict[str, str]
    baseline_outputs: BaselineOutputs
    artifacts: dict[str, str] = field(default_factory=dict)
    datasets: tuple[TaskDataset, ...] = ()  # the lm-eval tasks scored, as MLflow dataset inputs


class _StageClock:
    def __init__(self, report: StageReporter):
        self.report = report
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.report(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(time.perf_counter() - started, 3)


def run_variant(job: VariantJob, report: StageReporter = lambda stage: None) -> VariantResult:
    from quantlab.evaluate.stage import answer_damage, evaluate_tasks, token_damage
    from quantlab.measure.stage import measure
    from quantlab.models import (
        load_checkpoint,
        materialize,
        pick_device,
        pick_dtype,
        resolve_source,
    )
    from quantlab.quantize.stage import quantize_variant
    from quantlab.variant_config import variant_params

    recipe = job.loaded.recipe
    variant = recipe.variant(job.variant)
    recipe_dir = job.loaded.path.parent
    clock = _StageClock(report)
    device = pick_device(recipe.runtime)
    dtype = pick_dtype(recipe.runtime, device)

    with clock.stage("prepare model"):
        source = materialize(resolve_source(recipe.model, recipe_dir), job.cache_root)
    with clock.stage("quantize"):
        checkpoint = quantize_variant(source, variant, recipe.calibration, recipe_dir, job.cache_root, device, job.force)
    with clock.stage("load"):
        model, tokenizer = load_checkpoint(checkpoint.path, dtype, device)
    load_seconds = clock.seconds["load"]
    with clock.stage("evaluate"):
        scores = evaluate_tasks(model, tokenizer, recipe.evals, job.loaded.include_path, report)
    with clock.stage("damage"):
        tokens = token_damage(model, tokenizer, recipe.quality, recipe_dir, job, checkpoint.key)
        answers = answer_damage(scores, job.baseline)
    with clock.stage("measure"):
        cost = measure(model, tokenizer, recipe.measure, checkpoint.path, load_seconds)

    return VariantResult(
        name=variant.name,
        method=variant.method,
        checkpoint=str(checkpoint.path),
        content_key=checkpoint.key,
        reused_checkpoint=checkpoint.reused,
        stage_seconds=clock.seconds,
        metrics={**scores.metrics, **tokens.metrics, **answers.metrics, **cost.metrics},
        params={**variant_params(job.loaded, variant, source, device, dtype), **scores.params},
        tags={**cost.tags, **tokens.tags, **scores.tags, **answers.tags},
        baseline_outputs=BaselineOutputs(tokens.reference_dir, scores.documents | tokens.documents, scores.groups, scores.scores, scores.primary),
        artifacts=answers.artifacts,
        datasets=scores.datasets,
    )
