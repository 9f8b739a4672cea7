"""Sampled tasks scored in repeats (evals.tasks[].repeats): per-item means, items as clusters, and what would settle
an undecided check, more items or more repeats."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from quantlab.decision import settling_words
from quantlab.paired import (
    Aggregation,
    DocumentScores,
    NotPaired,
    RepeatVariance,
    compare,
    documents_from_json,
    documents_to_json,
    repeat_variance,
    settling,
)
from recipes import tiny_recipe, write

# Four items, two repeats each (0/1 scores): per-repeat differences (-1, 0), (0, -1), (0, 1), (0, 1).
BASELINE = [{0: 1, 1: 1, 2: 0, 3: 1}, {0: 0, 1: 1, 2: 0, 3: 0}]
VARIANT = [{0: 0, 1: 1, 2: 0, 3: 1}, {0: 0, 1: 0, 2: 1, 3: 1}]


def test_a_document_s_value_is_its_mean_over_the_repeats():
    scores = DocumentScores.of_repeats(BASELINE)
    assert scores.aggregation is Aggregation.MEAN
    assert scores.values == {0: 0.5, 1: 1.0, 2: 0.0, 3: 0.5}
    assert scores.repeats == {0: (1.0, 0.0), 1: (1.0, 1.0), 2: (0.0, 0.0), 3: (1.0, 0.0)}
    assert scores.repeat_count == 2
    assert scores.aggregate() == pytest.approx(0.5)  # the mean over items x repeats
    assert documents_from_json(documents_to_json({"k": scores})) == {"k": scores}


def test_repeats_that_scored_different_documents_are_refused():
    with pytest.raises(ValueError, match="same documents"):
        DocumentScores.of_repeats([{0: 1.0, 1: 0.0}, {0: 1.0, 2: 0.0}])


def test_se_by_hand_items_as_clusters():
    """By hand: item mean differences -0.5, -0.5, 0.5, 0.5, diff 0; their sample variance 1/3, se sqrt(1/3 / 4).
    The same from the 8 repeat-level differences with the 4 items as clusters (CR1): cluster sums -1, -1, 1, 1,
    sqrt(4/3 * 4) / 8. Within: each item's two differences are 1 apart, variance 1/2; between: 1/3 - (1/2) / 2."""
    found = compare("t", DocumentScores.of_repeats(BASELINE), DocumentScores.of_repeats(VARIANT))
    assert found.diff == 0.0
    assert found.se == pytest.approx(math.sqrt(1 / 12)) == pytest.approx(math.sqrt(4 / 3 * 4) / 8)
    assert (found.n, found.repeats, found.df, found.test) == (4, 2, 3.0, "repeats_t")
    assert found.variance == RepeatVariance(4, 2, pytest.approx(1 / 12), pytest.approx(0.5))
    half = stats.t.ppf(0.975, 3) * found.se
    assert (found.ci95_low, found.ci95_high) == (pytest.approx(-half), pytest.approx(half))


def _cr1(d: np.ndarray) -> float:
    """The cluster-robust (CR1) se of the mean of an items x repeats array, the items as clusters, written out."""
    g, k = d.shape
    sums = (d - d.mean()).sum(axis=1)
    return math.sqrt(g / (g - 1) * float((sums**2).sum())) / (g * k)


@pytest.mark.parametrize(
    ("items", "repeats", "between", "within"), [(5, 2, 0.0, 1.0), (30, 3, 0.5, 0.2), (12, 8, 1, 1)]
)
def test_the_clustered_se_is_the_se_of_the_item_means_and_holds_the_within_item_variance(
    items, repeats, between, within
):
    rng = np.random.default_rng(items * repeats)
    effect = rng.normal(0, math.sqrt(between), size=(items, 1))
    base = rng.normal(size=(items, repeats))
    variant = base + effect + rng.normal(0, math.sqrt(within), size=(items, repeats))
    runs = [[{i: float(x[i, r]) for i in range(items)} for r in range(repeats)] for x in (base, variant)]
    found = compare("t", DocumentScores.of_repeats(runs[0]), DocumentScores.of_repeats(runs[1]))
    d = variant - base
    assert found.se == pytest.approx(_cr1(d))
    assert found.se == pytest.approx(stats.sem(d.mean(axis=1)))
    assert found.p_value == pytest.approx(stats.ttest_1samp(d.mean(axis=1), 0).pvalue)
    parts = repeat_variance(DocumentScores.of_repeats(runs[0]), DocumentScores.of_repeats(runs[1]))
    # The item means' variance is between + within / k (moments, by construction, up to the floor at 0).
    spread = float(d.mean(axis=1).var(ddof=1))
    assert parts.item_variance(repeats) == pytest.approx(max(spread, parts.within / repeats))
    assert parts.within == pytest.approx(float(d.var(axis=1, ddof=1).mean()))


def test_baseline_and_variant_of_other_repeats_are_not_paired():
    once = DocumentScores(Aggregation.MEAN, {0: 0.5, 1: 1.0, 2: 0.0, 3: 0.5})
    with pytest.raises(NotPaired, match="different repeats"):
        compare("t", DocumentScores.of_repeats(BASELINE), once)
    three = DocumentScores.of_repeats([*BASELINE, BASELINE[0]])
    with pytest.raises(NotPaired, match="2 and 3 per document"):
        compare("t", DocumentScores.of_repeats(BASELINE), three)


# z_0.975 + z_0.8 = 2.80158; at a drop of 0 and a limit of 0.1 the mean difference's variance must reach
# (0.1 / 2.80158)^2 = 0.00127407.
@pytest.mark.parametrize(
    ("variance", "available", "items", "repeats", "by"),
    [
        # Nothing between items: 0.5 / 0.00127407 = 392.4 -> 393 items (706 more scorings), or 1 / (40 * 0.00127407)
        # = 19.6 -> 20 repeats (720 more): items, which cut both parts of the variance.
        (RepeatVariance(40, 2, 0.0, 1.0), None, 393, 20, "items"),
        # The task has 100 items: repeats are the way left.
        (RepeatVariance(40, 2, 0.0, 1.0), 100, None, 20, "repeats"),
        # 0.1 between items is more than 40 items can bring to 0.05096 however often each is repeated.
        (RepeatVariance(40, 2, 0.1, 1.0), 100, None, None, None),
        # Repeats that never differ within a document: more of them change nothing.
        (RepeatVariance(40, 2, 0.0, 0.0), 40, None, None, None),
        # One repeat shows no within-item variance: only items.
        (RepeatVariance(40, 1, 0.2, math.nan), None, 157, None, "items"),
    ],
)
def test_more_items_or_more_repeats(variance, available, items, repeats, by):
    found = settling(variance, 0.0, 0.1, alpha=0.025, power=0.8, available=available)
    assert (found.items, found.repeats, found.by) == (items, repeats, by)


@pytest.mark.parametrize(
    ("variance", "available", "words"),
    [
        (
            RepeatVariance(40, 2, 0.0, 1.0),
            100,
            "about 18 more repeats would settle it (40 documents x 20 repeats, 80% power)",
        ),
        (RepeatVariance(40, 2, 0.0, 1.0), None, "about 393 documents would settle it (x 2 repeats, 80% power)"),
        (
            RepeatVariance(40, 2, 0.1, 1.0),
            100,
            "neither more repeats nor the documents the task has would settle it at 80% power: a wider limit would",
        ),
    ],
)
def test_advice_words(variance, available, words):
    assert settling_words(settling(variance, 0.0, 0.1, alpha=0.025, power=0.8, available=available), 0.8) == words


def test_one_more_repeat_is_singular():
    # 0.5 / (40 v) with v at a drop of 0 and a limit of 0.2: 0.5 / 0.2038 = 2.45 -> 3 repeats, one more than 2.
    found = settling(RepeatVariance(40, 2, 0.0, 0.5), 0.0, 0.2, alpha=0.025, power=0.8, available=40)
    assert settling_words(found, 0.8).startswith("about 1 more repeat would settle it (40 documents x 3 repeats")


# --- A real sampled task, run in repeats: lm-eval, the tiny random Llama ---


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    from lm_eval_tasks.materialize import materialize

    return materialize(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def sampled(tasks_dir, tiny_llama):
    """ql_sampled_e in 2 repeats: the baseline, the baseline again, and a variant (its weights perturbed)."""
    import torch

    from quantlab.evaluate.lm_eval_runner import TaskRequest, run_tasks

    request = TaskRequest("ql_sampled_e", repeats=2, seed=7)
    model, tokenizer = tiny_llama.load()

    def scored():
        (task,) = run_tasks(model, tokenizer, [request], tasks_dir, batch_size=4)
        return task

    baseline, again = scored(), scored()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return baseline, again, scored()


def test_baseline_and_variant_sample_with_the_same_seeds_one_per_repeat(sampled):
    from quantlab.evaluate.lm_eval_runner import SEEDS, repeat_seeds

    baseline, _, variant = sampled
    seeds = tuple(repeat_seeds(7, "ql_sampled_e", r)["torch_random_seed"] for r in range(2))
    assert baseline.settings.seeds == variant.settings.seeds == seeds
    assert len(set(seeds)) == 2 and SEEDS["torch_random_seed"] not in seeds
    assert baseline.settings.repeats == 2
    params = baseline.settings.params("ql_sampled_e")
    assert params["eval.ql_sampled_e.seeds"] == ",".join(map(str, seeds))
    assert params["eval.ql_sampled_e.repeats"] == "2"
    assert params == variant.settings.params("ql_sampled_e")
    assert repeat_seeds(8, "ql_sampled_e", 0) != repeat_seeds(7, "ql_sampled_e", 0)


def test_the_seeds_decide_the_samples(sampled):
    baseline, again, variant = sampled
    assert again.primary.documents.repeats == baseline.primary.documents.repeats
    # Sampled, not greedy: a one-token coin toss per sample comes out both ways over 16 samples.
    draws = [
        score for task in (baseline, variant) for runs in task.primary.documents.repeats.values() for score in runs
    ]
    assert sorted(set(draws)) == [0.0, 1.0]


def test_scores_are_per_item_means_over_the_repeats(sampled):
    baseline, _, variant = sampled
    for task in (baseline, variant):
        score = task.primary
        documents = score.documents
        assert (len(documents.values), documents.repeat_count) == (4, 2)
        for doc, runs in documents.repeats.items():
            assert set(runs) <= {0.0, 1.0}
            assert documents.values[doc] == pytest.approx(sum(runs) / 2)
        means = list(documents.values.values())
        assert score.value == pytest.approx(np.mean(means))
        assert score.stderr == pytest.approx(stats.sem(means))
    found = compare(baseline.primary.key, baseline.primary.documents, variant.primary.documents)
    assert (found.n, found.repeats) == (4, 2)
    assert found.diff == pytest.approx(variant.primary.value - baseline.primary.value)
    back = documents_from_json(documents_to_json({"k": variant.primary.documents}))["k"]
    assert back.repeats == variant.primary.documents.repeats


def test_every_repeat_s_answers_are_kept_and_paired_with_the_baseline_s_same_repeat(sampled):
    """The changed answers of a sampled task are its repeats' (not the first one's): repeat k of the variant against
    repeat k of the baseline, sampled with the same seed, as its per-document scores are."""
    from quantlab.evaluate.flips import changed_answers

    baseline, _, variant = sampled
    for task in (baseline, variant):
        runs = task.primary.documents.repeats
        assert sorted(task.answers) == [(doc, repeat) for doc in sorted(runs) for repeat in (1, 2)]
        for (doc, repeat), answer in task.answers.items():
            assert (answer.doc_id, answer.repeat, answer.correct) == (doc, repeat, bool(runs[doc][repeat - 1]))
    found = changed_answers("ql_sampled_e", baseline.answers, variant.answers)
    base, mine = baseline.primary.documents.repeats, variant.primary.documents.repeats
    expected = sorted(
        (doc, repeat) for doc in base for repeat in (1, 2) if base[doc][repeat - 1] != mine[doc][repeat - 1]
    )
    assert sorted((row.doc_id, row.repeat) for row in found.rows) == expected
    assert (found.paired, found.repeats) == (8, 2)
    assert f"{len(expected)} of 8 answers (2 repeats of each document) changed" in found.words()


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({"name": "ql_arc_easy", "repeats": 2}, "ql_arc_easy is scored by multiple_choice, the same numbers"),
        ({"name": "ql_gsm8k", "repeats": 2}, "ql_gsm8k decodes greedily (do_sample False, temperature 0.0"),
        (
            {"name": "ql_sampled_e", "repeats": 2, "gen_kwargs": {"temperature": 0}},
            "2 repeats of greedy decoding give one answer 2 times",
        ),
        ({"name": "ql_sampled_e", "repeats": 0}, "greater than or equal to 1"),
    ],
)
def test_repeats_without_sampling_are_one_line_errors_naming_the_field(tmp_path, tasks_dir, tiny_llama, task, message):
    from quantlab.checks import validate
    from quantlab.errors import BadInput

    path = write(
        tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path, evals={"include_path": str(tasks_dir), "tasks": [task]})
    )
    with pytest.raises(BadInput) as caught:
        validate(path)
    problems = [str(p) for p in caught.value.problems]
    field = f"evals.tasks[0] ({task['name']}).repeats"
    assert any(p.startswith(f"{path}: {field}: ") and message in p for p in problems), problems


def test_a_sampled_task_in_repeats_is_valid(tmp_path, tasks_dir, tiny_llama):
    from quantlab.checks import validate

    tasks = [
        {"name": "ql_sampled_e", "repeats": 3},
        {"name": "ql_gsm8k", "repeats": 2, "gen_kwargs": {"do_sample": True, "temperature": 0.7}},
    ]
    validate(
        write(
            tmp_path / "recipe.yaml",
            tiny_recipe(tiny_llama.path, evals={"include_path": str(tasks_dir), "tasks": tasks}),
        )
    )


# --- pick on logged figures of a sampled task ---

TASK_ACC = "eval/ql_sampled_e/exact_match"


def _decision(documents: dict[str, int] | None):
    """bf16 and int4 on a 0/1 sampled task of 40 documents x 2 repeats: no drop, within-item sd 0.7 (W = 0.49) and an
    se of sqrt(W / 2 / 40) (nothing between documents), against a 10-point limit: undecided."""
    from quantlab.decision import pick
    from quantlab.frontier import Axis, VariantSummary
    from quantlab.metrics import Declared, Scale, paired_key
    from quantlab.policy import Policy

    declared = {TASK_ACC: Declared(True, Scale.FRACTION)}
    base = {TASK_ACC: 0.5, "cost/weight_bytes": 2.0}
    se = math.sqrt(0.49 / 2 / 40)
    figures = {"diff": 0.0, "se": se, "n": 40.0, "df": 39.0, "repeats": 2.0, "within_sd": 0.7}
    paired = {paired_key(TASK_ACC, name): value for name, value in figures.items()}
    variants = [
        VariantSummary("bf16", "bf16", True, base, is_baseline=True, declared=declared),
        VariantSummary("int4", "awq_int4", True, base | {"cost/weight_bytes": 1.0} | paired, declared=declared),
    ]
    policy = Policy(max_drop_any_task=None, max_drop={TASK_ACC: 10})
    return pick(variants, "bf16", policy, Axis("cost/weight_bytes", False), documents=documents)


def _decided(documents: dict[str, int] | None):
    (check,) = _decision(documents).verdict("int4").checks
    return check


def test_pick_words_an_undecided_sampled_check_in_documents_x_repeats():
    # v = (0.1 / 2.80158)^2 = 0.00127407; 0.245 / v = 192.3 -> 193 documents (306 more scorings), or 0.49 / (40 v) =
    # 9.6 -> 10 repeats (320 more): documents.
    check = _decided(None)
    assert "(paired, n=40 documents x 2 repeats, t with 39 df)" in check.detail
    assert check.detail.endswith("; about 193 documents would settle it (x 2 repeats, 80% power)")
    # The task has its 40 documents only: repeats.
    assert _decided({"ql_sampled_e": 40}).detail.endswith(
        "; about 8 more repeats would settle it (40 documents x 10 repeats, 80% power)"
    )


@pytest.mark.parametrize(
    ("documents", "needed", "repeats", "said"),
    [
        (None, 193, None, "int4 would need ~193 documents."),
        ({"ql_sampled_e": 40}, None, 10, f"int4 would need {TASK_ACC}'s documents scored ~10 times each."),
    ],
)
def test_the_summary_names_the_cheaper_way_to_settle_a_sampled_check(documents, needed, repeats, said):
    """The decision's summary and its record say what the check's own words say: documents, or repeats where the
    task has no more documents (not the documents a task run once would need)."""
    decision = _decision(documents)
    (check,) = decision.verdict("int4").checks
    assert (check.documents_needed, check.repeats_needed) == (needed, repeats)
    assert decision.verdict("int4").documents_needed == needed
    assert said in decision.summary


def test_repeats_are_logged_and_read_back_a_task_run_once_logs_what_it_did():
    from quantlab.paired import STATISTICS, PairedComparison

    found = compare("t", DocumentScores.of_repeats(BASELINE), DocumentScores.of_repeats(VARIANT))
    logged = found.statistics()
    assert (logged["repeats"], logged["within_sd"]) == (2.0, pytest.approx(math.sqrt(0.5)))
    back = PairedComparison.logged(found.variant, {name: logged.get(name) for name in STATISTICS})
    assert (back.repeats, back.variance) == (2, RepeatVariance(4, 2, pytest.approx(1 / 12), pytest.approx(0.5)))
    once = compare(
        "t", DocumentScores(Aggregation.MEAN, {0: 1.0, 1: 0.5}), DocumentScores(Aggregation.MEAN, {0: 0.5, 1: 0.5})
    )
    assert not {"repeats", "within_sd"} & once.statistics().keys()


def test_repeats_under_adaptive_evaluation_are_refused(tmp_path, tasks_dir, tiny_llama):
    from quantlab.checks import validate
    from quantlab.errors import BadInput

    evals = {"include_path": str(tasks_dir), "adaptive": True, "tasks": [{"name": "ql_sampled_e", "repeats": 2}]}
    path = write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path, evals=evals))
    with pytest.raises(BadInput) as caught:
        validate(path)
    assert [str(p) for p in caught.value.problems] == [
        f"{path}: evals.tasks[0] (ql_sampled_e).repeats: a task in repeats scores every document: run it with "
        "evals.adaptive false, or with repeats 1"
    ]


@pytest.mark.parametrize(("n", "worse", "better"), [(20, 3, 5), (40, 0, 0), (7, 7, 0), (1000, 25, 5)])
def test_the_adjusted_item_se_is_agresti_and_min_s_on_one_run(n, worse, better):
    from quantlab.paired import adjusted_item_se, agresti_min_se

    d = np.array([-1.0] * worse + [1.0] * better + [0.0] * (n - worse - better))
    assert adjusted_item_se(d) == pytest.approx(agresti_min_se(n, worse, better))


def test_identical_sampled_answers_show_no_limit():
    """The same seeds and a variant close to the baseline can sample the same tokens every time: item means
    0.5, 1, 0, 0.5 on both sides, no difference anywhere. The se is Agresti and Min's with no flip, 1 / (4 + 2), not 0."""
    found = compare("t", DocumentScores.of_repeats(BASELINE), DocumentScores.of_repeats(BASELINE))
    assert (found.diff, found.se) == (0.0, pytest.approx(1 / 6))
    assert found.ci95_high == pytest.approx(stats.t.ppf(0.975, 3) / 6)


def test_merge_repeats_means_every_score_and_keeps_per_document_means_where_there_are_some():
    from quantlab.evaluate.lm_eval_runner import Score, TaskRequest, TaskScores, TaskSettings, merge_repeats

    settings = TaskSettings(0, None, 4, {"do_sample": True}, False, False, None, "1.0")

    def run(values, bleu, group):
        docs = DocumentScores(Aggregation.MEAN, dict(enumerate(map(float, values))))
        leaf = TaskScores(
            "leaf",
            [
                Score("leaf", "acc", "none", docs.aggregate(), 0.1, True, documents=docs),
                Score("leaf", "bleu", "none", bleu, 0.2, True, note="lm-eval logged no per-document values for it"),
            ],
            settings=settings,
        )
        top = TaskScores(
            "top", [Score("top", "acc", "none", group, 0.3, True, leaves=("eval/leaf/acc",), weights=(1,))]
        )
        return [top, leaf]

    request = TaskRequest("top", repeats=2, seed=3)
    top, leaf = merge_repeats([run([1, 0, 1, 1], 10.0, 0.75), run([0, 0, 1, 0], 20.0, 0.25)], request)
    acc, bleu = leaf.scores
    assert acc.documents == DocumentScores.of_repeats([{0: 1, 1: 0, 2: 1, 3: 1}, {0: 0, 1: 0, 2: 1, 3: 0}])
    assert (acc.value, acc.stderr) == (0.5, pytest.approx(stats.sem([0.5, 0.0, 1.0, 0.5])))
    assert (bleu.value, bleu.stderr, bleu.documents) == (15.0, None, None)
    assert bleu.note == "lm-eval logged no per-document values for it"
    assert (top.primary.value, top.primary.stderr, top.primary.weights) == (0.5, None, (1,))
    assert (leaf.settings.repeats, leaf.settings.seeds) == (2, tuple(s["torch_random_seed"] for s in request.seeds()))
