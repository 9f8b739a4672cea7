"""Score an already loaded model on lm-eval tasks: every reported score, and per-document scores.

The model is wrapped, not reloaded (`HFLM(pretrained=<model>)`), so a variant is scored exactly
as it was quantized and loaded. Task names resolve through lm-eval's `TaskManager`: its own
tasks (which fetch their data from a hub when run) plus any directory of task YAMLs such as the
repository's offline `evals/`.

What comes out of one `simple_evaluate(..., log_samples=True)` call (see `read_results`):

- Every numeric score lm-eval reports, for every filter, as `Score` (key
  `eval/<task>/<metric>[:<filter>]`, see `quantlab.metrics`), with its stderr, its direction
  from lm-eval's own `higher_is_better` (groups included) and its scale.
- Per leaf score, the per-document values (`paired.DocumentScores`) when their shape allows:
  a scalar per document under a mean (acc, exact_match per filter, truthfulqa_mc2's
  probability), or `(loglikelihood, words|bytes)` pairs under lm-eval's weighted perplexity or
  bits-per-byte (wikitext). They are accepted only when re-aggregating them reproduces the
  value lm-eval reported; otherwise the score is still logged and `Score.note` says why no
  per-document analysis exists. An unexpected shape never fails the task.
- Per group score (lm-eval's own aggregate; nested groups aggregate over all their leaves, as
  lm-eval does), the leaf scores and weights that reproduce it: size-weighted or plain mean,
  whichever lm-eval used.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import logging
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantlab.metrics import NO_FILTER, Scale, eval_key
from quantlab.paired import Aggregation, DocumentScores

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

# Re-aggregated per-document values must reproduce lm-eval's figure this closely (float sums in
# another order differ in the last bits; a different aggregation differs in the first).
REAGGREGATION_REL_TOL = 1e-9

PERPLEXITY_METRICS = frozenset({"word_perplexity", "byte_perplexity", "perplexity"})
BITS_METRICS = frozenset({"bits_per_byte"})


@dataclass(frozen=True)
class TaskRequest:
    """One task (or group, or tag) as the recipe asks for it. None = the task YAML's own setting."""

    name: str
    num_fewshot: int | None = None
    limit: int | None = None
    gen_kwargs: Mapping[str, Any] | None = None
    apply_chat_template: bool | str = False
    fewshot_as_multiturn: bool | None = None  # None: on with a chat template, as lm-eval's CLI does
    system_instruction: str | None = None

    @property
    def multiturn(self) -> bool:
        return bool(self.apply_chat_template) if self.fewshot_as_multiturn is None else self.fewshot_as_multiturn


@dataclass(frozen=True)
class Score:
    """One figure lm-eval reported for a task or group: its `metric,filter`."""

    task: str
    metric: str
    filter: str
    value: float
    stderr: float | None
    higher_is_better: bool | None  # lm-eval's; None when it declared none (named, never dropped)
    scale: Scale
    documents: DocumentScores | None = None  # leaves: per-document values that reproduce `value`
    leaves: tuple[str, ...] = ()  # groups: the leaf score keys whose weighted sum is `value`
    weights: tuple[float, ...] = ()
    note: str | None = None  # why there is no per-document analysis

    @property
    def key(self) -> str:
        return eval_key(self.task, self.metric, self.filter)

    @property
    def stderr_key(self) -> str:
        return eval_key(self.task, self.metric, self.filter, stderr=True)


@dataclass(frozen=True)
class TaskSettings:
    """What a leaf task actually ran with (after the YAML, the recipe's overrides and lm-eval's defaults)."""

    num_fewshot: int
    limit: int | None
    documents: int  # scored
    gen_kwargs: dict[str, Any] | None  # generation tasks only
    apply_chat_template: bool | str
    fewshot_as_multiturn: bool
    system_instruction: str | None
    version: str

    def params(self, task: str) -> dict[str, str]:
        values: dict[str, Any] = {
            "num_fewshot": self.num_fewshot,
            "limit": self.limit,
            "documents": self.documents,
            "gen_kwargs": json.dumps(self.gen_kwargs, sort_keys=True, default=str)
            if self.gen_kwargs is not None
            else "not used",
            "apply_chat_template": self.apply_chat_template,
            "fewshot_as_multiturn": self.fewshot_as_multiturn,
            "system_instruction": self.system_instruction,
            "version": self.version,
        }
        return {f"eval.{task}.{name}": str(value) for name, value in values.items()}


@dataclass(frozen=True)
class TaskDataset:
    """What a leaf task scored, as an MLflow dataset input: the digest changes with its config,
    its local data files and its limit."""

    name: str
    digest: str
    source: str
    profile: str
    source_type: str = "lm-eval"


@dataclass(frozen=True)
class TaskScores:
    task: str
    scores: list[Score]  # lm-eval's order; the first is the task's primary score
    is_group: bool = False
    settings: TaskSettings | None = None  # leaves only
    dataset: TaskDataset | None = None  # leaves only
    labels: dict[int, str] = field(default_factory=dict)  # doc_id -> end of its prompt

    @property
    def primary(self) -> Score:
        return self.scores[0]

    def score(self, metric: str, filter_name: str = NO_FILTER) -> Score:
        return next(s for s in self.scores if s.metric == metric and s.filter == filter_name)


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
    """Score `model` on each requested task, in order, each with its own settings.

    A group (e.g. "mmlu") yields its aggregate scores under its own name (when its YAML asks
    lm-eval to aggregate), then one entry per leaf task; a tag yields its leaf tasks only.
    """
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(include_path)
    scores: list[TaskScores] = []
    with _lm_eval_warnings_only():
        language_model = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        for request in tasks:
            if progress is not None:
                progress(_describe(request))
            results = simple_evaluate(
                model=language_model,
                tasks=[request.name],
                num_fewshot=request.num_fewshot,  # None keeps the task YAML's own shots
                limit=request.limit,
                gen_kwargs=dict(request.gen_kwargs) if request.gen_kwargs else None,
                apply_chat_template=request.apply_chat_template,
                fewshot_as_multiturn=request.multiturn,
                system_instruction=request.system_instruction,
                log_samples=True,
                task_manager=manager,
                random_seed=RANDOM_SEED,
                numpy_random_seed=NUMPY_SEED,
                torch_random_seed=TORCH_SEED,
                fewshot_random_seed=FEWSHOT_SEED,
            )
            if results is None:  # only non-zero ranks of a distributed run get None
                raise RuntimeError(f"lm-eval returned no results for {request.name}")
            scores.extend(read_results(request, results))
    return scores


def _describe(request: TaskRequest) -> str:
    shots = f", {request.num_fewshot}-shot" if request.num_fewshot is not None else ""
    limit = f", first {request.limit} docs" if request.limit is not None else ""
    return f"lm-eval {request.name}{shots}{limit}"


# --------------------------------------------------------------------------------------
# From lm-eval's results dict to scores (pure: dicts in, dataclasses out)
# --------------------------------------------------------------------------------------


def read_results(request: TaskRequest, results: Mapping[str, Any]) -> list[TaskScores]:
    """Groups first (outermost first), then leaves, as lm-eval reported them."""
    samples: Mapping[str, list[dict[str, Any]]] = results.get("samples") or {}
    reported: Mapping[str, Mapping[str, Any]] = results.get("results") or {}
    structure: Mapping[str, list[str]] = results.get("group_subtasks") or {}
    directions: Mapping[str, Mapping[str, Any]] = results.get("higher_is_better") or {}
    leaves = {
        task: _leaf_scores(task, reported[task], samples.get(task, []), directions.get(task, {}), request, results)
        for task in reported
        if task not in structure
    }
    groups = [
        _group_scores(group, reported[group], _leaves_under(group, structure), leaves, directions.get(group, {}))
        for group in structure
        if group in reported
    ]
    return [group for group in groups if group.scores] + [leaf for leaf in leaves.values() if leaf.scores]


def _leaves_under(group: str, structure: Mapping[str, list[str]]) -> list[str]:
    """Every leaf task below a group, nested groups expanded (lm-eval aggregates over these)."""
    found: list[str] = []
    for child in structure.get(group, []):
        for leaf in _leaves_under(child, structure) if child in structure else [child]:
            if leaf not in found:
                found.append(leaf)
    return found


def _leaf_scores(
    task: str,
    raw: Mapping[str, Any],
    samples: list[dict[str, Any]],
    directions: Mapping[str, Any],
    request: TaskRequest,
    results: Mapping[str, Any],
) -> TaskScores:
    scores = []
    for metric, filter_name, value, stderr in reported_metrics(raw):
        documents, note = document_scores(metric, filter_name, samples, value)
        scores.append(
            Score(
                task,
                metric,
                filter_name,
                value,
                stderr,
                _direction(directions, metric),
                scale_of(metric, documents),
                documents,
                note=note,
            )
        )
    primary_filter = scores[0].filter if scores else NO_FILTER
    labels = {
        int(s["doc_id"]): _document_label(s)
        for s in samples
        if s.get("filter", NO_FILTER) == primary_filter and "doc_id" in s
    }
    settings = _settings(task, request, results)
    return TaskScores(task, scores, False, settings, _dataset(task, request, results, settings), labels)


def _group_scores(
    group: str,
    raw: Mapping[str, Any],
    leaf_names: list[str],
    leaves: Mapping[str, TaskScores],
    directions: Mapping[str, Any],
) -> TaskScores:
    scores = []
    for metric, filter_name, value, stderr in reported_metrics(raw):
        parts = [
            leaf.score(metric, filter_name)
            for name in leaf_names
            if (leaf := leaves.get(name)) is not None
            and any(s.metric == metric and s.filter == filter_name for s in leaf.scores)
        ]
        sizes = [leaves[p.task].settings.documents if leaves[p.task].settings else 0 for p in parts]
        weights, note = group_weights([p.value for p in parts], sizes, value)
        scales = {p.scale for p in parts}
        scale = scales.pop() if len(scales) == 1 else Scale.SCORE
        if weights is not None and not all(
            p.documents is not None and p.documents.aggregation is Aggregation.MEAN for p in parts
        ):
            # combine() adds weighted differences: right for means, not for perplexities.
            note = "a leaf has no per-document mean scores: " + "; ".join(
                f"{p.task}: {p.note or 'not a mean'}"
                for p in parts
                if p.documents is None or p.documents.aggregation is not Aggregation.MEAN
            )
            weights = None
        scores.append(
            Score(
                group,
                metric,
                filter_name,
                value,
                stderr,
                _direction(directions, metric),
                scale,
                leaves=tuple(p.key for p in parts) if weights else (),
                weights=tuple(weights or ()),
                note=note,
            )
        )
    return TaskScores(group, scores, is_group=True)


def reported_metrics(raw: Mapping[str, Any]) -> list[tuple[str, str, float, float | None]]:
    """(metric, filter, value, stderr) of every numeric "metric,filter" entry, in lm-eval's order."""
    found = []
    for key, value in raw.items():
        if "," not in key or not _is_number(value):
            continue
        metric, filter_name = key.split(",", 1)
        if metric.endswith("_stderr") and f"{metric.removesuffix('_stderr')},{filter_name}" in raw:
            continue
        stderr = raw.get(f"{metric}_stderr,{filter_name}")
        # lm-eval reports "N/A" where it has no stderr, and nan for a single document.
        finite = float(stderr) if _is_number(stderr) and math.isfinite(float(stderr)) else None
        found.append((metric, filter_name, float(value), finite))
    return found


def document_scores(
    metric: str, filter_name: str, samples: list[dict[str, Any]], reported: float
) -> tuple[DocumentScores | None, str | None]:
    """The per-document values of one metric and filter, or None and the reason.

    Accepted only when re-aggregating them reproduces `reported`: a scalar per document under a
    mean, or (loglikelihood, weight) pairs under lm-eval's weighted perplexity or bits per byte.
    """
    rows = [s for s in samples if s.get("filter", NO_FILTER) == filter_name and metric in s]
    if not rows:
        return None, "lm-eval logged no per-document values for it"
    if not math.isfinite(reported):
        return None, f"lm-eval reported {reported}"
    doc_ids = [s.get("doc_id") for s in rows]
    if any(not isinstance(d, int) for d in doc_ids) or len(set(doc_ids)) != len(doc_ids):
        return None, "documents are not identified once each by an integer doc_id"
    values = [s[metric] for s in rows]
    if all(_is_number(v) or _is_bool(v) for v in values):
        candidates = [DocumentScores(Aggregation.MEAN, {d: float(v) for d, v in zip(doc_ids, values)})]
    elif all(isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_number(x) for x in v) for v in values):
        loglikelihoods = {d: float(v[0]) for d, v in zip(doc_ids, values)}
        weights = {d: float(v[1]) for d, v in zip(doc_ids, values)}
        candidates = [
            DocumentScores(aggregation, loglikelihoods, weights)
            for aggregation in (Aggregation.WEIGHTED_PERPLEXITY, Aggregation.BITS_PER_BYTE)
        ]
    else:
        return None, f"per-document values of type {type(values[0]).__name__} have no known aggregation"
    found = []
    for candidate in candidates:
        try:
            again = candidate.aggregate()
        except (ArithmeticError, ValueError, KeyError):
            continue
        if math.isclose(again, reported, rel_tol=REAGGREGATION_REL_TOL, abs_tol=1e-12):
            return candidate, None
        found.append(f"{candidate.aggregation.value} {again:.6g}")
    return (
        None,
        f"re-aggregating the per-document values gives {' or '.join(found) or 'nothing'}, lm-eval reported {reported:.6g}",
    )


def group_weights(values: list[float], sizes: list[int], reported: float) -> tuple[list[float] | None, str | None]:
    """The leaf weights that reproduce a group's value: size-weighted first (lm-eval's default,
    and the one that makes the group one pool of documents), else the plain mean."""
    if not values:
        return None, "no leaf reports this metric"
    if not math.isfinite(reported):
        return None, f"lm-eval reported {reported}"
    candidates = []
    if sum(sizes) > 0:
        candidates.append([size / sum(sizes) for size in sizes])
    candidates.append([1 / len(values)] * len(values))
    for weights in candidates:
        if math.isclose(
            sum(w * v for w, v in zip(weights, values)), reported, rel_tol=REAGGREGATION_REL_TOL, abs_tol=1e-12
        ):
            return weights, None
    return None, "neither the size-weighted nor the plain mean of its leaves reproduces lm-eval's group value"


def scale_of(metric: str, documents: DocumentScores | None) -> Scale:
    """FRACTION when the per-document values are 0-1 under a mean; the aggregation's unit for
    rolling loglikelihood; else by lm-eval's metric name, and SCORE when nothing says more."""
    if documents is not None:
        if documents.aggregation is Aggregation.WEIGHTED_PERPLEXITY:
            return Scale.PERPLEXITY
        if documents.aggregation is Aggregation.BITS_PER_BYTE:
            return Scale.BITS
        if all(0.0 <= v <= 1.0 for v in documents.values.values()):
            return Scale.FRACTION
        return Scale.SCORE
    if metric in PERPLEXITY_METRICS:
        return Scale.PERPLEXITY
    if metric in BITS_METRICS:
        return Scale.BITS
    return Scale.SCORE


def _direction(directions: Mapping[str, Any], metric: str) -> bool | None:
    value = directions.get(metric)
    return bool(value) if _is_bool(value) else None  # lm-eval gives None for a group whose leaves disagree


def _settings(task: str, request: TaskRequest, results: Mapping[str, Any]) -> TaskSettings:
    config = (results.get("configs") or {}).get(task, {})
    counts = (results.get("n-samples") or {}).get(task, {})
    shots = (results.get("n-shot") or {}).get(task, config.get("num_fewshot", 0))
    generation = config.get("generation_kwargs") if config.get("output_type") == "generate_until" else None
    return TaskSettings(
        num_fewshot=int(shots or 0),
        limit=request.limit,
        documents=int(counts.get("effective", 0)),
        gen_kwargs=dict(generation) if isinstance(generation, Mapping) else None,
        apply_chat_template=request.apply_chat_template,
        fewshot_as_multiturn=request.multiturn,
        system_instruction=request.system_instruction,
        version=str((results.get("versions") or {}).get(task, "")),
    )


def _dataset(task: str, request: TaskRequest, results: Mapping[str, Any], settings: TaskSettings) -> TaskDataset:
    config = (results.get("configs") or {}).get(task, {})
    digest = hashlib.sha256()
    # The dumped config is the task as lm-eval ran it, includes resolved. Some functions dump
    # as their repr, whose memory address changes every process: drop the address. The code
    # of lm-eval's own task helpers comes with its version.
    dumped = json.dumps(config, sort_keys=True, default=str)
    digest.update(re.sub(r" at 0x[0-9a-fA-F]+", "", dumped).encode())
    digest.update(f"lm_eval={_lm_eval_version()} limit={request.limit}".encode())
    files = _data_files(config)
    for path in files:
        if Path(path).is_file():  # local data: its content, not just its name
            digest.update(Path(path).read_bytes())
    source = str(config.get("dataset_path", ""))
    if config.get("dataset_name"):
        source += f":{config['dataset_name']}"
    if files:
        source += " " + ",".join(files)
    profile = {
        "limit": request.limit,
        "documents": settings.documents,
        "num_fewshot": settings.num_fewshot,
        "version": settings.version,
    }
    return TaskDataset(task, digest.hexdigest()[:16], source, json.dumps(profile, sort_keys=True))


@functools.cache
def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm-eval")


def _data_files(config: Mapping[str, Any]) -> list[str]:
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, str):
        return [files]
    if isinstance(files, Mapping):
        return [str(f) for value in files.values() for f in ([value] if isinstance(value, str) else value)]
    if isinstance(files, list):
        return [str(f) for f in files]
    return []


def _is_number(value: Any) -> bool:
    # numpy floats are numbers.Real too; a bool is a 0/1 document score but never an aggregate.
    return isinstance(value, numbers.Real) and not _is_bool(value)


def _is_bool(value: Any) -> bool:
    import numpy as np

    return isinstance(value, (bool, np.bool_))


def _document_label(sample: Mapping[str, Any]) -> str:
    """The end of the document's prompt (its own question, after any few-shot examples)."""
    arguments = sample.get("arguments") or [[""]]
    try:
        prompt = arguments[0][0]  # (context, continuation) or (context, generation kwargs)
    except (IndexError, KeyError, TypeError):
        prompt = ""
    return " ".join(str(prompt).split())[-DOCUMENT_LABEL_CHARS:]


class _lm_eval_warnings_only:
    """lm-eval logs every request batch at INFO; keep its warnings (overridden settings among them)."""

    _LOGGER_NAMES = ("lm_eval", "lm-eval")

    def __enter__(self) -> None:
        self._levels = {name: logging.getLogger(name).level for name in self._LOGGER_NAMES}
        for name in self._LOGGER_NAMES:
            logging.getLogger(name).setLevel(logging.WARNING)

    def __exit__(self, *exc_info: object) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
