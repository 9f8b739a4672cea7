"""The bundled generation task `pydoc_recall` (evals/pydoc_recall.yaml): its data, and its scoring through quantlab:
lm-eval's generate_until, then exact match per document (0 or 1), so that two runs pair document by document."""

from __future__ import annotations

import re

import pytest
from lm_eval.api.model import LM
from test_evals import BUNDLED_EVALS_DIR, DATA_DIR, load_build_script, read_items

from quantlab import corpora
from quantlab.evaluate.lm_eval_runner import TaskRequest, run_tasks, score_tasks
from quantlab.metrics import Scale
from quantlab.paired import compare

TASK = "pydoc_recall"
KEY = f"eval/{TASK}/exact_match:remove_whitespace"  # lm-eval's metric under the task's one filter
STOPS = [".", ",", ";", "\n"]  # the YAML's `until`
MAX_GEN_TOKS = 8


def test_committed_data_is_what_build_script_makes() -> None:
    build = load_build_script()
    recorded, current = build.recorded_source_versions(), build.source_versions()
    if recorded != current:
        pytest.skip(f"evals/data was built from {recorded}; this is {current}, whose sources may differ")

    assert build.render_jsonl(build.pydoc_recall_items()) == (DATA_DIR / f"{TASK}.jsonl").read_text(encoding="utf-8")


def test_each_passage_stops_before_words_of_its_sentence_that_it_holds_already() -> None:
    eval_text = corpora.text("eval")
    items = read_items(TASK)

    assert len(items) >= 100
    for item in items:
        context, target = item["context"], item["target"]
        assert f"{context} {target}." in eval_text  # the real end of a real sentence
        assert re.search(rf"(?<!\w){re.escape(target)}(?!\w)", context)  # said before, as whole words
        assert 12 <= len(context.split()) <= 40 and 1 <= len(target.split()) <= 3
        assert not any(stop in target for stop in STOPS)


def test_passages_hold_no_calibration_sentence() -> None:
    calibration = corpora.paragraphs("calibration")
    sentences = {s for p in calibration for s in re.split(r"(?<=[.!?])\s+", p) if len(s.split()) >= 8}
    contexts = "\n".join(item["context"] for item in read_items(TASK))

    assert sentences and not [s for s in sentences if s in contexts]


def test_every_target_fits_the_tokens_generated(tiny_llama) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)  # the embedded model's own

    # After the passage the target is generated with its leading space; a token is left for the stop sequence.
    lengths = [len(tokenizer(" " + item["target"], add_special_tokens=False).input_ids) for item in read_items(TASK)]
    assert max(lengths) < MAX_GEN_TOKS


class Oracle(LM):
    """An lm-eval model that generates the right words for the even documents and wrong ones for the odd, as HFLM
    returns a generation: with its leading space, cut before the first stop sequence."""

    def __init__(self, targets: dict[str, str]) -> None:
        super().__init__()
        self.targets = targets  # passage -> its words

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [f" {self.targets[r.args[0]]}" if r.doc_id % 2 == 0 else " something else" for r in requests]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def test_generations_are_scored_per_document_and_paired(tiny_llama) -> None:
    model, tokenizer = tiny_llama.load()
    limit = 6
    items = read_items(TASK)[:limit]
    request = TaskRequest(TASK, limit=limit)

    (tiny,) = run_tasks(model, tokenizer, [request], BUNDLED_EVALS_DIR, batch_size=4)
    (oracle,) = score_tasks(Oracle({item["context"]: item["target"] for item in items}), [request], BUNDLED_EVALS_DIR)

    for scored in (tiny, oracle):
        score = scored.primary
        assert score.key == KEY and score.higher_is_better is True and score.scale is Scale.FRACTION
        assert sorted(score.documents.values) == list(range(limit))
        assert set(score.documents.values.values()) <= {0.0, 1.0}
        assert score.value == pytest.approx(sum(score.documents.values.values()) / limit)
        settings = scored.settings
        assert settings.documents == limit and settings.num_fewshot == 0
        assert settings.gen_kwargs["until"] == STOPS and settings.gen_kwargs["max_gen_toks"] == MAX_GEN_TOKS
        assert settings.gen_kwargs["do_sample"] is False  # greedy: one answer per document
        # Its answers: the generation as filtered (whitespace stripped), the gold the target
        assert [scored.answers[d, 0].gold for d in range(limit)] == [item["target"] for item in items]
        assert all(answer.answer == answer.answer.strip() for answer in scored.answers.values())
    # The right words after a space are an exact match; the rest are not.
    assert oracle.primary.documents.values == {d: float(d % 2 == 0) for d in range(limit)}
    assert [oracle.answers[d, 0].answer for d in range(0, limit, 2)] == [item["target"] for item in items[::2]]
    assert [oracle.answers[d, 0].correct for d in range(limit)] == [d % 2 == 0 for d in range(limit)]
    # Paired document by document: the flips are the documents whose score changed.
    paired = compare(TASK, tiny.primary.documents, oracle.primary.documents)
    changed = [d for d in range(limit) if tiny.primary.documents.values[d] != oracle.primary.documents.values[d]]
    assert paired.n == limit and paired.correct_to_wrong + paired.wrong_to_correct == len(changed)
    assert paired.test == "mcnemar_exact"
