"""The changed answers: what each lm-eval document asked, what a run answered and what the gold was, and the
documents whose correctness a variant changed against the baseline (pure: records in, dataclasses out).

Every run keeps its answers per leaf task (`answers/<task>.jsonl`, `DocumentAnswer` per line); the sweep's
publishing pairs each variant's with the baseline's (`changed_answers`) into a table per task.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
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


@dataclass(frozen=True)
class DocumentAnswer:
    """One document as a run saw it. `correct`: its primary score's per-document value where that is 0 or 1, else
    None (a perplexity, a partial-credit score: no answer is right or wrong)."""

    doc_id: int
    prompt: str  # its last PROMPT_CHARS characters, whitespace collapsed
    answer: str  # the run's choice (the choice text), or its generation
    gold: str
    correct: bool | None = None


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

    @property
    def direction(self) -> str:
        return "correct_to_wrong" if self.baseline_correct else "wrong_to_correct"


@dataclass(frozen=True)
class ChangedAnswers:
    """One task's changed answers, and what they were looked for among: `paired` documents both runs answered with a
    0/1 score (adaptive evaluation may have scored the variant on fewer)."""

    task: str
    rows: tuple[ChangedAnswer, ...]
    paired: int

    def words(self) -> str:
        worse = sum(row.direction == "correct_to_wrong" for row in self.rows)
        return (
            f"{len(self.rows)} of {self.paired} documents changed "
            f"({worse} right to wrong, {len(self.rows) - worse} wrong to right)"
        )


def changed_answers(
    task: str, baseline: Mapping[int, DocumentAnswer], variant: Mapping[int, DocumentAnswer]
) -> ChangedAnswers:
    """The documents both runs answered with a 0/1 score whose correctness differs, by document id."""
    both = sorted(
        doc
        for doc in baseline.keys() & variant.keys()
        if baseline[doc].correct is not None and variant[doc].correct is not None
    )
    rows = tuple(
        ChangedAnswer(
            task,
            doc,
            variant[doc].prompt or baseline[doc].prompt,
            variant[doc].gold or baseline[doc].gold,
            baseline[doc].answer,
            bool(baseline[doc].correct),
            variant[doc].answer,
            bool(variant[doc].correct),
        )
        for doc in both
        if baseline[doc].correct != variant[doc].correct
    )
    return ChangedAnswers(task, rows, len(both))


def table(changed: ChangedAnswers, baseline: str, variant: str) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows, the runs named in the headers (the artifacts, the MLflow table and the terminal show these)."""
    columns = [
        "doc_id",
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


def answers_jsonl(answers: Mapping[int, DocumentAnswer]) -> str:
    return "".join(json.dumps(asdict(answers[doc])) + "\n" for doc in sorted(answers))


def answers_from_jsonl(text: str) -> dict[int, DocumentAnswer]:
    """ValueError (or KeyError, TypeError) where a line is not a DocumentAnswer."""
    found = [DocumentAnswer(**json.loads(line)) for line in text.splitlines() if line.strip()]
    return {answer.doc_id: answer for answer in found}


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
