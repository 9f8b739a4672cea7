"""Score an already loaded model on lm-eval tasks: aggregate metrics and per-document results.

The model is wrapped, not reloaded (`HFLM(pretrained=<model>)`), so a variant is scored exactly
as it was quantized and loaded. Task names resolve through lm-eval's `TaskManager`: its own
tasks (which fetch their data from a hub when run) plus any directory of task YAMLs such as the
repository's offline `evals/`.
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

# The repository's offline tasks (mmlu_dev, pydoc_cloze); recipes point `evals.include_path` here.
BUNDLED_EVALS_DIR = Path(__file__).resolve().parents[2] / "evals"

# Seeds for python, numpy, torch and the few-shot sampler: lm-eval's defaults today, spelled out
# so that a change of default upstream cannot silently move our numbers.
RANDOM_SEED = 0
NUMPY_SEED = 1234
TORCH_SEED = 1234
FEWSHOT_SEED = 1234

# How much of a document's prompt to keep as its label in flip reports.
DOCUMENT_LABEL_CHARS = 200

_NO_FILTER = "none"


@dataclass(frozen=True)
class MetricScore:
    value: float
    stderr: float | None


@dataclass(frozen=True)
class TaskScores:
    task: str
    metrics: dict[str, MetricScore]  # lm-eval metric names, filter suffix dropped ("acc")
    per_sample: dict[int, float]  # doc_id -> the primary metric for that document
    primary_metric: str
    documents: dict[int, str] = field(default_factory=dict)  # doc_id -> end of its prompt


@dataclass(frozen=True)
class TaskRequest:
    name: str
    num_fewshot: int = 0
    limit: int | None = None


def known_tasks(include_path: Path | None) -> set[str]:
    """Every name lm-eval can resolve: its tasks, groups and tags, plus those under include_path."""
    return set(task_manager(include_path).all_tasks)


def task_index_identity(include_path: Path | None) -> dict[str, Any]:
    """What decides `known_tasks`: lm-eval's installed version and the task files under include_path."""
    from importlib.metadata import version

    from quantlab import cache

    return {
        "lm_eval": version("lm-eval"),
        "include_path": str(include_path.resolve()) if include_path else None,
        "include_files": cache.tasks_digest(include_path),
    }


def unknown_tasks(names: list[str], known: set[str]) -> list[tuple[str, str | None]]:
    """The names not in `known`, each with the closest known name (or None)."""
    return [
        (name, next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.75)), None))
        for name in names
        if name not in known
    ]


def task_manager(include_path: Path | None) -> TaskManager:
    """lm-eval's task index, built once per include path per process (it walks ~10k YAMLs)."""
    return _cached_task_manager(include_path.resolve() if include_path is not None else None)


@functools.cache
def _cached_task_manager(include_path: Path | None) -> TaskManager:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(include_path) if include_path is not None else None)


def run_tasks(
    model: Any,
    tokenizer: Any,
    tasks: list[TaskRequest],
    include_path: Path | None,
    batch_size: int,
    progress: Callable[[str], None] | None = None,
) -> list[TaskScores]:
    """Score `model` on each requested task, in order.

    A group (e.g. "mmlu") yields its aggregate scores under its own name, followed by one entry
    per leaf task; a tag yields its leaf tasks only. Per-document results are only meaningful
    for leaf tasks, so a group's own `per_sample` is empty.
    """
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(include_path)
    scores: list[TaskScores] = []
    with _quiet_lm_eval():
        language_model = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        for request in tasks:
            if progress is not None:
                progress(_describe(request))
            results = simple_evaluate(
                model=language_model,
                tasks=[request.name],
                num_fewshot=request.num_fewshot,
                limit=request.limit,
                log_samples=True,
                task_manager=manager,
                random_seed=RANDOM_SEED,
                numpy_random_seed=NUMPY_SEED,
                torch_random_seed=TORCH_SEED,
                fewshot_random_seed=FEWSHOT_SEED,
            )
            if results is None:  # only non-zero ranks of a distributed run get None
                raise RuntimeError(f"lm-eval returned no results for {request.name}")
            scores.extend(_task_scores(request.name, results))
    return scores


def _describe(request: TaskRequest) -> str:
    shots = f", {request.num_fewshot}-shot" if request.num_fewshot else ""
    limit = f", first {request.limit} docs" if request.limit is not None else ""
    return f"lm-eval {request.name}{shots}{limit}"


def _task_scores(requested: str, results: dict[str, Any]) -> list[TaskScores]:
    samples: dict[str, list[dict[str, Any]]] = results.get("samples", {})
    scores = [_scores_of(leaf, results["results"][leaf], leaf_samples) for leaf, leaf_samples in samples.items()]
    group_metrics = results["results"].get(requested, {}) if requested not in samples else {}
    # A group reports its own scores only when its YAML asks lm-eval to aggregate them.
    if _reported_metrics(group_metrics):
        scores.insert(0, _scores_of(requested, group_metrics, []))
    return scores


@dataclass(frozen=True)
class _ReportedMetric:
    name: str  # as quantlab reports it
    metric: str  # as lm-eval names it, and as each logged sample carries it
    filter: str
    score: MetricScore


def _scores_of(task: str, raw_metrics: dict[str, Any], samples: list[dict[str, Any]]) -> TaskScores:
    reported = _reported_metrics(raw_metrics)
    if not reported:
        raise RuntimeError(f"lm-eval reported no numeric metric for {task}: {sorted(raw_metrics)}")
    primary = reported[0]
    # A task with several filters logs each document once per filter.
    primary_samples = [s for s in samples if s.get("filter", primary.filter) == primary.filter and primary.metric in s]
    return TaskScores(
        task=task,
        metrics={m.name: m.score for m in reported},
        per_sample={int(s["doc_id"]): float(s[primary.metric]) for s in primary_samples},
        primary_metric=primary.name,
        documents={int(s["doc_id"]): _document_label(s) for s in primary_samples},
    )


def _reported_metrics(raw_metrics: dict[str, Any]) -> list[_ReportedMetric]:
    """lm-eval's "metric,filter" keys, in its order, named "metric". A task with several filters
    (e.g. strict and flexible answer extraction) keeps "metric_filter" for all but "none", since
    dropping the suffix there would merge different scores."""
    keys = [key for key in raw_metrics if "," in key and "_stderr," not in key and _is_number(raw_metrics[key])]
    several_filters = len({key.split(",", 1)[1] for key in keys}) > 1
    reported: list[_ReportedMetric] = []
    for key in keys:
        metric, filter_name = key.split(",", 1)
        name = f"{metric}_{filter_name}" if several_filters and filter_name != _NO_FILTER else metric
        stderr = raw_metrics.get(f"{metric}_stderr,{filter_name}")
        # lm-eval reports "N/A" where it has no stderr, and nan for a single document.
        finite_stderr = float(stderr) if _is_number(stderr) and math.isfinite(stderr) else None
        reported.append(_ReportedMetric(name, metric, filter_name, MetricScore(float(raw_metrics[key]), finite_stderr)))
    return reported


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _document_label(sample: dict[str, Any]) -> str:
    """The end of the document's prompt (its own question, after any few-shot examples)."""
    arguments = sample.get("arguments") or [[""]]
    prompt = arguments[0][0]  # (context, continuation) or (context, generation kwargs)
    return " ".join(str(prompt).split())[-DOCUMENT_LABEL_CHARS:]


class _quiet_lm_eval:
    """lm-eval logs every request batch and config override at INFO/WARNING; keep errors only."""

    _LOGGER_NAMES = ("lm_eval", "lm-eval")

    def __enter__(self) -> None:
        self._levels = {name: logging.getLogger(name).level for name in self._LOGGER_NAMES}
        for name in self._LOGGER_NAMES:
            logging.getLogger(name).setLevel(logging.ERROR)

    def __exit__(self, *exc_info: object) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
