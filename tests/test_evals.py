"""The bundled offline lm-eval tasks (evals/) and the runner that scores a loaded model on them."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from quantlab import corpora
from quantlab.errors import did_you_mean
from quantlab.evaluate.lm_eval_runner import (
    TaskRequest,
    known_tasks,
    run_tasks,
    task_index_identity,
    task_manager_for,
)
from quantlab.metrics import Scale

REPO = Path(__file__).resolve().parents[1]
BUNDLED_EVALS_DIR = REPO / "evals"  # the repository's offline tasks
DATA_DIR = BUNDLED_EVALS_DIR / "data"
BUNDLED_TASKS = ("mmlu_dev", "pydoc_cloze")


def load_evals_module(file_name: str) -> ModuleType:
    # evals/ is a directory of task files, not a package: load its scripts by path.
    spec = importlib.util.spec_from_file_location(f"evals_{Path(file_name).stem}", BUNDLED_EVALS_DIR / file_name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_build_script() -> ModuleType:
    return load_evals_module("build.py")


def read_items(task: str) -> list[dict]:
    return [json.loads(line) for line in (DATA_DIR / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()]


def test_committed_data_is_what_build_script_makes(tmp_path: Path) -> None:
    build = load_build_script()
    recorded, current = build.recorded_source_versions(), build.source_versions()
    if recorded != current:
        pytest.skip(f"evals/data was built from {recorded}; this is {current}, whose sources may differ")

    build.build(tmp_path)

    for task in BUNDLED_TASKS:
        fresh = (tmp_path / f"{task}.jsonl").read_text(encoding="utf-8")
        assert fresh == (DATA_DIR / f"{task}.jsonl").read_text(encoding="utf-8"), f"{task}: run python evals/build.py"


@pytest.mark.parametrize("task", BUNDLED_TASKS)
def test_items_are_well_formed_four_way_choices(task: str) -> None:
    items = read_items(task)

    assert len(items) >= 250
    for item in items:
        assert len(item["choices"]) == 4 and all(choice.strip() for choice in item["choices"])
        assert item["answer"] in range(4)
    # A seeded shuffle spreads the right answer over all four positions.
    positions = [item["answer"] for item in items]
    assert min(positions.count(p) for p in range(4)) > len(items) / 8


def test_eval_items_contain_no_calibration_text() -> None:
    eval_text = "\n".join(json.dumps(item, ensure_ascii=False) for task in BUNDLED_TASKS for item in read_items(task))
    calibration = corpora.paragraphs("calibration")
    calibration_sentences = {s for p in calibration for s in re.split(r"(?<=[.!?])\s+", p) if len(s.split()) >= 8}

    # Items are JSON-encoded: compare against the same encoding of the calibration text.
    leaked = [s for s in [*calibration, *calibration_sentences] if json.dumps(s, ensure_ascii=False)[1:-1] in eval_text]

    assert calibration_sentences and not leaked


def test_cloze_answers_are_real_eval_split_sentences_among_distinct_choices() -> None:
    eval_text = corpora.text("eval")

    for item in read_items("pydoc_cloze"):
        assert f"{item['context']} {item['choices'][item['answer']]}" in eval_text
        # (MMLU itself has a question with a repeated option; it is kept as shipped.)
        assert len(set(item["choices"])) == 4


def test_known_tasks_include_bundled_and_standard_names() -> None:
    known = known_tasks(BUNDLED_EVALS_DIR)

    assert {"mmlu_dev", "pydoc_cloze", "quantlab_bundled", "hellaswag", "mmlu"} <= known


def test_known_tasks_without_defaults_are_the_task_files_under_include_path() -> None:
    assert known_tasks(BUNDLED_EVALS_DIR, defaults=False) == {
        "mmlu_dev",
        "pydoc_cloze",
        "pydoc_recall",
        "quantlab_bundled",
        "pydoc_passkey",
        "pydoc_passkey_512",
        "pydoc_passkey_2k",
        "pydoc_passkey_8k",
    }
    assert known_tasks(None, defaults=False) == set()
    assert task_index_identity(BUNDLED_EVALS_DIR, False) != task_index_identity(BUNDLED_EVALS_DIR)


@pytest.mark.parametrize(
    ("names", "whole_index"),
    [
        (["mmlu_dev", "pydoc_cloze"], False),  # tasks defined under include_path
        (["mmlu_dev", "hellaswag"], True),  # one of lm-eval's own
        (["quantlab_bundled"], True),  # a tag: tasks elsewhere may carry it too
        ([], False),
    ],
)
def test_a_variant_builds_lm_evals_whole_task_index_only_when_its_tasks_need_it(names, whole_index) -> None:
    manager = task_manager_for(names, BUNDLED_EVALS_DIR)

    assert ("hellaswag" in manager.all_tasks) == whole_index
    assert set(names) <= set(manager.all_tasks)
    assert "hellaswag" in task_manager_for(["mmlu_dev"], None).all_tasks


def test_a_recipe_of_local_tasks_is_checked_without_lm_evals_whole_index(tmp_path) -> None:
    from quantlab.checks import check_recipe
    from quantlab.recipe import load_recipe

    def indexes_looked_up(tasks: list[str]) -> list[bool]:
        recipe = load_recipe(REPO / "recipes" / "smollm2-135m.yaml")
        chosen = [task.model_copy(update={"name": name}) for name, task in zip(tasks, recipe.recipe.evals.tasks)]
        evals = recipe.recipe.evals.model_copy(update={"tasks": chosen})
        # the policy's limits on the tasks left out go too: validate refuses a limit on a task the recipe does not score
        policy = recipe.recipe.frontier.default_policy
        kept = {key: limit for key, limit in policy.max_drop.items() if key.split("/")[1] in tasks}
        frontier = recipe.recipe.frontier.model_copy(
            update={"default_policy": policy.model_copy(update={"max_drop": kept})}
        )
        recipe = replace(recipe, recipe=recipe.recipe.model_copy(update={"evals": evals, "frontier": frontier}))
        checked = check_recipe(recipe, tmp_path)
        return [identity.get("defaults", True) for identity, _ in checked.lookups if "lm_eval" in identity]

    assert indexes_looked_up(["mmlu_dev", "pydoc_cloze"]) == [False]
    assert indexes_looked_up(["mmlu_dev", "hellaswag"]) == [False, True]


def test_a_close_task_name_is_suggested_and_a_far_one_is_not() -> None:
    known = known_tasks(BUNDLED_EVALS_DIR)

    assert did_you_mean("mmlu_dve", known, cutoff=0.75) == " (did you mean 'mmlu_dev'?)"
    assert did_you_mean("no_such_task_at_all", known, cutoff=0.75) == ""


def test_the_task_index_identity_follows_the_task_files(tmp_path) -> None:
    (tmp_path / "mine.yaml").write_text("task: mine\n")
    before = task_index_identity(tmp_path)
    assert task_index_identity(tmp_path) == before
    (tmp_path / "mine.yaml").write_text("task: mine_renamed\n")
    after = task_index_identity(tmp_path)
    assert after != before
    (tmp_path / "notes.md").write_text("not a task file")
    assert task_index_identity(tmp_path) == after


def test_run_tasks_scores_bundled_tasks_from_any_directory(tiny_llama, tmp_path, monkeypatch) -> None:
    model, tokenizer = tiny_llama.load()
    monkeypatch.chdir(tmp_path)  # the data must not be looked up relative to the working directory
    requests = [
        TaskRequest("mmlu_dev", limit=8),
        TaskRequest("pydoc_cloze", limit=8),
        TaskRequest("pydoc_cloze", num_fewshot=2, limit=4),
    ]
    steps: list[str] = []

    scores = run_tasks(model, tokenizer, requests, BUNDLED_EVALS_DIR, batch_size=4, progress=steps.append)

    assert [s.task for s in scores] == ["mmlu_dev", "pydoc_cloze", "pydoc_cloze"]
    # The first two share one lm-eval call; another shot count is another call.
    assert steps == ["lm-eval mmlu_dev, pydoc_cloze, first 8 docs", "lm-eval pydoc_cloze, 2-shot, first 4 docs"]
    assert [s.key for s in scores[0].scores] == ["eval/mmlu_dev/acc"]
    assert [s.key for s in scores[1].scores] == ["eval/pydoc_cloze/acc", "eval/pydoc_cloze/acc_norm"]
    assert [s.settings.num_fewshot for s in scores] == [0, 0, 2]
    for task_scores, request in zip(scores, requests, strict=True):
        acc = task_scores.primary
        assert acc.metric == "acc" and acc.higher_is_better is True and acc.scale is Scale.FRACTION
        assert sorted(acc.documents.values) == list(range(request.limit))
        assert set(acc.documents.values.values()) <= {0.0, 1.0}
        assert acc.value == pytest.approx(sum(acc.documents.values.values()) / request.limit)
        assert acc.stderr is not None and acc.stderr >= 0
        assert set(task_scores.labels) == set(acc.documents.values)
        assert task_scores.settings.documents == request.limit and task_scores.dataset.name == request.name
    # A document's label is the end of its prompt: its own text, after any few-shot examples.
    first_cloze = read_items("pydoc_cloze")[0]["context"]
    assert scores[1].labels[0].endswith(first_cloze[-50:])
    assert scores[2].labels[0].endswith(first_cloze[-50:])


def test_run_tasks_expands_a_tag_and_repeats_itself(tiny_llama) -> None:
    model, tokenizer = tiny_llama.load()
    request = TaskRequest("quantlab_bundled", limit=3)

    first = run_tasks(model, tokenizer, [request], BUNDLED_EVALS_DIR, batch_size=2)
    second = run_tasks(model, tokenizer, [request], BUNDLED_EVALS_DIR, batch_size=3)

    assert sorted(s.task for s in first) == ["mmlu_dev", "pydoc_cloze", "pydoc_recall"]
    assert not any(s.is_group for s in first)  # a tag has no aggregate of its own
    assert [s.primary.documents for s in first] == [s.primary.documents for s in second]
    assert [s.dataset.digest for s in first] == [s.dataset.digest for s in second]


def count_lm_eval_calls(monkeypatch) -> list[list[str]]:
    """The tasks of every simple_evaluate call from now on (lm-eval itself still runs)."""
    import lm_eval.evaluator

    calls: list[list[str]] = []
    real = lm_eval.evaluator.simple_evaluate

    def counting(*args, **kwargs):
        calls.append(list(kwargs["tasks"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(lm_eval.evaluator, "simple_evaluate", counting)
    return calls


@pytest.mark.parametrize(
    ("requests", "calls_together"),
    [
        # the same settings: one call; another limit or shot count: a call of its own
        (
            [
                TaskRequest("mmlu_dev", limit=4),
                TaskRequest("pydoc_cloze", num_fewshot=1, limit=3),
                TaskRequest("pydoc_cloze", limit=4),
            ],
            [["mmlu_dev", "pydoc_cloze"], ["pydoc_cloze"]],
        ),
        # a tag and a task of it: apart (lm-eval would score the task once for both)
        (
            [TaskRequest("quantlab_bundled", limit=3), TaskRequest("mmlu_dev", limit=3)],
            [["quantlab_bundled"], ["mmlu_dev"]],
        ),
    ],
)
def test_requests_that_share_a_call_score_as_they_do_alone(tiny_llama, monkeypatch, requests, calls_together) -> None:
    model, tokenizer = tiny_llama.load()
    calls = count_lm_eval_calls(monkeypatch)

    together = run_tasks(model, tokenizer, requests, BUNDLED_EVALS_DIR, batch_size=2)
    assert calls == calls_together
    alone = [s for request in requests for s in run_tasks(model, tokenizer, [request], BUNDLED_EVALS_DIR, batch_size=2)]

    assert len(calls) == len(calls_together) + len(requests)
    # Exactly: the same per-document values to the last bit, settings, datasets and labels.
    assert together == alone
