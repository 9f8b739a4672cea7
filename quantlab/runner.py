"""Run one variant top to bottom: quantize -> load -> evaluate -> damage -> measure -> (its server:) evaluate on the
engine -> damage on the engine -> serve -> result.

It never talks to MLflow: the sweep logs the `VariantResult`, so any executor can run it anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from typing import TYPE_CHECKING

from quantlab.host_share import HostShare
from quantlab.jobs import BaselineOutputs, ServingTurns, StageReporter, VariantJob, VariantResult, disjoint_union

if TYPE_CHECKING:
    import torch

    from quantlab.models import ModelSource
    from quantlab.recipe import LoadedRecipe, VariantSpec
    from quantlab.stages.serve import Turns


def run_variant(
    job: VariantJob,
    report: StageReporter = lambda stage: None,
    host: HostShare | None = None,
    turns: ServingTurns | None = None,
) -> VariantResult:
    """`host`: the share of the host's cores the executor gave this process (None: torch's default, no seat). Its
    threads follow the models the variant loads; the timed stages (measure, serve) hold its timing lock. `turns`:
    given by an executor that interleaves its variants' load runs (None: they run back to back in the serve stage)."""
    # The stages load torch, transformers and lm-eval: imported here, in the variant's process,
    # so that the sweep's own process (which imports this module for its executors) stays light.
    from quantlab.models import load_checkpoint, materialize, pick_device, pick_dtype, resolve_source
    from quantlab.quantize import METHODS
    from quantlab.stages.evaluate import (
        adaptive_plan,
        answer_damage,
        engine_floor,
        engine_vs_reference,
        evaluate_served,
        evaluate_tasks,
        evaluation_max_length,
        served_token_damage,
        token_damage,
    )
    from quantlab.stages.measure import contention_over, measure
    from quantlab.stages.quantize import quantize_variant
    from quantlab.stages.serve import VariantServer, serve_load, single_stream

    recipe = job.loaded.recipe
    variant = recipe.variant(job.variant)
    recipe_dir = job.loaded.path.parent
    seconds: dict[str, float] = {}

    @contextmanager
    def stage(name: str) -> Iterator[None]:
        report(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            # A stage entered twice (the server's start, waited for in two places) adds up.
            seconds[name] = round(seconds.get(name, 0.0) + time.perf_counter() - started, 3)

    host = host or HostShare()
    device = pick_device(recipe.runtime)
    dtype = pick_dtype(recipe.runtime, device)
    stream = single_stream(recipe.serving, recipe.measure)  # batch size 1 timed once: by the serve stage, if it can

    with stage("prepare model"):
        source = materialize(job.source or resolve_source(recipe.model, recipe_dir), job.cache_root)
    with stage("quantize"):
        checkpoint = quantize_variant(
            source, variant, recipe.calibration, recipe_dir, job.cache_root, device, job.force, host.follow
        )
    payload = checkpoint.check_payload()  # a reused one's hashes, in the background while it loads and is scored
    stored_format = METHODS[variant.method].stored_format
    # One server per variant, for every stage that goes through the engine that ships.
    with VariantServer(
        checkpoint.path, variant.name, stored_format, recipe, device, dtype, job.cache_root, job.log_dir, job.node
    ) as server:
        with stage("load"):
            model, tokenizer = load_checkpoint(checkpoint.path, dtype, device)
            host.follow(model)
        server.launch_early()  # on CPU it starts while the reference stages run; a GPU's server waits for our model
        with stage("damage"):  # first: a variant its damage already rejects scores its tasks' first stages only
            tokens = token_damage(model, tokenizer, recipe.quality, recipe_dir, job, checkpoint.key)
        with stage("evaluate"):
            max_length = evaluation_max_length(model, tokenizer, recipe, checkpoint.path)  # the server's windows too
            plan = adaptive_plan(recipe, job, tokens)  # None: every document (evals.adaptive off, or the baseline)
            reference_scores = evaluate_tasks(
                model, tokenizer, recipe.evals, job.loaded.include_path, report, max_length, plan
            )
        payload.confirm()  # a payload changed on disk fails the variant here: nothing scored on it is logged
        with stage("start server"):
            server.wait_if_launched()  # nothing is timed while a server starts beside it
        with stage("measure"), host.timing():
            cost_metrics, cost_tags = measure(
                model, tokenizer, recipe.measure, checkpoint.path, seconds["load"], job.log_dir, stream
            )
        del model, tokenizer  # the server loads its own copy
        with stage("start server"):
            served = server.ready(scoring=True)  # prefix caching off: each answer as if served alone
        with stage("evaluate on engine"):
            served_scores = evaluate_served(served, recipe.evals, job.loaded.include_path, report, max_length, plan)
        with stage("damage on engine"):
            served_tokens = served_token_damage(served, recipe.quality, tokens.reference_dir, job.baseline)
        with stage("engine floor"):  # the baseline served again, otherwise batched: the engine against itself
            floor = engine_floor(
                served, job, recipe.evals, job.loaded.include_path, report, served_scores, served_tokens, max_length
            )
        # The scores of record come from the engine that ships when the recipe scores through it.
        scores = served_scores if recipe.evals.engine != "reference" else reference_scores
        outputs = BaselineOutputs(
            tokens.reference_dir,
            scores.documents | tokens.documents | served_tokens.documents,
            scores.groups,
            scores.scores,
            scores.primary,
        )
        with stage("start server"):
            served = server.ready(scoring=False)  # the load's levels: the engine as users serve it
        # On a GPU the next variant needs the memory this server holds: its turns would wait with it.
        interleaving = recipe.serving.enabled and recipe.serving.interleave and device == "cpu"
        serve_turns = ServeTurns(host, report, turns if interleaving else None)
        if job.is_baseline:  # where it waits for turns, the variants compared against it start now
            serve_turns.scored(outputs)
        with stage("serve"):
            serving = serve_load(
                served,
                recipe.serving,
                recipe.measure,
                recipe_dir,
                dtype,
                cost_metrics,
                job.log_dir,
                stream,
                serve_turns.turns(),
            )
        seconds |= serve_turns.waited_apart(seconds["serve"])

    answers = answer_damage(scores, job.baseline)
    agreement = engine_vs_reference(reference_scores, served_scores)
    # Each figure from one stage: a key two stages both gave would keep the later one's unseen.
    metrics = disjoint_union(
        "metric",
        {
            "evaluate": scores.metrics,
            "damage": tokens.metrics,
            "damage on engine": served_tokens.metrics,
            "answer damage": answers.metrics,
            "engine against reference": agreement.metrics,
            "engine floor": floor.metrics,
            "measure": cost_metrics,
            "serve": serving.metrics,
        },
    )
    params = disjoint_union(
        "param",
        {
            "variant": variant_params(job.loaded, variant, source, device, dtype, host),
            "evaluate": scores.params,
            "serve": serving.params,
            "scoring server": server.scoring_params(),
        },
    )
    # Both timed stages give a contention verdict: the variant's is the one over both.
    verdicts = contention_over(cost_tags, serving.tags)
    tags = disjoint_union(
        "tag",
        {
            "measure": _without(cost_tags, verdicts),
            "damage": tokens.tags,
            "damage on engine": served_tokens.tags,
            "evaluate": scores.tags,
            "answer damage": answers.tags,
            "engine against reference": agreement.tags,
            "engine floor": floor.tags,
            "serve": _without(serving.tags, verdicts),
            "contention": verdicts,
        },
    )
    return VariantResult(
        checkpoint=str(checkpoint.path),
        content_key=checkpoint.key,
        reused_checkpoint=checkpoint.reused,
        stage_seconds=seconds,
        metrics=metrics,
        params=params,
        tags=tags,
        baseline_outputs=outputs,
        artifacts=disjoint_union("artifact", {"answer damage": answers.artifacts, "serve": serving.artifacts}),
        datasets=scores.datasets,
    )


def _without(tags: dict[str, str], replaced: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in tags.items() if key not in replaced}


def variant_params(
    loaded: LoadedRecipe, variant: VariantSpec, source: ModelSource, device: str, dtype: torch.dtype, host: HostShare
) -> dict[str, str]:
    """A variant's full resolved configuration as flat MLflow params: what exactly produced these numbers."""
    import torch

    from quantlab.cache import library_versions
    from quantlab.measure.provenance import hardware

    recipe = loaded.recipe
    kv_cache = {"kv_cache": variant.kv_cache.model_dump()} if variant.kv_cache is not None else {}
    resolved = {
        "variant": {"name": variant.name, "method": variant.method, "params": variant.params.model_dump()} | kv_cache,
        "model": {**recipe.model.model_dump(), "identity": source.identity},
        "calibration": recipe.calibration.model_dump() if variant.needs_calibration else "not used",
        "evals": recipe.evals.model_dump(),
        "quality": recipe.quality.model_dump(),
        "measure": recipe.measure.model_dump(),
        "serving": recipe.serving.model_dump(),
        "runtime": {
            "device": device,
            "compute_dtype": str(dtype).removeprefix("torch."),
            # torch's intra-op threads in this process, as the executor sized them (host_share).
            "threads": torch.get_num_threads(),
            "threads_from": host.threads_from,
        },
        "versions": library_versions() | {"lm-eval": version("lm_eval"), "mlflow": version("mlflow")},
        "hardware": hardware(),
    }
    return flatten("", resolved)


def flatten(prefix: str, value: object) -> dict[str, str]:
    """Nested config -> dotted MLflow params ({"a": {"b": 1}} -> {"a.b": "1"}); a list of mappings by index."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, dict) for item in value):
        value = dict(enumerate(value))
    if not isinstance(value, dict):
        return {prefix: str(value)}
    flat: dict[str, str] = {}
    for key, item in value.items():
        flat.update(flatten(f"{prefix}.{key}" if prefix else str(key), item))
    return flat


class ServeTurns:
    """The serve stage's turns: each waits, where the executor interleaves the variants' load runs, for this variant's
    turn (timed apart from the stage, as `wait to serve`), then holds the host's timing lock."""

    def __init__(self, host: HostShare, report: StageReporter, executor_turns: ServingTurns | None) -> None:
        self.host, self.report, self.executor_turns = host, report, executor_turns
        self.waited = 0.0

    def scored(self, outputs: BaselineOutputs) -> None:
        if self.executor_turns is not None:
            self.executor_turns.scored(outputs)

    def turns(self) -> Turns:
        from quantlab.stages.serve import Turns

        return Turns(self._take, self._served, interleaved=self.executor_turns is not None)

    @contextmanager
    def _take(self) -> Iterator[None]:
        if self.executor_turns is not None:
            self._wait(self.executor_turns.wait)
        with self.host.timing():
            yield

    def _served(self) -> None:
        if self.executor_turns is not None:
            self._wait(self.executor_turns.served)

    def _wait(self, until: Callable[[], None]) -> None:
        """`until` returns, the seat on the host given up meanwhile, and the time it took counted apart."""
        started = time.perf_counter()
        self.report("wait to serve")
        with self.host.aside():
            until()
        self.report("serve")
        self.waited += time.perf_counter() - started

    def waited_apart(self, serve_seconds: float) -> dict[str, float]:
        """The serve stage's own seconds, and apart what it waited for the other variants (nothing where it did not)."""
        if not self.waited:
            return {}
        return {"serve": round(serve_seconds - self.waited, 3), "wait to serve": round(self.waited, 3)}
