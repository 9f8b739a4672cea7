"""lm-eval's real task configs through quantlab: every output shape, per document, paired.

The sweep below runs task YAMLs that `include:` lm-eval's own gsm8k, wikitext, truthfulqa_mc2,
arc_easy and mmlu subject configs (tests/lm_eval_tasks/), pointed at small local data files in
each dataset's real schema. The table tests before it feed hand-made dicts shaped like
`simple_evaluate(..., log_samples=True)`'s results to the pure shape handling.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from lm_eval_tasks.materialize import materialize
from mlflow.tracking import MlflowClient
from test_sweep import quantlab

from quantlab import metrics
from quantlab.evaluate.lm_eval_runner import (
    TaskRequest,
    batches,
    document_scores,
    group_weights,
    read_results,
    restrict,
    task_manager,
    task_names,
)
from quantlab.jobs import SAMPLES_FORMAT, BaselineOutputs
from quantlab.paired import Aggregation, DocumentScores, Group
from quantlab.stages.evaluate import EvalOutcome, answer_damage, eval_outcome
from recipes import tiny_recipe, write

# --------------------------------------------------------------------------------------
# Per-document extraction and re-aggregation (pure)
# --------------------------------------------------------------------------------------


def _doc(doc_id, filter_name="none", **values):
    return {"doc_id": doc_id, "filter": filter_name, "arguments": [[f"question {doc_id}", " answer"]], **values}


@pytest.mark.parametrize(
    ("metric", "samples", "reported", "aggregation", "note"),
    [
        # acc: 0/1 per document, the mean
        ("acc", [_doc(0, acc=1.0), _doc(1, acc=0.0), _doc(2, acc=1.0)], 2 / 3, Aggregation.MEAN, None),
        # truthfulqa_mc2: a probability per document, the mean
        ("acc", [_doc(0, acc=0.25), _doc(1, acc=0.5)], 0.375, Aggregation.MEAN, None),
        # a bool per document is a 0/1 score
        ("exact_match", [_doc(0, exact_match=True), _doc(1, exact_match=False)], 0.5, Aggregation.MEAN, None),
        # wikitext: (loglikelihood, words) under exp(-sum ll / sum words)
        (
            "word_perplexity",
            [_doc(0, word_perplexity=(-20.0, 10)), _doc(1, word_perplexity=(-10.0, 10))],
            math.exp(30 / 20),
            Aggregation.WEIGHTED_PERPLEXITY,
            None,
        ),
        # (loglikelihood, bytes) under -sum ll / (sum bytes * ln 2)
        (
            "bits_per_byte",
            [_doc(0, bits_per_byte=(-20.0, 40)), _doc(1, bits_per_byte=(-10.0, 20))],
            30 / (60 * math.log(2)),
            Aggregation.BITS_PER_BYTE,
            None,
        ),
        # a median (or any other aggregation) does not re-aggregate as a mean: logged without analysis
        ("acc", [_doc(0, acc=0.0), _doc(1, acc=0.0), _doc(2, acc=1.0)], 0.0, None, "re-aggregating"),
        # per-document values of a shape nobody aggregates here (sacrebleu's (ref, pred) pairs)
        ("bleu", [_doc(0, bleu=("ref", "pred"))], 12.5, None, "no known aggregation"),
        ("acc", [], 0.5, None, "no per-document values"),
        ("acc", [_doc(0, acc=1.0), _doc(0, acc=1.0)], 1.0, None, "once each"),
    ],
)
def test_document_scores_accept_only_what_reproduces_lm_eval(metric, samples, reported, aggregation, note):
    documents, why = document_scores(metric, "none", samples, reported)
    if aggregation is None:
        assert documents is None and note in why
    else:
        assert why is None and documents.aggregation is aggregation
        assert documents.aggregate() == pytest.approx(reported, rel=1e-12)
        assert sorted(documents.values) == sorted(s["doc_id"] for s in samples)


def test_each_filter_keeps_its_own_documents():
    samples = [
        _doc(0, "strict-match", exact_match=0.0),
        _doc(1, "strict-match", exact_match=0.0),
        _doc(0, "flexible-extract", exact_match=1.0),
        _doc(1, "flexible-extract", exact_match=0.0),
    ]
    strict, _ = document_scores("exact_match", "strict-match", samples, 0.0)
    flexible, _ = document_scores("exact_match", "flexible-extract", samples, 0.5)
    assert strict.values == {0: 0.0, 1: 0.0} and flexible.values == {0: 1.0, 1: 0.0}


@pytest.mark.parametrize(
    ("values", "sizes", "reported", "weights"),
    [
        ([2 / 3, 0.5], [3, 4], 4 / 7, [3 / 7, 4 / 7]),  # size-weighted (lm-eval's weight_by_size: true)
        ([2 / 3, 0.5], [3, 4], (2 / 3 + 0.5) / 2, [0.5, 0.5]),  # plain mean (weight_by_size: false)
        ([2 / 3, 0.5], [3, 4], 0.9, None),  # neither: no paired analysis for the group
    ],
)
def test_group_weights_are_the_ones_that_reproduce_lm_eval(values, sizes, reported, weights):
    found, note = group_weights(values, sizes, reported)
    if weights is None:
        assert found is None and "neither" in note
    else:
        assert found == pytest.approx(weights) and note is None


def _leaf(name, accs, hib=True):
    samples = [_doc(i, acc=a) for i, a in enumerate(accs)]
    mean = sum(accs) / len(accs)
    return (
        name,
        {"alias": name, "sample_len": len(accs), "acc,none": mean, "acc_stderr,none": 0.1},
        samples,
        {"acc": hib},
    )


def _results(leaves, groups, group_values, group_hib):
    """A dict shaped like simple_evaluate's: nested groups aggregate over all their leaves."""
    return {
        "results": {name: raw for name, raw, _, _ in leaves}
        | {g: {"alias": g, "acc,none": v, "acc_stderr,none": "N/A"} for g, v in group_values.items()},
        "group_subtasks": groups,
        "samples": {name: samples for name, _, samples, _ in leaves},
        "higher_is_better": {name: hib for name, _, _, hib in leaves} | group_hib,
        "n-shot": {name: 0 for name, _, _, _ in leaves},
        "n-samples": {name: {"original": len(samples), "effective": len(samples)} for name, _, samples, _ in leaves},
        "configs": {name: {"output_type": "multiple_choice", "num_fewshot": 0} for name, _, _, _ in leaves},
        "versions": {name: 1.0 for name, _, _, _ in leaves},
    }


NESTED = _results(
    [_leaf("a1", [1.0, 1.0, 0.0]), _leaf("a2", [0.0, 1.0]), _leaf("b1", [1.0, 0.0, 0.0, 0.0, 1.0])],
    {"top": ["mid", "b1"], "mid": ["a1", "a2"]},
    {"top": 5 / 10, "mid": 3 / 5},
    {"top": {"acc": True}, "mid": {"acc": True}},
)


def test_nested_groups_aggregate_over_all_their_leaves():
    tasks = {t.task: t for t in read_results(TaskRequest("top"), NESTED)}

    assert [t.task for t in tasks.values() if t.is_group] == ["top", "mid"]
    top, mid = tasks["top"].primary, tasks["mid"].primary
    assert top.leaves == ("eval/a1/acc", "eval/a2/acc", "eval/b1/acc") and top.weights == pytest.approx([0.3, 0.2, 0.5])
    assert mid.leaves == ("eval/a1/acc", "eval/a2/acc") and mid.weights == pytest.approx([0.6, 0.4])
    assert top.higher_is_better is True and top.scale is metrics.Scale.FRACTION
    assert tasks["a1"].primary.documents.values == {0: 1.0, 1: 1.0, 2: 0.0}


@pytest.mark.parametrize(
    ("top_by_size", "mid_by_size", "weights"),
    [
        (True, True, [0.3, 0.2, 0.5]),  # one pool of documents
        (False, False, [0.25, 0.25, 0.5]),  # a mean of means at each level (lm-eval's longbench): 1/2 x 1/2
        (False, True, [0.3, 0.2, 0.5]),  # the plain mean of mid (3/5) and b1 (2/5), mid's leaves by size
        (True, False, [0.25, 0.25, 0.5]),  # mid (5 documents) and b1 (5) by size, mid a mean of its two leaves
    ],
)
def test_nested_groups_weigh_each_leaf_by_the_product_of_the_weights_down_the_tree(top_by_size, mid_by_size, weights):
    """The group values lm-eval's own aggregation gives (aggregate_subtask_metrics, weight_by_size per group) are
    reproduced by the leaves' per-document scores and the weights quantlab finds, which pair and flip as one score."""
    from lm_eval.api.metrics import aggregate_subtask_metrics

    accs = {"a1": [1.0, 1.0, 0.0], "a2": [0.0, 1.0], "b1": [1.0, 0.0, 0.0, 0.0, 1.0]}
    means = {name: sum(values) / len(values) for name, values in accs.items()}
    mid = aggregate_subtask_metrics([means["a1"], means["a2"]], [3, 2], mid_by_size)
    top = aggregate_subtask_metrics([mid, means["b1"]], [5, 5], top_by_size)
    results = _results(
        [_leaf(name, values) for name, values in accs.items()],
        {"top": ["mid", "b1"], "mid": ["a1", "a2"]},
        {"top": top, "mid": mid},
        {"top": {"acc": True}, "mid": {"acc": True}},
    )
    found = {t.task: t.primary for t in read_results(TaskRequest("top"), results)}
    assert found["top"].leaves == ("eval/a1/acc", "eval/a2/acc", "eval/b1/acc")
    assert found["top"].weights == pytest.approx(weights) and found["top"].note is None
    assert sum(w * means[leaf.split("/")[1]] for w, leaf in zip(weights, found["top"].leaves)) == pytest.approx(top)


def test_a_group_no_weighting_reproduces_is_named_with_why():
    results = _results(
        [_leaf("a1", [1.0, 1.0, 0.0]), _leaf("a2", [0.0, 1.0]), _leaf("b1", [1.0, 0.0, 0.0, 0.0, 1.0])],
        {"top": ["mid", "b1"], "mid": ["a1", "a2"]},
        {"top": 0.9, "mid": 3 / 5},  # no weighting of mid and b1 gives 0.9
        {"top": {"acc": True}, "mid": {"acc": True}},
    )
    top = next(t.primary for t in read_results(TaskRequest("top"), results) if t.task == "top")
    assert top.leaves == () and "neither the size-weighted nor the plain mean" in top.note


def test_one_call_s_results_split_into_what_each_request_would_have_got_alone():
    c1 = _leaf("c1", [1.0, 0.0])
    combined = _results(
        [_leaf("a1", [1.0, 1.0, 0.0]), c1, _leaf("a2", [0.0, 1.0]), _leaf("b1", [1.0, 0.0, 0.0, 0.0, 1.0])],
        {"top": ["mid", "b1"], "mid": ["a1", "a2"]},
        {"top": 5 / 10, "mid": 3 / 5},
        {"top": {"acc": True}, "mid": {"acc": True}},
    )
    structure = combined["group_subtasks"]

    assert task_names("top", {}, structure) == {"top", "mid", "a1", "a2", "b1"}
    for name, alone in [("top", NESTED), ("c1", _results([c1], {}, {}, {}))]:
        mine = restrict(combined, task_names(name, {}, structure))
        assert read_results(TaskRequest(name), mine) == read_results(TaskRequest(name), alone)


R = TaskRequest
CHAT = {"apply_chat_template": True}


@pytest.mark.parametrize(
    ("requests", "names", "expected"),
    [
        ([R("a", limit=4), R("b", limit=4)], [{"a"}, {"b"}], [[0, 1]]),
        ([R("a", limit=4), R("b", limit=8)], [{"a"}, {"b"}], [[0], [1]]),
        ([R("a"), R("b", num_fewshot=0)], [{"a"}, {"b"}], [[0], [1]]),  # None keeps a YAML's shots: not 0
        ([R("a", num_fewshot=2), R("b", num_fewshot=2)], [{"a"}, {"b"}], [[0, 1]]),
        ([R("a", gen_kwargs={}), R("b")], [{"a"}, {"b"}], [[0, 1]]),  # no generation settings either way
        ([R("a", gen_kwargs={"max_gen_toks": 8}), R("b")], [{"a"}, {"b"}], [[0], [1]]),
        ([R("a", **CHAT), R("b", **CHAT, fewshot_as_multiturn=True)], [{"a"}, {"b"}], [[0, 1]]),  # resolved the same
        ([R("a", **CHAT), R("b", **CHAT, fewshot_as_multiturn=False)], [{"a"}, {"b"}], [[0], [1]]),
        ([R("a", **CHAT), R("b")], [{"a"}, {"b"}], [[0], [1]]),
        ([R("a", system_instruction="Be brief."), R("b")], [{"a"}, {"b"}], [[0], [1]]),
        # a tag (or group) and a task below it: apart, and a later request joins the first batch that fits
        ([R("tag"), R("a"), R("b")], [{"tag", "a", "c"}, {"a"}, {"b"}], [[0, 2], [1]]),
        ([R("a", limit=2), R("b"), R("c", limit=2)], [{"a"}, {"b"}, {"c"}], [[0, 2], [1]]),
        ([], [], []),
    ],
)
def test_requests_share_a_call_when_every_setting_matches_and_no_task_is_shared(requests, names, expected):
    assert batches(requests, names) == expected


def test_a_requested_name_covers_every_group_and_task_below_it(tmp_path):
    index = task_manager(materialize(tmp_path / "tasks")).task_index

    assert task_names("ql_mmlu", index) == {"ql_mmlu", "ql_mmlu_anatomy", "ql_mmlu_astronomy"}
    # A tag: its tasks as lm-eval's index has them (this include path's ai2_arc replaces lm-eval's own).
    assert task_names("ai2_arc", index) == {"ai2_arc", "ql_arc_easy"}
    assert task_names("ql_arc_easy", index) == {"ql_arc_easy"}
    mmlu = task_names("mmlu", index)  # groups of tags of tasks
    assert len(mmlu) == 1 + 4 + 4 + 57 and {"mmlu_stem", "mmlu_stem_tasks", "mmlu_anatomy"} <= mmlu
    assert task_names("no_such_task", index) == {"no_such_task"}


def test_a_group_s_flips_are_the_sum_of_its_leaves():
    baseline = eval_outcome(read_results(TaskRequest("top"), NESTED))
    flipped = json.loads(json.dumps(NESTED))  # a1 doc 0 and b1 doc 0 go wrong, a2 doc 0 goes right
    for leaf, doc, value in (("a1", 0, 0.0), ("b1", 0, 0.0), ("a2", 0, 1.0)):
        flipped["samples"][leaf][doc]["acc"] = value
    for leaf in ("a1", "a2", "b1"):
        accs = [s["acc"] for s in flipped["samples"][leaf]]
        flipped["results"][leaf]["acc,none"] = sum(accs) / len(accs)
    flipped["results"]["top"]["acc,none"] = 4 / 10
    flipped["results"]["mid"]["acc,none"] = 3 / 5
    variant = eval_outcome(read_results(TaskRequest("top"), flipped))
    stored = BaselineOutputs.from_samples(
        json.loads(
            json.dumps(
                BaselineOutputs(
                    None, baseline.documents, baseline.groups, baseline.scores, baseline.primary
                ).to_samples()
            )
        ),
        None,
    )

    damage = answer_damage(variant, stored).metrics

    for task, (c2w, w2c) in {"a1": (1, 0), "a2": (0, 1), "b1": (1, 0), "mid": (1, 1), "top": (2, 1)}.items():
        assert (
            damage[f"quality/flips/{task}/correct_to_wrong"] == c2w
            and damage[f"quality/flips/{task}/wrong_to_correct"] == w2c
        )
        assert damage[f"quality/flips/{task}"] == c2w + w2c
    assert damage["quality/paired/eval/top/acc/diff"] == pytest.approx(-0.1)  # 4/10 - 5/10, from the leaves
    assert damage["quality/paired/eval/top/acc/correct_to_wrong"] == 2
    assert damage["quality/mcnemar_p/top"] == pytest.approx(1.0)  # 2 vs 1 discordant: binomial p = 1
    assert damage["quality/recovery/top/acc"] == pytest.approx(0.8)
    # The baseline against itself: its own zeros.
    own = answer_damage(baseline, None).metrics
    assert (
        own["quality/flips/top"] == 0
        and own["quality/paired/eval/top/acc/diff"] == 0
        and own["quality/mcnemar_p/top"] == 1
    )


def test_a_group_averaged_without_size_weights_logs_no_pooled_flips():
    """Issue 28: a plain mean of a 2-document and a 6-document leaf is not one pool of 8 documents. The small leaf
    loses both its documents (-100 pts), the large one gains 3 of 6 (+50 pts): the group loses 25 points, where
    pooled flips (2 lost, 3 gained) and their McNemar p would read as a gain."""
    base = {"eval/s/acc": [1.0, 1.0], "eval/l/acc": [0.0] * 6}
    moved = {"eval/s/acc": [0.0, 0.0], "eval/l/acc": [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]}

    def outcome(values):
        documents = {key: DocumentScores(Aggregation.MEAN, dict(enumerate(v))) for key, v in values.items()}
        scores = {key: d.aggregate() for key, d in documents.items()}
        scores["eval/g/acc"] = (scores["eval/s/acc"] + scores["eval/l/acc"]) / 2
        groups = {"eval/g/acc": Group(("eval/s/acc", "eval/l/acc"), (0.5, 0.5))}
        primary = {"s": "eval/s/acc", "l": "eval/l/acc", "g": "eval/g/acc"}
        return EvalOutcome(scores=scores, documents=documents, groups=groups, primary=primary)

    baseline = outcome(base)
    stored = BaselineOutputs(None, baseline.documents, baseline.groups, baseline.scores, baseline.primary)
    damage = answer_damage(outcome(moved), stored).metrics

    assert damage["quality/paired/eval/g/acc/diff"] == pytest.approx(-0.25)
    assert "quality/paired/eval/g/acc/correct_to_wrong" not in damage and "quality/flips/g" not in damage
    assert "quality/mcnemar_p/g" not in damage
    assert damage["quality/flips/s/correct_to_wrong"] == 2 and damage["quality/flips/l/wrong_to_correct"] == 3


def test_undeclared_directions_and_unanalysable_shapes_are_named_not_dropped(capsys):
    results = _results([_leaf("x", [1.0, 0.0], hib=None)], {}, {}, {})
    results["results"]["x"]["f1,none"] = 0.7  # a corpus-level score: no per-document shape reproduces it
    results["samples"]["x"][0]["f1"] = ("a", "b")
    results["samples"]["x"][1]["f1"] = ("c", "d")

    outcome = eval_outcome(read_results(TaskRequest("x"), results))

    assert outcome.metrics["eval/x/f1"] == 0.7 and "eval/x/f1" not in outcome.documents
    assert outcome.tags["quantlab.direction_unknown"] == "eval/x/acc, eval/x/f1"
    assert "no known aggregation" in outcome.tags["quantlab.eval_note/eval/x/f1"]
    assert outcome.tags["quantlab.metric/eval/x/acc"] == "unknown fraction"
    printed = capsys.readouterr().err
    assert "direction unknown" in printed and "eval/x/f1" in printed


# --------------------------------------------------------------------------------------
# Recipe settings per task
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "field", "message"),
    [
        (
            {"name": "mmlu_dev", "num_fewshot": -1},
            "evals.tasks[0] (mmlu_dev).num_fewshot",
            "greater than or equal to 0",
        ),
        ({"name": "mmlu_dev", "limit": 0}, "evals.tasks[0] (mmlu_dev).limit", "greater than 0"),
        (
            {"name": "mmlu_dev", "gen_kwargs": {"max_gen_toks": 0}},
            "evals.tasks[0] (mmlu_dev).gen_kwargs.max_gen_toks",
            "greater than 0",
        ),
        (
            {"name": "mmlu_dev", "gen_kwargs": "max_gen_toks=8"},
            "evals.tasks[0] (mmlu_dev).gen_kwargs",
            "valid dictionary",
        ),
        (
            {"name": "mmlu_dev", "fewshot_as_multiturn": True},
            "evals.tasks[0] (mmlu_dev).fewshot_as_multiturn",
            "needs apply_chat_template",
        ),
        ({"name": "mmlu_dev", "shots": 5}, "evals.tasks[0] (mmlu_dev).shots", "unknown key"),
    ],
)
def test_bad_task_settings_are_one_line_errors_naming_the_field(tmp_path, tiny_llama, task, field, message):
    from quantlab.checks import validate
    from quantlab.errors import BadInput

    path = write(
        tmp_path / "recipe.yaml",
        tiny_recipe(tiny_llama.path, evals={"include_path": str(Path(__file__).parents[1] / "evals"), "tasks": [task]}),
    )
    with pytest.raises(BadInput) as caught:
        validate(path)
    problems = [str(p) for p in caught.value.problems]
    assert any(p.startswith(f"{path}: {field}: ") and message in p for p in problems), problems


def test_a_task_listed_twice_is_bad_input_at_the_command_line(tmp_path, tiny_llama):
    tasks = [{"name": "mmlu_dev", "limit": 2}, {"name": "mmlu_dev", "num_fewshot": 1}]
    path = write(
        tmp_path / "recipe.yaml",
        tiny_recipe(tiny_llama.path, evals={"include_path": str(Path(__file__).parents[1] / "evals"), "tasks": tasks}),
    )
    result = quantlab("validate", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"error: {path}: evals.tasks[1] (mmlu_dev).name: task listed twice (also evals.tasks[0])"
    )


# --------------------------------------------------------------------------------------
# The baseline's reference pass is keyed by what changes its numbers
# --------------------------------------------------------------------------------------


def test_another_compute_dtype_gets_another_reference(tmp_path, tiny_llama):
    import torch

    from quantlab.jobs import VariantJob
    from quantlab.recipe import load_recipe
    from quantlab.stages.evaluate import token_damage

    loaded = load_recipe(write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path)))
    job = VariantJob(loaded, "bf16", tmp_path / "cache", baseline=None)
    dirs = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        model, tokenizer = tiny_llama.load(dtype)
        dirs.setdefault(dtype, set()).add(
            token_damage(model, tokenizer, loaded.recipe.quality, tmp_path, job, "same-checkpoint").reference_dir
        )
    assert len(dirs[torch.float32]) == 1  # the same settings find the same reference again
    assert dirs[torch.float32].isdisjoint(dirs[torch.bfloat16])


# --------------------------------------------------------------------------------------
# A sweep over the real task configs
# --------------------------------------------------------------------------------------

BATCH_SIZE = 4
TASKS = [
    {"name": "ql_gsm8k", "limit": 2, "gen_kwargs": {"max_gen_toks": 8}},  # its YAML's 5 shots: no num_fewshot here
    {"name": "ql_wikitext", "limit": 3},
    {"name": "ql_truthfulqa_mc2", "limit": 3},
    {"name": "ql_arc_easy", "limit": 4},
    {"name": "ql_mmlu", "limit": 4},  # 3 anatomy + 4 astronomy questions: size weights differ from a plain mean
]


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_llama):
    work = tmp_path_factory.mktemp("lm-eval-sweep")
    tasks_dir = materialize(work / "tasks")
    recipe = tiny_recipe(
        tiny_llama.path,
        variants=[{"name": "bf16", "method": "bf16"}, {"name": "fp8", "method": "fp8"}],
        evals={"include_path": str(tasks_dir), "batch_size": BATCH_SIZE, "tasks": TASKS},
    )
    path = write(work / "recipe.yaml", recipe)
    uri = f"sqlite:///{work / 'store.db'}"
    result = quantlab("sweep", str(path), "--tracking-uri", uri, "--cache-dir", str(work / "cache"), cwd=work)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id], "tags.`quantlab.role` = 'variant'") if experiment else []
    return work, tasks_dir, uri, result, {run.data.tags["quantlab.variant"]: run for run in runs}


def test_the_sweep_finishes_every_variant(swept):
    _, _, _, result, runs = swept
    assert result.returncode == 0, result.stdout + result.stderr
    assert {name: run.info.status for name, run in runs.items()} == {"bf16": "FINISHED", "fp8": "FINISHED"}


def test_every_logged_metric_has_its_direction(swept):
    *_, runs = swept
    for run in runs.values():
        declared = metrics.declared_from_tags(run.data.tags)
        missing = [key for key in run.data.metrics if not metrics.has_entry(key, declared)]
        assert not missing, missing
        assert "quantlab.direction_unknown" not in run.data.tags
        scores = {key for key in run.data.metrics if metrics.is_eval_score(key)}
        assert {
            "eval/ql_gsm8k/exact_match:strict-match",
            "eval/ql_gsm8k/exact_match:flexible-extract",
            "eval/ql_wikitext/word_perplexity",
            "eval/ql_wikitext/byte_perplexity",
            "eval/ql_wikitext/bits_per_byte",
            "eval/ql_truthfulqa_mc2/acc",
            "eval/ql_arc_easy/acc",
            "eval/ql_arc_easy/acc_norm",
            "eval/ql_mmlu/acc",
            "eval/ql_mmlu_anatomy/acc",
            "eval/ql_mmlu_astronomy/acc",
        } == scores
        assert declared["eval/ql_wikitext/word_perplexity"] == metrics.Declared(False, metrics.Scale.PERPLEXITY)
        assert declared["eval/ql_wikitext/bits_per_byte"] == metrics.Declared(False, metrics.Scale.BITS)
        assert declared["eval/ql_truthfulqa_mc2/acc"] == metrics.Declared(True, metrics.Scale.FRACTION)


def test_each_task_ran_with_its_own_settings_and_logged_them(swept):
    *_, runs = swept
    params = runs["fp8"].data.params
    assert params["eval.ql_gsm8k.num_fewshot"] == "5"  # gsm8k.yaml's num_fewshot, not a recipe default of 0
    assert params["eval.ql_gsm8k.limit"] == "2" and params["eval.ql_gsm8k.documents"] == "2"
    generation = json.loads(params["eval.ql_gsm8k.gen_kwargs"])
    assert generation["max_gen_toks"] == 8 and "Question:" in generation["until"]  # merged over the YAML's
    assert params["eval.ql_wikitext.gen_kwargs"] == "not used"
    assert params["eval.ql_mmlu_anatomy.documents"] == "3" and params["eval.ql_mmlu_astronomy.documents"] == "4"
    assert params["eval.ql_arc_easy.apply_chat_template"] == "False"


def test_paired_statistics_for_every_analysable_score(swept):
    *_, runs = swept
    logged = runs["fp8"].data.metrics
    for key in [k for k in logged if metrics.is_eval_score(k)]:
        for statistic in ("diff", "se", "ci95_low", "ci95_high", "n"):
            assert metrics.paired_key(key, statistic) in logged, (key, statistic)
        assert f"quality/recovery/{key.removeprefix('eval/')}" in logged
    # 0/1 scores: flips both ways; rolling loglikelihood: per document pairs
    assert logged["quality/paired/eval/ql_gsm8k/exact_match:strict-match/n"] == 2
    assert logged["quality/paired/eval/ql_wikitext/word_perplexity/n"] == 3
    assert "quality/paired/eval/ql_wikitext/word_perplexity/correct_to_wrong" not in logged
    assert "quality/flips/ql_wikitext" not in logged and "quality/flips/ql_truthfulqa_mc2" not in logged


def test_group_flips_add_up_to_the_leaves(swept):
    *_, runs = swept
    logged = runs["fp8"].data.metrics
    for suffix in ("", "/correct_to_wrong", "/wrong_to_correct"):
        leaves = logged[f"quality/flips/ql_mmlu_anatomy{suffix}"] + logged[f"quality/flips/ql_mmlu_astronomy{suffix}"]
        assert logged[f"quality/flips/ql_mmlu{suffix}"] == leaves
    assert logged["quality/paired/eval/ql_mmlu/acc/n"] == 7
    # The group's paired difference is lm-eval's group score difference (size-weighted leaves).
    group_diff = logged["eval/ql_mmlu/acc"] - runs["bf16"].data.metrics["eval/ql_mmlu/acc"]
    assert logged["quality/paired/eval/ql_mmlu/acc/diff"] == pytest.approx(group_diff, abs=1e-12)


def test_samples_artifact_keeps_every_analysable_score_per_document(swept):
    _, _, uri, _, runs = swept
    client = MlflowClient(uri)
    data = json.loads(Path(client.download_artifacts(runs["fp8"].info.run_id, "samples.json")).read_text())
    restored = BaselineOutputs.from_samples(data, None)
    assert data["version"] == SAMPLES_FORMAT == 5  # samples.json and answers/<task>.jsonl: the per-document records
    assert restored.documents["eval/ql_wikitext/bits_per_byte"].aggregation is Aggregation.BITS_PER_BYTE
    assert restored.groups["eval/ql_mmlu/acc"].weights == pytest.approx((3 / 7, 4 / 7))
    for key, documents in restored.documents.items():
        assert documents.aggregate() == pytest.approx(runs["fp8"].data.metrics[key], rel=1e-9)


def test_each_variant_records_its_tasks_as_evaluation_datasets(swept):
    _, _, uri, _, runs = swept
    client = MlflowClient(uri)
    (table_run,) = client.search_runs(
        [runs["fp8"].info.experiment_id], f"attributes.run_id = '{runs['fp8'].info.run_id}'"
    )
    inputs = {item.dataset.name: item for item in table_run.inputs.dataset_inputs}
    assert set(inputs) == {
        "ql_gsm8k",
        "ql_wikitext",
        "ql_truthfulqa_mc2",
        "ql_arc_easy",
        "ql_mmlu_anatomy",
        "ql_mmlu_astronomy",
    }
    assert all(
        {(t.key, t.value) for t in item.tags} == {("mlflow.data.context", "evaluation")} for item in inputs.values()
    )
    baseline_inputs = {item.dataset.name: item.dataset.digest for item in runs["bf16"].inputs.dataset_inputs}
    assert baseline_inputs == {name: item.dataset.digest for name, item in inputs.items()}  # same data, same digest
    assert json.loads(inputs["ql_gsm8k"].dataset.profile)["limit"] == 2


def test_a_copied_run_keeps_its_datasets(swept):
    work, _, uri, _, first = swept
    result = quantlab(
        "sweep", str(work / "recipe.yaml"), "--tracking-uri", uri, "--cache-dir", str(work / "cache"), cwd=work
    )
    assert result.returncode == 0, result.stdout + result.stderr
    client = MlflowClient(uri)
    copies = client.search_runs(
        [first["fp8"].info.experiment_id], f"tags.`quantlab.reused_from` = '{first['fp8'].info.run_id}'"
    )
    assert copies
    assert {(i.dataset.name, i.dataset.digest) for i in copies[0].inputs.dataset_inputs} == {
        (i.dataset.name, i.dataset.digest) for i in first["fp8"].inputs.dataset_inputs
    }


def test_a_logged_score_equals_the_lm_eval_cli(swept, tmp_path):
    """The same checkpoint, compute dtype, task, limit and batch size through lm-eval's own command line:

    lm_eval --model hf --model_args pretrained=<bf16 checkpoint>,dtype=<the run's> --tasks ql_wikitext
        --include_path <tasks dir> --limit 3 --batch_size 4 --output_path <tmp>
    """
    _, tasks_dir, _, _, runs = swept
    checkpoint = runs["bf16"].data.tags["quantlab.checkpoint"]
    dtype = runs["bf16"].data.params["runtime.compute_dtype"]  # this CPU's: float32, or BF16 where it has BF16 matmuls
    command = [
        str(Path(sys.executable).with_name("lm_eval")),
        "--model",
        "hf",
        "--model_args",
        f"pretrained={checkpoint},dtype={dtype}",
        "--tasks",
        "ql_wikitext",
        "--include_path",
        str(tasks_dir),
        "--limit",
        "3",
        "--batch_size",
        str(BATCH_SIZE),
        "--output_path",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    cli = json.loads(results_file.read_text())["results"]["ql_wikitext"]
    logged = runs["bf16"].data.metrics
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert logged[f"eval/ql_wikitext/{metric}"] == pytest.approx(cli[f"{metric},none"], rel=1e-9), metric
