"""The evaluate and damage stages of a variant, as the runner sees them: results in, metrics out."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from quantlab import cache
from quantlab.corpora import load_texts
from quantlab.evaluate.damage import flip_metrics, paired_flips, recovery
from quantlab.metrics import (
    ENGINE_FLOOR_PREFIX,
    ENGINE_VS_REFERENCE_PREFIX,
    PAIRED_PREFIX,
    Declared,
    declared_tags,
    paired_key,
    unknown_directions,
)
from quantlab.paired import DocumentScores, Group, NotPaired, PairedComparison, combine, compare

if TYPE_CHECKING:
    from quantlab.evaluate.lm_eval_runner import TaskDataset, TaskRequest, TaskScores
    from quantlab.evaluate.served_damage import ServedPass
    from quantlab.jobs import BaselineOutputs, StageReporter, VariantJob
    from quantlab.recipe import EvalSettings, QualitySettings, Recipe
    from quantlab.stages.serve import ServedVariant


@dataclass(frozen=True)
class EvalOutcome:
    metrics: dict[str, float] = field(default_factory=dict)  # eval/<task>/<metric>[:<filter>] and its _stderr
    scores: dict[str, float] = field(default_factory=dict)  # score key -> value (recovery's input)
    documents: dict[str, DocumentScores] = field(default_factory=dict)  # score key -> per document (paired input)
    groups: dict[str, Group] = field(default_factory=dict)  # group score key -> its leaves and weights
    primary: dict[str, str] = field(default_factory=dict)  # task -> its primary score key (flips' input)
    params: dict[str, str] = field(default_factory=dict)  # eval.<task>.<setting>: what each task ran with
    tags: dict[str, str] = field(default_factory=dict)  # declarations, notes, unknown directions
    labels: dict[str, dict[int, str]] = field(default_factory=dict)  # task -> doc id -> short text
    datasets: tuple[TaskDataset, ...] = ()


@dataclass(frozen=True)
class DamageOutcome:
    """What token_damage (per token) or answer_damage (per lm-eval document) adds to the variant's result."""

    metrics: dict[str, float]  # quality/...
    tags: dict[str, str] = field(default_factory=dict)
    reference_dir: str | None = None  # token_damage: the baseline's stored pass
    documents: dict[str, DocumentScores] = field(default_factory=dict)  # token_damage: quality/<figure> -> per token
    artifacts: dict[str, str] = field(default_factory=dict)  # answer_damage: flips/<task>.jsonl
    served: ServedPass | None = None  # served_token_damage: the engine's pass, which the baseline's floor repeats


NOTE_TAG = "quantlab.eval_note/"  # + score key: why a score has no per-document analysis or pairing
# ... + score key + one of these: why one comparison of it was not paired (each stage's note under its own key)
PAIRED_NOTE, ENGINE_NOTE, FLOOR_NOTE = "/paired", "/engine_vs_reference", "/engine_floor"
UNKNOWN_DIRECTION_TAG = "quantlab.direction_unknown"  # scores lm-eval declared no direction for
SKIPPED_TAG = "quantlab.quality.skipped"
SERVED_DAMAGE_TAG = "quantlab.quality.served_kld"  # how quality/served/kld_topk_* was computed
SERVED_WINDOWS_AT_ONCE = 4  # token windows in flight at once in a served pass
ENGINE_FLOOR_TAG = "quantlab.quality.engine_floor"  # how the baseline's second served pass differed from its first
MAX_LENGTH_PARAM = "eval.max_length"  # the tokens of a rolling perplexity window, on every path that scored the tasks


def evaluation_max_length(model, tokenizer, recipe: Recipe, checkpoint: Path) -> int | None:
    """The max_length (as lm-eval's HFLM counts it) the variant's tasks are scored with, chosen once for both paths:
    the model's own where only the reference scores, else what the variant's server accepts allows
    (`scoring_max_length`). None: no task to score."""
    from quantlab.evaluate.lm_eval_runner import model_context, scoring_max_length
    from quantlab.stages.serve import served_max_model_len

    if not recipe.evals.tasks:
        return None
    served = served_max_model_len(checkpoint, recipe.serving) if recipe.evals.engine != "reference" else None
    return scoring_max_length(model_context(model, tokenizer), served)


def evaluate_tasks(
    model, tokenizer, settings: EvalSettings, include_path: Path | None, report: StageReporter, max_length: int | None
) -> EvalOutcome:
    """`max_length`: `evaluation_max_length`'s."""
    from quantlab.evaluate.lm_eval_runner import run_tasks

    if not settings.tasks or settings.engine == "served":
        return EvalOutcome()
    requests = task_requests(settings)
    scores = run_tasks(
        model,
        tokenizer,
        requests,
        include_path,
        settings.batch_size,
        progress=lambda step: report(f"evaluate: {step}"),
        max_length=max_length,
    )
    return _with_max_length(eval_outcome(scores), max_length)


def task_requests(settings: EvalSettings) -> list[TaskRequest]:
    """The recipe's task fields are TaskRequest's; an unset one (None) keeps TaskRequest's default."""
    from quantlab.evaluate.lm_eval_runner import TaskRequest

    return [TaskRequest(**task.model_dump(exclude_none=True)) for task in settings.tasks]


def evaluate_served(
    served: ServedVariant | None,
    settings: EvalSettings,
    include_path: Path | None,
    report: StageReporter,
    max_length: int | None,
) -> EvalOutcome:
    """The recipe's tasks scored through the variant's own server (evals.engine: served or both): lm-eval's
    local-completions, the engine's kernels; per-document scores as from the reference, in its windows
    (`max_length`: `evaluation_max_length`'s)."""
    from quantlab.evaluate.lm_eval_runner import SERVED_MAX_LENGTH_MARGIN, score_tasks, served_language_model

    if served is None or settings.engine == "reference" or not settings.tasks or max_length is None:
        return EvalOutcome()
    if max_length + SERVED_MAX_LENGTH_MARGIN > served.launch.max_model_len:
        raise RuntimeError(
            f"scoring max_length {max_length} needs a server that accepts {max_length + SERVED_MAX_LENGTH_MARGIN} "
            f"tokens a request; {served.variant}'s accepts {served.launch.max_model_len}"
        )
    requests = task_requests(settings)
    model = served_language_model(
        served.server.url,
        str(served.checkpoint),
        served.checkpoint,
        settings.served_concurrency,
        max_length,
        settings.batch_size,
    )
    scores = score_tasks(model, requests, include_path, progress=lambda step: report(f"evaluate on engine: {step}"))
    return _with_max_length(eval_outcome(scores), max_length)


def _with_max_length(outcome: EvalOutcome, max_length: int | None) -> EvalOutcome:
    # One name for a perplexity scored in windows of any length: the length goes with it.
    return replace(outcome, params=outcome.params | {MAX_LENGTH_PARAM: str(max_length)})


def engine_vs_reference(reference: EvalOutcome, served: EvalOutcome) -> DamageOutcome:
    """The same variant's served scores against its reference scores, paired per document
    (quality/engine_vs_reference/<score>/<statistic>): a kernel bug shows as a difference here."""
    comparisons, unpaired, _ = _compare_documents(reference.documents, served.documents)
    metrics = _paired_metrics(comparisons, ENGINE_VS_REFERENCE_PREFIX)
    return DamageOutcome(
        metrics,
        {NOTE_TAG + key + ENGINE_NOTE: f"engine vs reference not paired: {why}" for key, why in unpaired.items()},
    )


def served_token_damage(
    served: ServedVariant | None, settings: QualitySettings, baseline_reference: str | None
) -> DamageOutcome:
    """Perplexity, top-1 agreement and a top-k KL through the engine's prompt log-probabilities, against the
    baseline's stored pass (quality/served/...)."""
    from quantlab.evaluate.served_damage import served_pass, served_token_comparison

    if served is None or not served.engine.scores_prompts or not settings.enabled or baseline_reference is None:
        return DamageOutcome({})
    url, name, top_k = served.server.url, str(served.checkpoint), served.launch.top_logprobs
    found = served_pass(url, name, Path(baseline_reference), top_k, SERVED_WINDOWS_AT_ONCE)
    tokens = served_token_comparison(found, Path(baseline_reference))
    method = f"KL over the engine's top {top_k} tokens plus one bucket for the rest: a lower bound"
    return DamageOutcome(tokens.metrics(), {SERVED_DAMAGE_TAG: method}, baseline_reference, served=found)


def engine_floor(
    served: ServedVariant | None,
    job: VariantJob,
    settings: EvalSettings,
    include_path: Path | None,
    report: StageReporter,
    scores: EvalOutcome,
    tokens: DamageOutcome,
    max_length: int | None,
) -> DamageOutcome:
    """The baseline served a second time, at another concurrency and batch size (its token windows in reverse
    order), against its first served pass: the same weights on the same engine (quality/engine_floor/...). What the
    engine varies by itself is the noise a served difference is read against: engine against reference, a
    variant's served drop. Only the baseline's run logs it; nothing without a server that scores."""
    from quantlab.evaluate.served_damage import served_pass, served_twice

    if served is None or not job.is_baseline or not (scores.documents or tokens.served is not None):
        return DamageOutcome({})
    metrics: dict[str, float] = {}
    notes: dict[str, str] = {}
    passes = []
    if scores.documents:
        again = settings.model_copy(
            update={
                "served_concurrency": _other(settings.served_concurrency),
                "batch_size": _other(settings.batch_size),
            }
        )
        second = evaluate_served(served, again, include_path, lambda step: report(f"engine floor: {step}"), max_length)
        comparisons, unpaired, _ = _compare_documents(scores.documents, second.documents)
        metrics |= _paired_metrics(comparisons, ENGINE_FLOOR_PREFIX)
        notes |= {NOTE_TAG + key + FLOOR_NOTE: f"engine floor not paired: {why}" for key, why in unpaired.items()}
        passes.append(
            f"tasks at concurrency {settings.served_concurrency}, batch {settings.batch_size}, then at "
            f"{again.served_concurrency}, batch {again.batch_size}"
        )
    if tokens.served is not None:
        report("engine floor: token log-probabilities")
        url, name, top_k = served.server.url, str(served.checkpoint), served.launch.top_logprobs
        reference_dir = Path(tokens.reference_dir or "")
        second = served_pass(url, name, reference_dir, top_k, _other(SERVED_WINDOWS_AT_ONCE), reverse=True)
        metrics |= served_twice(tokens.served, second).metrics(ENGINE_FLOOR_PREFIX + "served/")
        passes.append(
            f"token windows {SERVED_WINDOWS_AT_ONCE} at a time, then {_other(SERVED_WINDOWS_AT_ONCE)} at a time, "
            "last first"
        )
    what = f"{served.variant} served twice by {served.engine.label}: " + "; ".join(passes)
    return DamageOutcome(metrics, notes | {ENGINE_FLOOR_TAG: what})


def _other(setting: int) -> int:
    """Another concurrency or batch size than `setting`: one where it is more, else two."""
    return 1 if setting > 1 else 2


def eval_outcome(tasks: list[TaskScores]) -> EvalOutcome:
    """What the runner logs and keeps from the scored tasks (pure)."""
    scores = [score for task in tasks for score in task.scores]
    values = {score.key: score.value for score in scores}
    declared = {score.key: Declared(score.higher_is_better, score.scale) for score in scores}
    notes = {score.key: score.note for score in scores if score.note}
    params: dict[str, str] = {}
    datasets: dict[str, TaskDataset] = {}
    for task in tasks:
        if task.settings is None or task.dataset is None:
            continue  # a group: its leaves ran
        datasets.setdefault(task.dataset.name, task.dataset)
        for name, value in task.settings.params(task.task).items():
            # A leaf asked for twice (alone and in a group) keeps its first settings: MLflow params are write-once.
            if params.setdefault(name, value) != value:
                notes[f"eval/{task.task}"] = f"scored twice with different settings; params show the first ({name})"
    tags = declared_tags(declared) | {NOTE_TAG + key: note for key, note in notes.items()}
    lines = [f"{key}: logged without per-document analysis: {note}" for key, note in notes.items()]
    if unknown := unknown_directions(values, declared):
        tags[UNKNOWN_DIRECTION_TAG] = ", ".join(unknown)
        lines.insert(0, f"direction unknown (lm-eval declared no higher_is_better): {tags[UNKNOWN_DIRECTION_TAG]}")
    for line in lines:
        print(f"quantlab: {line}", file=sys.stderr, flush=True)  # the variant's log, beside lm-eval's warnings
    return EvalOutcome(
        metrics=values | {score.stderr_key: score.stderr for score in scores if score.stderr is not None},
        scores=values,
        documents={score.key: score.documents for score in scores if score.documents is not None},
        groups={score.key: Group(score.leaves, score.weights) for score in scores if score.leaves},
        primary={task.task: task.primary.key for task in tasks},
        params=params,
        tags=tags,
        labels={task.task: dict(task.labels) for task in tasks if not task.is_group},
        datasets=tuple(datasets.values()),
    )


def token_damage(
    model, tokenizer, settings: QualitySettings, recipe_dir: Path, job: VariantJob, checkpoint_key: str
) -> DamageOutcome:
    """Perplexity and KL against the baseline's stored pass (written here when this is the baseline)."""
    from quantlab.evaluate import reference
    from quantlab.evaluate.contexts import ContextDamage, context_damage

    if not settings.enabled:
        return DamageOutcome({}, {SKIPPED_TAG: "quality.enabled is false in the recipe"})
    if job.is_baseline:
        # Everything that moves the stored numbers: the weights, the corpus settings, and how
        # they were computed (dtype, device, and the libraries doing the arithmetic).
        identity = {
            "baseline": checkpoint_key,
            "quality": settings.model_dump(),
            "compute_dtype": str(model.dtype),
            "device": str(model.device),
            "versions": cache.library_versions(),
        }
        reference_dir = job.cache_root / "references" / cache.cache_key(identity)
        if job.force or not (reference_dir / "reference.json").is_file():
            text = "\n\n".join(load_texts(settings.corpus, recipe_dir))
            token_ids = reference.corpus_token_ids(tokenizer, text, settings.max_tokens)
            reference.write_reference(model, token_ids, reference_dir, window=settings.window, stride=settings.stride)
        tokens = reference.baseline_comparison(reference_dir)
    elif job.baseline is None or job.baseline.reference_dir is None:
        return DamageOutcome({}, {SKIPPED_TAG: "the baseline variant did not produce a reference pass"})
    else:
        reference_dir = Path(job.baseline.reference_dir)
        tokens = reference.compare_tokens(model, reference_dir)
    # Paired per token against the baseline's own pass (the baseline against itself: zeros), windows as clusters.
    baseline = reference.TokenComparison.of_baseline(tokens.baseline_nll, tokens.windows).documents()
    documents = tokens.documents()
    by_context = ContextDamage({}, {}, {})
    if settings.contexts:  # KL and top-1 by context length, in a pass of its own
        by_context = context_damage(model, tokenizer, settings, recipe_dir, reference_dir, job)
        baseline, documents = baseline | by_context.baseline_documents, documents | by_context.documents
    paired = {key: compare(key, baseline[key], docs) for key, docs in documents.items()}
    effects = {f"{key}_design_effect": c.design_effect for key, c in paired.items() if c.design_effect is not None}
    metrics = tokens.metrics() | by_context.metrics | _paired_metrics(paired) | effects
    return DamageOutcome(metrics, by_context.tags, str(reference_dir), documents)


def answer_damage(scores: EvalOutcome, baseline: BaselineOutputs | None) -> DamageOutcome:
    """Paired statistics of every analysable lm-eval score against the baseline (groups through
    their leaves), flips and exact McNemar for 0/1 primary scores (a group's flips are its
    leaves'), and recovery of every score. The baseline compares itself with itself: its own zeros."""
    reference = baseline if baseline is not None else scores  # both have .documents and .scores
    comparisons, notes, missing = _compare_documents(reference.documents, scores.documents)
    notes |= dict.fromkeys(missing, "the baseline has no per-document scores for it")
    for key, parts in scores.groups.items():
        missing = [leaf for leaf in parts.leaves if leaf not in comparisons]
        if missing:
            notes[key] = f"no paired comparison for its leaves {', '.join(missing)}"
            continue
        comparisons[key] = combine([comparisons[leaf] for leaf in parts.leaves], parts.weights)

    metrics = _paired_metrics(comparisons)
    artifacts: dict[str, str] = {}
    for task, key in scores.primary.items():
        comparison = comparisons.get(key)
        if comparison is None or comparison.correct_to_wrong is None or comparison.wrong_to_correct is None:
            continue  # not a 0/1 score: its paired figures above say what changed
        metrics.update(flip_metrics(task, comparison.correct_to_wrong, comparison.wrong_to_correct))
        if baseline is not None and key in scores.documents:
            base, variant = reference.documents[key].values, scores.documents[key].values
            artifacts[f"flips/{task}.jsonl"] = _flips_jsonl(task, base, variant, scores.labels.get(task, {}))
    metrics |= recovery(reference.scores, scores.scores)
    tags = {NOTE_TAG + key + PAIRED_NOTE: f"not paired: {note}" for key, note in notes.items()}
    return DamageOutcome(metrics, tags, artifacts=artifacts)


def _compare_documents(
    reference: Mapping[str, DocumentScores], variant: Mapping[str, DocumentScores]
) -> tuple[dict[str, PairedComparison], dict[str, str], list[str]]:
    """Each of `variant`'s per-document scores paired with `reference`'s: the comparisons, why a score could not be
    paired, and the scores `reference` lacks."""
    comparisons: dict[str, PairedComparison] = {}
    unpaired: dict[str, str] = {}
    missing: list[str] = []
    for key, documents in variant.items():
        if key not in reference:
            missing.append(key)
            continue
        try:
            comparisons[key] = compare(key, reference[key], documents)
        except NotPaired as error:
            unpaired[key] = str(error)
    return comparisons, unpaired, missing


def _paired_metrics(comparisons: Mapping[str, PairedComparison], prefix: str = PAIRED_PREFIX) -> dict[str, float]:
    return {
        paired_key(key, name, prefix): value for key, c in comparisons.items() for name, value in c.statistics().items()
    }


def _flips_jsonl(task: str, baseline: Mapping[int, float], variant: Mapping[int, float], labels: dict[int, str]) -> str:
    rows = [
        {"doc_id": doc_id, "direction": direction, "baseline": baseline[doc_id], "variant": variant[doc_id]}
        | ({"document": labels[doc_id]} if doc_id in labels else {})
        for direction, doc_ids in paired_flips(task, baseline, variant).items()
        for doc_id in doc_ids
    ]
    return "".join(json.dumps(row) + "\n" for row in rows)
