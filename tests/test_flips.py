"""The changed answers (issue 49): which documents a variant answered differently from the baseline, with both answers
and the gold. The pairing is a pure function (table-driven here); one real sweep of the tiny Llama into a real MLflow
store checks the tables on the variant run, the parent's links and `quantlab flips` against the runs' own records."""

from __future__ import annotations

import csv
import io
import json
import re
import sys

import pytest
from test_executors import RecordingDisplay
from tiny import save_tiny_llama

from quantlab import cli, tracking
from quantlab.checks import validate
from quantlab.evaluate.flips import (
    PROMPT_CHARS,
    DocumentAnswer,
    answers_from_jsonl,
    answers_jsonl,
    changed_answers,
    document_answer,
    keyed,
    table,
)
from quantlab.jobs import BaselineOutputs
from quantlab.publish import CHANGED_TAG, changes_between, log_changed_answers, read_sweep
from quantlab.sweep import SweepOptions, run_sweep
from recipes import tiny_recipe, write


def _answers(*rows: tuple[int, str, bool | None]) -> dict[tuple[int, int], DocumentAnswer]:
    return keyed(DocumentAnswer(doc, f"question {doc}", answer, "A", correct) for doc, answer, correct in rows)


@pytest.mark.parametrize(
    ("baseline", "variant", "changed", "paired"),
    [
        pytest.param(_answers((0, "A", True), (1, "B", False)), _answers((0, "A", True), (1, "C", False)), [], 2,
                     id="another wrong answer is no change"),
        pytest.param(_answers((0, "A", True), (1, "B", False), (2, "A", True)),
                     _answers((0, "C", False), (1, "A", True), (2, "A", True)),
                     [(0, "A", "C", "correct_to_wrong"), (1, "B", "A", "wrong_to_correct")], 3, id="both ways"),
        pytest.param(_answers((0, "A", True), (1, "A", True), (2, "A", True)), _answers((2, "B", False)),
                     [(2, "A", "B", "correct_to_wrong")], 1, id="adaptive: only the documents the variant scored"),
        pytest.param(_answers((0, "A", None), (1, "A", True)), _answers((0, "B", None), (1, "A", True)), [], 1,
                     id="a document no 0/1 score judges is not paired"),
        pytest.param(_answers((5, "A", True)), _answers((6, "B", False)), [], 0, id="no document in common"),
    ],
)  # fmt: skip
def test_changed_answers_are_the_documents_whose_correctness_differs(baseline, variant, changed, paired):
    found = changed_answers("t", baseline, variant)
    assert found.paired == paired
    assert [(r.doc_id, r.baseline_answer, r.variant_answer, r.direction) for r in found.rows] == changed
    assert all(r.prompt == f"question {r.doc_id}" and r.gold == "A" for r in found.rows)


def test_a_repeated_task_pairs_each_repeat_with_the_baseline_s_same_repeat_and_says_so():
    def repeats(*rows: tuple[int, int, bool]) -> dict:
        return keyed(DocumentAnswer(doc, "q", "A" if right else "B", "A", right, repeat) for doc, repeat, right in rows)

    baseline = repeats((0, 1, True), (0, 2, False), (1, 1, True), (1, 2, True))
    variant = repeats((0, 1, True), (0, 2, True), (1, 1, False), (1, 2, True))
    found = changed_answers("t", baseline, variant)
    assert [(r.doc_id, r.repeat, r.direction) for r in found.rows] == [
        (0, 2, "wrong_to_correct"),
        (1, 1, "correct_to_wrong"),
    ]
    assert found.words() == "2 of 4 answers (2 repeats of each document) changed (1 right to wrong, 1 wrong to right)"
    columns, rows = table(found, "bf16", "fp8")
    assert columns[:2] == ["doc_id", "repeat"] and [row[:2] for row in rows] == [[0, 2], [1, 1]]
    assert answers_from_jsonl(answers_jsonl(variant)) == variant
    # A task scored once keeps the answers lines it always had: no repeat field, no repeat column.
    once = _answers((0, "A", True))
    assert "repeat" not in answers_jsonl(once) and answers_from_jsonl(answers_jsonl(once)) == once
    assert "repeat" not in table(changed_answers("t", once, _answers((0, "B", False))), "bf16", "fp8")[0]


def _choice_sample(metric_value: float, lls: list[float], target: int, metric: str = "acc", prompt: str = "Q:"):
    """An lm-eval multiple_choice sample as `log_samples` keeps it: one (context, continuation) and one
    (loglikelihood, is_greedy) per choice."""
    choices = [" A", " Bee", " Ceeeeeeeee"]
    return {
        "doc_id": 4,
        "arguments": [(prompt, choice) for choice in choices],
        "filtered_resps": [(ll, False) for ll in lls],
        "target": target,
        metric: metric_value,
    }


@pytest.mark.parametrize(
    ("sample", "metric", "expected"),
    [
        pytest.param(_choice_sample(1.0, [-1.0, -2.0, -3.0], 0), "acc", ("A", "A", True), id="choice right"),
        pytest.param(_choice_sample(0.0, [-5.0, -4.0, -9.0], 2), "acc", ("Bee", "Ceeeeeeeee", False), id="choice wrong"),
        # Per character the long choice's -9 beats the others': acc_norm ranks as lm-eval does.
        pytest.param(_choice_sample(1.0, [-5.0, -4.0, -9.0], 2, "acc_norm"), "acc_norm", ("Ceeeeeeeee", "Ceeeeeeeee", True),
                     id="acc_norm ranks per character"),
        pytest.param({"doc_id": 4, "arguments": [("Q: 2+2?", {"until": ["\n"]})], "filtered_resps": ["4"],
                      "target": "4", "exact_match": 1.0}, "exact_match", ("4", "4", True), id="generation"),
        pytest.param({"doc_id": 4, "arguments": [("The cat sat on the", " mat")], "filtered_resps": [(-0.5, False)],
                      "target": " mat", "acc": 0.0}, "acc", ("not 'mat' (not its greedy choice)", "mat", False),
                     id="loglikelihood"),
        pytest.param({"doc_id": 4, "arguments": [("A whole text.",)], "filtered_resps": [-3.0], "target": "",
                      "word_perplexity": (-3.0, 7)}, "word_perplexity", ("loglikelihood -3", "", None),
                     id="a perplexity is not right or wrong"),
    ],
)  # fmt: skip
def test_a_document_s_answer_gold_and_correctness_from_its_lm_eval_sample(sample, metric, expected):
    found = document_answer(sample, metric)
    answer, gold, correct = expected
    assert found.doc_id == 4 and found.correct is correct
    assert (found.answer, found.gold) == (answer, gold)
    assert answers_from_jsonl(answers_jsonl(keyed([found]))) == {(4, 0): found}


def test_a_long_prompt_keeps_its_end():
    found = document_answer(_choice_sample(1.0, [-1.0, -2.0, -3.0], 0, prompt="shot " * 200 + "the question?"), "acc")
    assert len(found.prompt) == PROMPT_CHARS and found.prompt.startswith("…")
    assert found.prompt.endswith("the question?")


# --- One real sweep ---

VARIANT = "mxfp4"


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """bf16 and MXFP4 over a tiny Llama initialised at 10x the usual scale: at the default the two random layers add
    little to what the tied embeddings decide, and 4-bit weights change almost no answer."""
    work = tmp_path_factory.mktemp("flips")
    model = save_tiny_llama(work / "model", initializer_range=0.2)
    variants = [{"name": "bf16", "method": "bf16"}, {"name": VARIANT, "method": VARIANT}]
    recipe = tiny_recipe(model, variants=variants, quality={"enabled": False})
    recipe["evals"]["tasks"] = [{"name": "mmlu_dev", "limit": 8}, {"name": "pydoc_cloze", "limit": 4}]
    loaded = validate(write(work / "recipe.yaml", recipe), work / "cache")
    uri = f"sqlite:///{work / 'store.db'}"
    # In this process: a sweep's own process spends most of a tiny sweep importing what this one has imported.
    outcome = run_sweep(loaded, SweepOptions(uri, work / "cache", "inprocess"), RecordingDisplay())
    assert outcome.exit_code == 0, outcome
    store = tracking.open_store(uri)
    parent = tracking.latest_sweep(store, "tiny")
    runs = {run.variant: run for run in tracking.child_runs(store, parent.run_id)}
    return uri, store, parent, runs


def _primary_values(store, run) -> dict[str, dict[int, float]]:
    """Leaf task -> each document's primary score, from the run's samples.json (the record flips are counted on)."""
    samples = BaselineOutputs.from_samples(json.loads(store.read_artifact(run.run_id, "samples.json")), None)
    return {task: samples.documents[key].values for task, key in samples.primary.items()}


def test_each_variant_run_lists_every_document_whose_correctness_changed(swept):
    _, store, _, runs = swept
    base, mine = _primary_values(store, runs["bf16"]), _primary_values(store, runs[VARIANT])
    tags = store.run(runs[VARIANT].run_id).tags
    tables = json.loads(tags[tracking.LOGGED_ARTIFACTS])  # what MLflow's UI lists as the run's tables
    listed = 0
    for task in ("mmlu_dev", "pydoc_cloze"):
        expected = sorted(doc for doc in mine[task] if mine[task][doc] != base[task][doc])
        logged = json.loads(store.read_artifact(runs[VARIANT].run_id, f"changed_answers/{task}.json"))
        assert {"path": f"changed_answers/{task}.json", "type": "table"} in tables
        rows = [dict(zip(logged["columns"], row)) for row in logged["data"]]
        assert [row["doc_id"] for row in rows] == expected
        text = store.read_artifact(runs[VARIANT].run_id, f"changed_answers/{task}.csv").decode()
        assert [int(row["doc_id"]) for row in csv.DictReader(io.StringIO(text))] == expected
        for row in rows:
            # Each side's correctness is its primary score's, and an answer is right exactly where it is the gold.
            assert row["bf16 correct"] == bool(base[task][row["doc_id"]]) != row[f"{VARIANT} correct"]
            assert row["bf16 correct"] == (row["bf16 answer"] == row["gold"])
            assert row[f"{VARIANT} correct"] == (row[f"{VARIANT} answer"] == row["gold"])
            assert row["direction"] == ("correct_to_wrong" if row["bf16 correct"] else "wrong_to_correct")
            assert row[f"prompt (last {PROMPT_CHARS} characters)"]
        assert tags[CHANGED_TAG + task].startswith(f"{len(expected)} of {len(mine[task])} documents changed")
        listed += len(rows)
    assert listed > 0, "the sweep was set up so that the variant changes some answers"


def test_the_parent_description_links_each_task_s_table(swept):
    _, store, parent, runs = swept
    description = store.run(parent.run_id).tags[tracking.NOTE]
    section = description[description.index("## Changed answers (against bf16)") :]
    run = runs[VARIANT]
    for task in ("mmlu_dev", "pydoc_cloze"):
        link = tracking.artifact_link(run.experiment_id, run.run_id, f"changed_answers/{task}.csv")
        assert f"[{task}]({link})" in section
    assert f"- **{VARIANT}**:" in section and "- **bf16**" not in section


def _flips(monkeypatch, capsys, uri: str, *args: str) -> tuple[int, str, str]:
    """`quantlab flips` in this process, through the command line's own entry (exit codes, bad input)."""
    monkeypatch.setattr(sys, "argv", ["quantlab", "flips", "--tracking-uri", uri, *args])
    monkeypatch.setenv("COLUMNS", "160")
    with pytest.raises(SystemExit) as ended:
        cli.main()
    out, err = capsys.readouterr()
    return ended.value.code, out, err


def test_quantlab_flips_prints_the_changed_answers_of_the_newest_sweep(swept, monkeypatch, capsys):
    uri, store, _, runs = swept
    found = {item.task: item for item in changes_between(store, runs["bf16"], runs[VARIANT])}
    code, out, _ = _flips(monkeypatch, capsys, uri, "--variant", VARIANT, "--task", "mmlu_dev")
    assert code == 0
    assert "pydoc_cloze" not in out
    assert f"mmlu_dev: {found['mmlu_dev'].words()}" in out
    for row in found["mmlu_dev"].changed.rows:  # MMLU's answers are letters: each row on one line, unwrapped
        cells = [
            row.gold,
            _marked(row.baseline_answer, row.baseline_correct),
            _marked(row.variant_answer, row.variant_correct),
        ]
        assert re.search(rf"│ {row.doc_id} +│ " + r" +│ ".join(map(re.escape, cells)) + " +│", out), out


def _marked(answer: str, correct: bool) -> str:
    return f"{answer} ({'right' if correct else 'wrong'})"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--variant", "mxfp5"],
            "error: --variant: 'mxfp5' is not a variant of the newest sweep (did you mean 'mxfp4'?)",
        ),
        (["--variant", "bf16"], "error: --variant: 'bf16' is the baseline"),
        (["--variant", VARIANT, "--task", "mmlu"], "error: --task: 'mmlu' is not an lm-eval task of the sweep"),
    ],
)
def test_quantlab_flips_refuses_an_unknown_variant_or_task_in_one_line(swept, monkeypatch, capsys, args, message):
    uri, *_ = swept
    code, out, err = _flips(monkeypatch, capsys, uri, *args)
    assert code == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1


def test_a_run_without_per_document_answers_says_so_instead_of_an_empty_table(swept):
    """A run of an older quantlab kept no answers/ artifacts: its tasks get a reason, never a table of no changes."""
    _, store, _, runs = swept
    experiment = store.experiment_id("older")
    older = store.start_run(experiment, "old fp8", {tracking.VARIANT: "fp8"})
    store.log_values(older, params={"eval.mmlu_dev.documents": "8"})
    found = changes_between(store, runs["bf16"], store.run(older))
    notes = {item.task: (item.changed, item.words()) for item in found}
    assert notes["mmlu_dev"] == (None, "no table: this run logged no per-document answers for it")
    # The baseline's other task is still named: nothing is silently dropped.
    assert notes["pydoc_cloze"] == (None, "no table: this run logged no per-document answers for it")
    reverse = {item.task: item.words() for item in changes_between(store, store.run(older), runs["bf16"])}
    assert reverse["mmlu_dev"] == "no table: the baseline run (fp8) logged no per-document answers for it"


def test_publishing_again_replaces_the_tables_rather_than_appending(swept):
    """MLflow's own log_table appends rows to an existing table: a sweep published twice would list them twice."""
    _, store, parent, runs = swept
    run_id = runs[VARIANT].run_id
    before = store.read_artifact(run_id, "changed_answers/mmlu_dev.json")
    log_changed_answers(store, read_sweep(store, parent.run_id))
    assert store.read_artifact(run_id, "changed_answers/mmlu_dev.json") == before
    listed = json.loads(store.run(run_id).tags[tracking.LOGGED_ARTIFACTS])
    assert len(listed) == len({entry["path"] for entry in listed}) == 2


def test_the_changed_answers_section_survives_a_description_cut_to_mlflow_s_limit():
    section = "\n\n## Changed answers (against bf16)\n\n- **fp8**: [mmlu_dev](#/x): 1 of 8 documents changed\n"
    report = "# report\n" + "".join(f"| row {n:04} of a table |\n" for n in range(1000))
    description = tracking.run_description(report, "report.md", section)
    assert len(description) <= 8000 and description.endswith(section)
    assert "all of it is the artifact `report.md`" in description
    assert tracking.run_description("# short", "report.md", section) == "# short" + section
