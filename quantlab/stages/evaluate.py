"""The evaluate and damage stages of a variant, as the runner sees them: results in, metrics out."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from quantlab import adaptive, cache
from quantlab.corpora import load_texts
from quantlab.evaluate.damage import flip_metrics, paired_flips, recovery
from quantlab.evaluate.flips import AnswerKey, DocumentAnswer, answers_artifact, answers_jsonl
from quantlab.metrics import (
    ADAPTIVE_PARAM,
    ADAPTIVE_TAG_PREFIX,
    ENGINE_FLOOR_PREFIX,
    ENGINE_VS_REFERENCE_PREFIX,
    PAIRED_PREFIX,
    Declared,
    EvalKey,
    adaptive_key,
    declared_tags,
    paired_key,
    unknown_directions,
)
from quantlab.paired import DocumentScores, Group, NotPaired, PairedComparison, combine, compare
from quantlab.policy import DropRule, PolicyError

if TYPE_CHECKING:
    from quantlab.evaluate.lm_eval_runner import TaskDataset, TaskRequest, TaskScores
    from quantlab.evaluate.served_damage import ServedPass
    from quantlab.jobs import BaselineOutputs, StageReporter, VariantJob
    from quantlab.policy import Policy
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
    # leaf task -> (doc id, repeat) -> its answer
    answers: dict[str, dict[AnswerKey, DocumentAnswer]] = field(default_factory=dict)
    datasets: tuple[TaskDataset, ...] = ()
    # Score keys scored on a subset of the baseline's documents (adaptive evaluation stopped their task early): paired
    # with the baseline on those documents alone.
    sampled: frozenset[str] = frozenset()


@dataclass(frozen=True)
class DamageOutcome:
    """What token_damage (per token) or answer_damage (per lm-eval document) adds to the variant's result."""

    metrics: dict[str, float]  # quality/...
    tags: dict[str, str] = field(default_factory=dict)
    reference_dir: str | None = None  # token_damage: the baseline's stored pass
    documents: dict[str, DocumentScores] = field(default_factory=dict)  # token_damage: quality/<figure> -> per token
    artifacts: dict[str, str] = field(default_factory=dict)  # answer_damage: flips/<task>.jsonl, answers/<task>.jsonl
    served: ServedPass | None = None  # served_token_damage: the engine's pass, which the baseline's floor repeats


V = TypeVar("V")
NOTE_TAG = "quantlab.eval_note/"  # + score key: why a score has no per-document analysis or pairing
# ... + score key + one of these: why one comparison of it was not paired (each stage's note under its own key)
PAIRED_NOTE, ENGINE_NOTE, FLOOR_NOTE = "/paired", "/engine_vs_reference", "/engine_floor"
UNKNOWN_DIRECTION_TAG = "quantlab.direction_unknown"  # scores lm-eval declared no direction for
SKIPPED_TAG = "quantlab.quality.skipped"
SERVED_DAMAGE_TAG = "quantlab.quality.served_kld"  # how quality/served/kld_topk_* was computed
SERVED_WINDOWS_AT_ONCE = 4  # token windows in flight at once in a served pass
# The floor's token pass: fewer at once, as twice as many would send a small corpus's windows (1,024 tokens: 4) in
# the one group the first pass sent them in; a handful of windows, so fewer costs little.
FLOOR_WINDOWS_AT_ONCE = SERVED_WINDOWS_AT_ONCE // 2
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


@dataclass(frozen=True)
class AdaptivePlan:
    """What adaptive evaluation of one variant needs from outside its evaluate stage (`adaptive_plan`)."""

    baseline: BaselineOutputs  # every document of every task, scored by the baseline
    policy: Policy  # the recipe's default policy: the drop limits a task's stages settle
    alpha: float  # the one-sided level the variant's claims are judged at (the policy's, or its Bonferroni share)
    # A plain limit of the policy the variant's damage figures already fail (its words), or None: the variant is
    # rejected whatever its tasks show, so each stops at its first stage.
    rejected_by: str | None = None


def adaptive_plan(recipe: Recipe, job: VariantJob, damage: DamageOutcome) -> AdaptivePlan | None:
    """None where the variant scores every document: adaptive evaluation off, or the baseline itself (every variant
    pairs its documents with the baseline's). `damage`: the variant's token damage, judged against the policy's plain
    limits on it (max_kld, min_top1_agreement, at_most / at_least on a quality figure)."""
    from quantlab.policy import CandidateControl

    if not recipe.evals.adaptive or job.is_baseline or job.baseline is None:
        return None
    policy = recipe.frontier.default_policy
    candidates = len(recipe.variants) - 1
    # `pick` tests each candidate at the policy's level, or under Bonferroni at its share: the stages spend that.
    split = candidates if policy.candidates is CandidateControl.BONFERRONI and candidates > 1 else 1
    failed = (
        bound.failed_by(damage.metrics[bound.metric]) for bound in policy.bounds() if bound.metric in damage.metrics
    )
    return AdaptivePlan(job.baseline, policy, policy.one_sided_alpha / split, next(filter(None, failed), None))


def evaluate_tasks(
    model,
    tokenizer,
    settings: EvalSettings,
    include_path: Path | None,
    report: StageReporter,
    max_length: int | None,
    plan: AdaptivePlan | None = None,
) -> EvalOutcome:
    """`max_length`: `evaluation_max_length`'s; `plan`: `adaptive_plan`'s (None: every document)."""
    from quantlab.evaluate.lm_eval_runner import hf_language_model, run_tasks

    if not settings.tasks or settings.engine == "served":
        return EvalOutcome()
    requests = task_requests(settings)
    progress = lambda step: report(f"evaluate: {step}")  # noqa: E731
    if plan is not None:
        language_model = hf_language_model(model, tokenizer, settings.batch_size, max_length)
        return _with_max_length(
            adaptive_outcome(language_model, requests, include_path, progress, settings, plan), max_length
        )
    scores = run_tasks(
        model, tokenizer, requests, include_path, settings.batch_size, progress=progress, max_length=max_length
    )
    return _with_max_length(eval_outcome(scores), max_length)


def adaptive_outcome(
    language_model,
    requests: list[TaskRequest],
    include_path: Path | None,
    progress: Callable[[str], None],
    settings: EvalSettings,
    plan: AdaptivePlan,
) -> EvalOutcome:
    """The requested tasks scored in stages (`quantlab.adaptive`): a stage of every task still running, then each one's
    drop checks judged at the stage's level; a task stops once they are settled. What it scored, with where and why
    each task stopped (quality/adaptive/<task>/..., the tag quantlab.adaptive/<task>)."""
    import tempfile

    from quantlab.evaluate.lm_eval_runner import task_manager_for, task_names

    manager = task_manager_for([request.name for request in requests], include_path)
    under = [task_names(request.name, manager.task_index) for request in requests]
    designs = [_design(names, plan, settings) for names in under]
    scored: list[list[TaskScores]] = [[] for _ in requests]
    stopped: dict[int, adaptive.StageResult] = {}
    stage = [0] * len(requests)
    rules: tuple[DropRule, ...] | None = None
    with tempfile.TemporaryDirectory(prefix="quantlab-adaptive-") as scratch:
        # lm-eval's request cache: a later stage re-asks for the documents of the earlier ones and scores only the new.
        score = partial(_score_stage, language_model, include_path, progress, Path(scratch) / "requests")
        for index, request in enumerate(requests):
            if designs[index] is None:  # nothing of the baseline's to pair per document: scored as without adaptive
                scored[index] = score(request, None, 0)
                stopped[index] = adaptive.StageResult(
                    request.name, 0, 1, _documents(scored[index]), _documents(scored[index]), 1.0, 1.0,
                    adaptive.StopReason.NOT_ADAPTIVE, "the baseline has no per-document scores for it",
                )  # fmt: skip
        while running := [index for index in range(len(requests)) if index not in stopped]:
            for index in running:
                scored[index] = score(requests[index], designs[index], stage[index])
            if rules is None:  # the scores' directions and scales are lm-eval's: known once every task has run once
                rules = _drop_rules(plan, [task for tasks in scored for task in tasks])
            for index in running:
                design = designs[index]
                if design is None:
                    continue  # stopped before the loop
                found = _stage_verdict(
                    requests[index].name, under[index], design, stage[index], scored[index], plan, rules
                )
                if found is None:
                    stage[index] += 1
                    continue
                if not found.sequential and stage[index] < design.stages - 1:  # nothing to settle: every document
                    last = design.stages - 1
                    scored[index] = score(requests[index], design, last)
                    found = replace(found, stage=last, documents_used=design.used(last))
                stopped[index] = found
    tasks = [task for found in scored for task in found]
    outcome = eval_outcome(tasks)
    results = [stopped[index] for index in range(len(requests))]
    return replace(
        outcome,
        metrics=outcome.metrics | _adaptive_metrics(results, under),
        params=outcome.params | {ADAPTIVE_PARAM: _adaptive_words(settings, plan)},
        tags=outcome.tags | {ADAPTIVE_TAG_PREFIX + found.task: found.words for found in results},
        sampled=frozenset(
            score.key
            for found, names, tasks_of in zip(results, under, scored)
            if found.documents_used < found.documents_total
            for task in tasks_of
            for score in task.scores
        ),
    )


def _design(names: set[str], plan: AdaptivePlan, settings: EvalSettings) -> adaptive.Design | None:
    """The stages of one request, over its leaves the baseline scored per document; None where it has none."""
    baseline = plan.baseline
    orders = {
        task: adaptive.document_order(list(baseline.documents[key].values), settings.adaptive_seed, task)
        for task in sorted(names)
        if (key := baseline.primary.get(task)) in baseline.documents
    }
    if not orders:
        return None
    return adaptive.design(orders, settings.adaptive_stages, plan.alpha, settings.adaptive_spending)


def _score_stage(
    language_model,
    include_path: Path | None,
    progress: Callable[[str], None],
    cache: Path,
    request: TaskRequest,
    design: adaptive.Design | None,
    stage: int,
) -> list[TaskScores]:
    """`request` scored on the documents of `design`'s `stage` (None: all, as without adaptive evaluation)."""
    from quantlab.evaluate.lm_eval_runner import score_tasks

    if design is None:
        return score_tasks(language_model, [request], include_path, progress, cache=cache)
    shown = f"stage {stage + 1} of {design.stages}, {design.used(stage):,} of {design.total:,} documents: "
    samples = design.samples(stage)
    return score_tasks(language_model, [request], include_path, lambda step: progress(shown + step), samples, cache)


def _drop_rules(plan: AdaptivePlan, tasks: list[TaskScores]) -> tuple[DropRule, ...]:
    """The policy's drop limits made concrete against the baseline, as `pick` makes them; none where the policy does
    not fit the scores (`pick` names that; every task then runs every document)."""
    declared = {score.key: Declared(score.higher_is_better, score.scale) for task in tasks for score in task.scores}
    try:
        return plan.policy.drop_rules(plan.baseline.scores, declared, plan.baseline.groups)
    except PolicyError:
        return ()


FEW_SHOT = "scored with few-shot examples, which lm-eval draws in document order: a subset would change the prompts"


def _stage_verdict(
    request: str,
    names: set[str],
    design: adaptive.Design,
    stage: int,
    tasks: list[TaskScores],
    plan: AdaptivePlan,
    rules: tuple[DropRule, ...],
) -> adaptive.StageResult | None:
    """Whether `stage` ends the request's task, and why; None: on to the next stage."""

    def result(reason: adaptive.StopReason, detail: str = "") -> adaptive.StageResult:
        level, share = design.levels[stage], design.share(stage)
        return adaptive.StageResult(
            request, stage, design.stages, design.used(stage), design.total, level, share, reason, detail
        )

    if any(task.settings is not None and task.settings.num_fewshot > 0 for task in tasks):
        return result(adaptive.StopReason.NOT_ADAPTIVE, FEW_SHOT)
    mine = [rule for rule in rules if (key := EvalKey.parse(rule.metric)) is not None and key.task in names]
    if not mine:
        return result(adaptive.StopReason.UNCHECKED)
    if plan.rejected_by is not None:  # a stop for a reason outside the task's claims: they stay at the stage's level
        return result(adaptive.StopReason.REJECTED, plan.rejected_by)
    scores = replace(eval_outcome(tasks, quiet=True), sampled=frozenset(score.key for t in tasks for score in t.scores))
    comparisons = paired_comparisons(_on_documents_of(plan.baseline, scores), scores)[0]
    outcomes = adaptive.stage_outcomes(mine, comparisons, design.levels[stage], len(rules), plan.policy.power)
    reason = adaptive.stop_after(outcomes, last=stage == design.stages - 1)
    return None if reason is None else result(reason)


def _documents(tasks: list[TaskScores]) -> int:
    return sum(task.settings.documents for task in tasks if task.settings is not None)


def _adaptive_metrics(results: list[adaptive.StageResult], under: list[set[str]]) -> dict[str, float]:
    """Per request: documents used and had, the stage it stopped at; for every task under a request whose claims were
    tested in stages, the level share its drop checks are judged at (`pick` reads it by the check's task)."""
    metrics: dict[str, float] = {}
    for found, names in zip(results, under):
        metrics |= {
            adaptive_key(found.task, "documents_used"): found.documents_used,
            adaptive_key(found.task, "documents_total"): found.documents_total,
            adaptive_key(found.task, "stage"): found.stage + 1,
        }
        if found.sequential:
            metrics |= {adaptive_key(name, "level_share"): found.level_share for name in sorted(names | {found.task})}
    return metrics


def _adaptive_words(settings: EvalSettings, plan: AdaptivePlan) -> str:
    stages = ", ".join(f"{fraction:g}" for fraction in settings.adaptive_stages)
    return (
        f"stages at [{stages}] of each task's documents, {settings.adaptive_spending.value} spending of a one-sided "
        f"{plan.alpha:g}, document order seed {settings.adaptive_seed}"
    )


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
    plan: AdaptivePlan | None = None,
) -> EvalOutcome:
    """The recipe's tasks scored through the variant's own server (evals.engine: served or both): lm-eval's
    local-completions, the engine's kernels; per-document scores as from the reference, in its windows
    (`max_length`: `evaluation_max_length`'s; `plan`: `adaptive_plan`'s, None: every document)."""
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
        served.engine,
        served.server.url,
        str(served.checkpoint),
        served.checkpoint,
        settings.served_concurrency,
        max_length,
        settings.batch_size,
    )
    progress = lambda step: report(f"evaluate on engine: {step}")  # noqa: E731
    if plan is not None:
        return _with_max_length(adaptive_outcome(model, requests, include_path, progress, settings, plan), max_length)
    return _with_max_length(eval_outcome(score_tasks(model, requests, include_path, progress=progress)), max_length)


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
    served: ServedVariant | None,
    settings: QualitySettings,
    baseline_reference: str | None,
    baseline: BaselineOutputs | None = None,
) -> DamageOutcome:
    """Perplexity, top-1 agreement and a top-k KL through the engine's prompt log-probabilities, against the
    baseline's stored pass (quality/served/...); and where the recipe generates (quality.generate), the same over the
    baseline's own continuations, by part (quality/served/on_policy/<part>/...), paired against the baseline's served
    figures (`baseline`: the baseline's outputs, None for the baseline itself) with the sequences as clusters."""
    from quantlab.evaluate.on_policy import (
        SERVED_PREFIX,
        on_policy_documents,
        on_policy_figures,
        on_policy_reference_dir,
        sequence_parts,
    )
    from quantlab.evaluate.reference import INFO_FILE
    from quantlab.evaluate.served_damage import served_on_policy_figures, served_pass, served_token_comparison

    if served is None or not served.engine.scores_prompts or not settings.enabled or baseline_reference is None:
        return DamageOutcome({})
    url, name, top_k = served.server.url, str(served.checkpoint), served.launch.top_logprobs
    found = served_pass(served.engine, url, name, Path(baseline_reference), top_k, SERVED_WINDOWS_AT_ONCE)
    metrics = served_token_comparison(found, Path(baseline_reference)).metrics()
    documents: dict[str, DocumentScores] = {}
    on_policy = on_policy_reference_dir(Path(baseline_reference))
    if settings.generate.enabled and (on_policy / INFO_FILE).is_file():
        generated = served_pass(served.engine, url, name, on_policy, top_k, SERVED_WINDOWS_AT_ONCE)
        figures, masks = served_on_policy_figures(generated, on_policy), sequence_parts(on_policy)
        metrics |= on_policy_figures(figures, masks, SERVED_PREFIX)
        documents = on_policy_documents(figures, masks, generated.windows, SERVED_PREFIX)
        if baseline is not None:
            paired = {
                key: compare(key, baseline.documents[key], docs)
                for key, docs in documents.items()
                if key in baseline.documents
            }
            metrics |= _paired_metrics(paired)
    method = f"KL over the engine's top {top_k} tokens plus one bucket for the rest: a lower bound"
    return DamageOutcome(metrics, {SERVED_DAMAGE_TAG: method}, baseline_reference, documents, served=found)


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
                "served_concurrency": _more(settings.served_concurrency),
                "batch_size": _more(settings.batch_size),
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
        second = served_pass(served.engine, url, name, reference_dir, top_k, FLOOR_WINDOWS_AT_ONCE, reverse=True)
        metrics |= served_twice(tokens.served, second).metrics(ENGINE_FLOOR_PREFIX + "served/")
        passes.append(
            f"token windows {SERVED_WINDOWS_AT_ONCE} at a time, then {FLOOR_WINDOWS_AT_ONCE} at a time, last first"
        )
    what = f"{served.variant} served twice by {served.engine.label}: " + "; ".join(passes)
    return DamageOutcome(metrics, notes | {ENGINE_FLOOR_TAG: what})


def _more(setting: int) -> int:
    """The tasks' other concurrency or batch size: twice `setting`. Any other batching regroups the requests (what the
    floor measures); more at once keeps the second pass no slower than the first, where fewer in flight would make
    the floor the sweep's slowest served pass."""
    return setting * 2


def eval_outcome(tasks: list[TaskScores], quiet: bool = False) -> EvalOutcome:
    """What the runner logs and keeps from the scored tasks; `quiet`: without the notes in the variant's log."""
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
    for line in [] if quiet else lines:
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
        answers={task.task: dict(task.answers) for task in tasks if not task.is_group},
        datasets=tuple(datasets.values()),
    )


def token_damage(
    model, tokenizer, settings: QualitySettings, recipe_dir: Path, job: VariantJob, checkpoint_key: str
) -> DamageOutcome:
    """Perplexity and KL against the baseline's stored pass (written here when this is the baseline)."""
    from quantlab.evaluate import reference
    from quantlab.evaluate.contexts import ContextDamage, context_damage
    from quantlab.evaluate.on_policy import OnPolicyDamage, on_policy_damage

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
    on_policy = OnPolicyDamage({}, {}, {})
    if settings.generate.enabled:  # over the baseline's own greedy continuations, in a pass of its own
        on_policy = on_policy_damage(model, tokenizer, settings, recipe_dir, reference_dir, job)
        baseline, documents = baseline | on_policy.baseline_documents, documents | on_policy.documents
    paired = {key: compare(key, baseline[key], docs) for key, docs in documents.items()}
    effects = {f"{key}_design_effect": c.design_effect for key, c in paired.items() if c.design_effect is not None}
    metrics = tokens.metrics() | by_context.metrics | on_policy.metrics | _paired_metrics(paired) | effects
    return DamageOutcome(metrics, by_context.tags | on_policy.tags, str(reference_dir), documents)


def answer_damage(scores: EvalOutcome, baseline: BaselineOutputs | None) -> DamageOutcome:
    """Paired statistics of every analysable lm-eval score against the baseline (groups through
    their leaves), flips and exact McNemar for 0/1 primary scores (a group's flips are its
    leaves'), and recovery of every score. The baseline compares itself with itself: its own zeros."""
    reference = _on_documents_of(baseline, scores) if baseline is not None else scores  # .documents and .scores
    comparisons, notes = paired_comparisons(reference, scores)
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
    # Every run's own answers, the baseline's too: the sweep pairs them into each variant's changed answers.
    artifacts |= {answers_artifact(task): answers_jsonl(answers) for task, answers in scores.answers.items() if answers}
    metrics |= recovery(reference.scores, scores.scores)
    tags = {NOTE_TAG + key + PAIRED_NOTE: f"not paired: {note}" for key, note in notes.items()}
    return DamageOutcome(metrics, tags, artifacts=artifacts)


def paired_comparisons(
    reference: BaselineOutputs | EvalOutcome, scores: EvalOutcome
) -> tuple[dict[str, PairedComparison], dict[str, str]]:
    """Every analysable score of `scores` paired with `reference`'s (groups through their leaves), and why the others
    were not."""
    comparisons, notes, missing = _compare_documents(reference.documents, scores.documents)
    notes |= dict.fromkeys(missing, "the baseline has no per-document scores for it")
    for key, parts in scores.groups.items():
        missing = [leaf for leaf in parts.leaves if leaf not in comparisons]
        if missing:
            notes[key] = f"no paired comparison for its leaves {', '.join(missing)}"
            continue
        comparisons[key] = combine([comparisons[leaf] for leaf in parts.leaves], parts.weights)
    return comparisons, notes


def _on_documents_of(baseline: BaselineOutputs, scores: EvalOutcome) -> BaselineOutputs:
    """The baseline on the documents `scores` scored where adaptive evaluation stopped a task early (its `sampled`
    keys): their per-document scores, and the scores they aggregate to (a group's with the variant's leaf weights),
    so that pairs, flips and recovery compare like with like. A variant document the baseline lacks stays, to be
    refused as not paired."""
    if not scores.sampled:
        return baseline
    documents = dict(baseline.documents)
    for key in scores.sampled & baseline.documents.keys() & scores.documents.keys():
        mine, theirs = scores.documents[key].values.keys(), baseline.documents[key]
        if mine <= theirs.values.keys():
            documents[key] = replace(
                theirs,
                values=_only(theirs.values, mine),
                weights=_only(theirs.weights, mine),
                clusters=_only(theirs.clusters, mine),
            )
    values = {key: documents[key].aggregate() for key in scores.sampled & documents.keys()}
    for key in scores.sampled & scores.groups.keys():
        group = scores.groups[key]
        if all(leaf in values for leaf in group.leaves):
            values[key] = sum(weight * values[leaf] for leaf, weight in zip(group.leaves, group.weights))
    return replace(baseline, documents=documents, scores=baseline.scores | values)


def _only(mapping: Mapping[int, V], documents: Collection[int]) -> dict[int, V]:
    return {doc: value for doc, value in mapping.items() if doc in documents}


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
