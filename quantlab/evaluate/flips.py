"""The changed answers: what each lm-eval document asked, what a run answered and what the gold was, and the
documents whose correctness a variant changed against the baseline (pure: records in, dataclasses out).

Every run keeps its answers per leaf task (`answers/<task>.jsonl`, `DocumentAnswer` per line); the sweep's
publishing pairs each variant's with the baseline's (`changed_answers`) into a table per task. A task scored in
repeats (`evals.tasks[].repeats`) keeps every repeat's answers, and repeat k of the variant pairs with repeat k of the
baseline: both sampled with the same seed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

PROMPT_CHARS = 300  # a prompt's end kept: its own question, after any few-shot examples
ANSWER_CHARS = 120  # a choice or a generation, cut to fit a table cell
ANSWERS_DIR = "answers"  # a run's artifacts: answers/<task>.jsonl
CHANGED_DIR = "changed_answers"  # a variant run's artifacts: changed_answers/<task>.json (MLflow table) and .csv


def answers_artifact(task: str) -> str:
    return f"{ANSWERS_DIR}/{task}.jsonl"


def changed_artifact(task: str, suffix: str) -> str:
    return f"{CHANGED_DIR}/{task}.{suffix}"


AnswerKey = tuple[int, int]  # (doc_id, repeat): repeat 0 for a task scored once


@dataclass(frozen=True)
class DocumentAnswer:
    """One document as a run saw it. `correct`: its primary score's per-document value where that is 0 or 1, else
    None (a perplexity, a partial-credit score: no answer is right or wrong). `repeat`: which of the task's repeats
    (from 1) gave it; None for a task scored once."""

    doc_id: int
    prompt: str  # its last PROMPT_CHARS characters, whitespace collapsed
    answer: str  # the run's choice (the choice text), or its generation
    gold: str
    correct: bool | None = None
    repeat: int | None = None

    @property
    def key(self) -> AnswerKey:
        """What a run's answers are keyed by, and what pairs them with another run's."""
        return self.doc_id, self.repeat or 0


def keyed(answers: Iterable[DocumentAnswer]) -> dict[AnswerKey, DocumentAnswer]:
    return {answer.key: answer for answer in answers}


@dataclass(frozen=True)
class ChangedAnswer:
    """A document the variant answered right where the baseline was wrong, or wrong where it was right."""

    task: str
    doc_id: int
    prompt: str
    gold: str
    baseline_answer: str
    baseline_correct: bool
    variant_answer: str
    variant_correct: bool
    repeat: int | None = None  # the repeat both answers came from (the same seed); None for a task scored once

    @property
    def direction(self) -> str:
        return "correct_to_wrong" if self.baseline_correct else "wrong_to_correct"


@dataclass(frozen=True)
class ChangedAnswers:
    """One task's changed answers, and what they were looked for among: `paired` documents both runs answered with a
    0/1 score (adaptive evaluation may have scored the variant on fewer); for a task scored in `repeats`, documents x
    repeats, each repeat against the baseline's same repeat."""

    task: str
    rows: tuple[ChangedAnswer, ...]
    paired: int
    repeats: int = 1

    def words(self) -> str:
        worse = sum(row.direction == "correct_to_wrong" for row in self.rows)
        among = f"answers ({self.repeats} repeats of each document)" if self.repeats > 1 else "documents"
        return (
            f"{len(self.rows)} of {self.paired} {among} changed "
            f"({worse} right to wrong, {len(self.rows) - worse} wrong to right)"
        )


def changed_answers(
    task: str, baseline: Mapping[AnswerKey, DocumentAnswer], variant: Mapping[AnswerKey, DocumentAnswer]
) -> ChangedAnswers:
    """The answers both runs gave with a 0/1 score whose correctness differs, by document (and repeat: `keyed`)."""
    both = sorted(
        key
        for key in baseline.keys() & variant.keys()
        if baseline[key].correct is not None and variant[key].correct is not None
    )
    rows = tuple(
        ChangedAnswer(
            task,
            variant[key].doc_id,
            variant[key].prompt or baseline[key].prompt,
            variant[key].gold or baseline[key].gold,
            baseline[key].answer,
            bool(baseline[key].correct),
            variant[key].answer,
            bool(variant[key].correct),
            variant[key].repeat,
        )
        for key in both
        if baseline[key].correct != variant[key].correct
    )
    return ChangedAnswers(task, rows, len(both), len({variant[key].repeat for key in both}) or 1)


def table(changed: ChangedAnswers, baseline: str, variant: str) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows, the runs named in the headers (the artifacts, the MLflow table and the terminal show these)."""
    repeats = changed.repeats > 1
    columns = [
        "doc_id",
        *(["repeat"] if repeats else []),
        f"prompt (last {PROMPT_CHARS} characters)",
        "gold",
        f"{baseline} answer",
        f"{baseline} correct",
        f"{variant} answer",
        f"{variant} correct",
        "direction",
    ]
    rows = [
        [
            row.doc_id,
            *([row.repeat] if repeats else []),
            row.prompt,
            row.gold,
            row.baseline_answer,
            row.baseline_correct,
            row.variant_answer,
            row.variant_correct,
            row.direction,
        ]
        for row in changed.rows
    ]
    return columns, rows


# --- A run's answers, from lm-eval's per-document samples and back from its artifact ---


def document_answer(sample: Mapping[str, Any], metric: str) -> DocumentAnswer:
    """One lm-eval sample (`log_samples`) as a `DocumentAnswer`; `metric` is the task's primary score, whose value in
    the sample says whether the answer was right (acc_norm ranks the choices by loglikelihood per character, as
    lm-eval does)."""
    arguments = sample.get("arguments") or []
    responses, target = sample.get("filtered_resps"), sample.get("target")
    continuations = [_argument(arguments, i, 1) for i in range(len(arguments))]
    try:
        answer, gold = _answer_and_gold(responses, target, continuations, metric)
    except (TypeError, ValueError, IndexError):  # a response shape of a task type not read here: shown as it is
        answer, gold = str(responses), str(target)
    return DocumentAnswer(
        int(sample["doc_id"]),
        _end(_argument(arguments, 0, 0), PROMPT_CHARS),
        _cut(answer, ANSWER_CHARS),
        _cut(gold, ANSWER_CHARS),
        _zero_or_one(sample.get(metric)),
    )


def _answer_and_gold(responses: Any, target: Any, continuations: list[str], metric: str) -> tuple[str, str]:
    if isinstance(responses, str):
        return responses, _gold_text(target, [])
    if not isinstance(responses, Sequence) or not responses:
        return str(responses), _gold_text(target, continuations)
    if isinstance(responses[0], str):  # generate_until: the generation, after the task's filters
        return responses[0], _gold_text(target, [])
    if len(responses) > 1:  # multiple_choice: one loglikelihood per choice
        return _ranked_first(responses, continuations, metric), _gold_text(target, continuations)
    if not isinstance(responses[0], Sequence):  # loglikelihood_rolling (a perplexity): a score, not an answer
        return f"loglikelihood {float(responses[0]):.6g}", ""
    # loglikelihood of one continuation: right where it is the model's greedy choice
    continuation = continuations[0] if continuations else str(target)
    if _greedy(responses[0]):
        return continuation, continuation
    return f"not {_cut(continuation, ANSWER_CHARS - 4)!r} (not its greedy choice)", continuation


def answers_jsonl(answers: Mapping[AnswerKey, DocumentAnswer]) -> str:
    return "".join(json.dumps(_record(answers[key])) + "\n" for key in sorted(answers))


def _record(answer: DocumentAnswer) -> dict[str, Any]:
    """A line of answers/<task>.jsonl: a task scored once keeps the lines it always had (no `repeat`)."""
    record = asdict(answer)
    if answer.repeat is None:
        del record["repeat"]
    return record


def answers_from_jsonl(text: str) -> dict[AnswerKey, DocumentAnswer]:
    """ValueError (or KeyError, TypeError) where a line is not a DocumentAnswer."""
    return keyed(DocumentAnswer(**json.loads(line)) for line in text.splitlines() if line.strip())


def _zero_or_one(value: Any) -> bool | None:
    try:
        number = float(value)
    except (TypeError, ValueError):  # absent, or a (loglikelihood, weight) pair
        return None
    return bool(number) if number in (0.0, 1.0) else None


def _argument(arguments: Sequence[Any], index: int, part: int) -> str:
    try:
        return str(arguments[index][part])
    except (IndexError, KeyError, TypeError):
        return ""


def _loglikelihood(response: Any) -> float:
    value = response[0] if isinstance(response, Sequence) and not isinstance(response, str) else response
    return float(value)


def _greedy(response: Any) -> bool:
    return bool(response[1]) if isinstance(response, Sequence) and len(response) > 1 else False


def _ranked_first(responses: Sequence[Any], continuations: list[str], metric: str) -> str:
    scores = [_loglikelihood(response) for response in responses]
    if metric == "acc_norm" and len(continuations) == len(scores):
        scores = [score / max(len(text), 1) for score, text in zip(scores, continuations)]
    best = max(range(len(scores)), key=scores.__getitem__)
    return continuations[best].strip() if best < len(continuations) and continuations[best] else f"choice {best}"


def _gold_text(target: Any, continuations: list[str]) -> str:
    """A choice's index as the choice's text; a list of golds (several right answers) joined."""
    if isinstance(target, bool):
        return str(target)
    if isinstance(target, int) and 0 <= target < len(continuations):
        return continuations[target].strip()
    if isinstance(target, (list, tuple)):
        return " | ".join(_gold_text(item, continuations) for item in target)
    return str(target)


def _end(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else "…" + flat[-(limit - 1) :]


def _cut(text: str, limit: int) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
