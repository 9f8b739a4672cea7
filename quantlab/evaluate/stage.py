"""The evaluate and damage stages of a variant, as the runner sees them: results in, metrics out."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quantlab import cache
from quantlab.corpora import load_texts

if TYPE_CHECKING:
    from quantlab.recipe import EvalSettings, QualitySettings
    from quantlab.runner import BaselineOutputs, StageReporter, VariantJob


@dataclass(frozen=True)
class EvalOutcome:
    metrics: dict[str, float]  # eval/<task>/<metric> and eval/<task>/<metric>_stderr
    task_metrics: dict[str, dict[str, float]]  # task -> metric -> value (recovery's input)
    per_sample: dict[str, dict[int, float]]  # task -> doc id -> primary metric (flips' input)
    documents: dict[str, dict[int, str]] = field(default_factory=dict)  # task -> doc id -> short text


@dataclass(frozen=True)
class TokenOutcome:
    metrics: dict[str, float]
    tags: dict[str, str]
    reference_dir: str | None


@dataclass(frozen=True)
class AnswerOutcome:
    metrics: dict[str, float]
    artifacts: dict[str, str]


def evaluate_tasks(model, tokenizer, settings: EvalSettings, include_path: Path | None, report: StageReporter) -> EvalOutcome:
    from quantlab.evaluate.lm_eval_runner import TaskRequest, run_tasks

    if not settings.tasks:
        return EvalOutcome({}, {}, {})
    requests = [TaskRequest(task.name, task.num_fewshot, task.limit) for task in settings.tasks]
    scores = run_tasks(model, tokenizer, requests, include_path, settings.batch_size, progress=lambda step: report(f"evaluate: {step}"))
    metrics: dict[str, float] = {}
    task_metrics: dict[str, dict[str, float]] = {}
    for task in scores:
        task_metrics[task.task] = {}
        for name, score in task.metrics.items():
            metrics[f"eval/{task.task}/{name}"] = score.value
            task_metrics[task.task][name] = score.value
            if score.stderr is not None:
                metrics[f"eval/{task.task}/{name}_stderr"] = score.stderr
    return EvalOutcome(
        metrics=metrics,
        task_metrics=task_metrics,
        per_sample={task.task: dict(task.per_sample) for task in scores},
        documents={task.task: dict(getattr(task, "documents", {}) or {}) for task in scores},
    )


def token_damage(model, tokenizer, settings: QualitySettings, recipe_dir: Path, job: VariantJob, checkpoint_key: str) -> TokenOutcome:
    """Perplexity and KL against the baseline's stored pass (written here when this is the baseline)."""
    from quantlab.evaluate.reference import baseline_damage, compare_to_reference, corpus_token_ids, write_reference

    if not settings.enabled:
        return TokenOutcome({}, {"quantlab.quality.skipped": "quality.enabled is false in the recipe"}, None)
    if job.is_baseline:
        identity = {"baseline": checkpoint_key, "quality": settings.model_dump()}
        reference_dir = job.cache_root / "references" / cache.cache_key(identity)
        if job.force or not (reference_dir / "reference.json").is_file():
            text = "\n\n".join(load_texts(settings.corpus, recipe_dir))
            token_ids = corpus_token_ids(tokenizer, text, settings.max_tokens)
            write_reference(model, token_ids, reference_dir, window=settings.window, stride=settings.stride)
        damage = baseline_damage(reference_dir)
    elif job.baseline is None or job.baseline.reference_dir is None:
        return TokenOutcome({}, {"quantlab.quality.skipped": "the baseline variant did not produce a reference pass"}, None)
    else:
        reference_dir = Path(job.baseline.reference_dir)
        damage = compare_to_reference(model, reference_dir)
    return TokenOutcome(damage.to_metrics(), {}, str(reference_dir))


def answer_damage(scores: EvalOutcome, baseline: BaselineOutputs | None) -> AnswerOutcome:
    """Flips, McNemar and recovery per task against the baseline; the baseline gets its own zeros."""
    from quantlab.evaluate.damage import paired_flips, recovery

    reference_samples = baseline.per_sample if baseline else scores.per_sample
    reference_metrics = baseline.task_metrics if baseline else scores.task_metrics
    metrics: dict[str, float] = {}
    artifacts: dict[str, str] = {}
    for task, samples in scores.per_sample.items():
        if task not in reference_samples:
            continue
        flips = paired_flips(task, reference_samples[task], samples)
        metrics.update(flips.to_metrics())
        metrics.update(recovery(task, reference_metrics[task], scores.task_metrics[task]).to_metrics())
        if baseline is not None:
            artifacts[f"flips/{task}.jsonl"] = _flips_jsonl(flips, reference_samples[task], samples, scores.documents.get(task, {}))
    return AnswerOutcome(metrics, artifacts)


def _flips_jsonl(flips, baseline: dict[int, float], variant: dict[int, float], documents: dict[int, str]) -> str:
    lines = []
    for direction, doc_ids in (("correct_to_wrong", flips.correct_to_wrong_ids), ("wrong_to_correct", flips.wrong_to_correct_ids)):
        for doc_id in doc_ids:
            row = {"doc_id": doc_id, "direction": direction, "baseline": baseline[doc_id], "variant": variant[doc_id]}
            if doc_id in documents:
                row["document"] = documents[doc_id]
            lines.append(json.dumps(row))
    return "\n".join(lines) + ("\n" if lines else "")
