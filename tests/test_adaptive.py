"""Adaptive evaluation: the spending function, the stages and the stop rule (tables and seeded simulations), and a
variant scored in stages by lm-eval on the tiny Llama."""

from __future__ import annotations

import math
from dataclasses import replace
from statistics import NormalDist
from types import SimpleNamespace

import numpy as np
import pytest

from quantlab import adaptive
from quantlab.adaptive import Spending, StopReason
from quantlab.errors import BadInput
from quantlab.jobs import BaselineOutputs
from quantlab.metrics import Declared, Scale, adaptive_key, spec
from quantlab.paired import Outcome, PairedComparison
from quantlab.policy import DropRule, Limit, LimitKind, Policy
from quantlab.recipe import EvalSettings, EvalTaskSpec, load_recipe
from recipes import REPO, tiny_recipe, write

ALPHA = 0.025
QUARTERS = (0.25, 0.5, 0.75, 1.0)
_NORMAL = NormalDist()


# --- The spending function and the stages' levels ---


@pytest.mark.parametrize(
    ("fraction", "spending", "expected"),
    [
        (1.0, Spending.OBRIEN_FLEMING, ALPHA),
        (1.0, Spending.POCOCK, ALPHA),
        (0.0, Spending.OBRIEN_FLEMING, 0.0),
        # 2 - 2 Phi(z_(1 - alpha/2) / sqrt(t)), z_0.9875 = 2.2414
        (0.25, Spending.OBRIEN_FLEMING, 2 * _NORMAL.cdf(-_NORMAL.inv_cdf(1 - ALPHA / 2) / 0.5)),
        (0.5, Spending.OBRIEN_FLEMING, 2 * _NORMAL.cdf(-_NORMAL.inv_cdf(1 - ALPHA / 2) / math.sqrt(0.5))),
        (0.5, Spending.POCOCK, ALPHA * math.log(1 + (math.e - 1) / 2)),
    ],
)
def test_spending_by_hand(fraction, spending, expected):
    assert adaptive.spent(fraction, ALPHA, spending) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    ("fractions", "boundaries"),
    [
        # Lan-DeMets O'Brien-Fleming, one-sided 0.025, equal stages (gsDesign sfLDOF, test.type = 1)
        ((0.5, 1.0), (2.9626, 1.9686)),
        (QUARTERS, (4.3326, 2.9631, 2.3590, 2.0141)),
        ((1.0,), (1.9600,)),
    ],
)
def test_obrien_fleming_boundaries_are_the_published_ones(fractions, boundaries):
    levels = adaptive.nominal_levels(fractions, ALPHA)
    found = tuple(-_NORMAL.inv_cdf(level) for level in levels)
    assert found == pytest.approx(boundaries, abs=2e-3)


@pytest.mark.parametrize("spending", list(Spending))
@pytest.mark.parametrize("fractions", [QUARTERS, (0.1, 0.4, 1.0), (0.3, 0.35, 0.9, 1.0)])
def test_each_stage_spends_its_share_of_the_level(spending, fractions):
    """Brownian paths at the stages' information fractions cross each stage's boundary, having crossed none
    before, with the probability the spending function allots it."""
    rng = np.random.default_rng(7)
    times = np.array(fractions)
    steps = rng.standard_normal((400_000, times.size)) * np.sqrt(np.diff(times, prepend=0.0))
    z = np.cumsum(steps, axis=1) / np.sqrt(times)
    bounds = np.array([-_NORMAL.inv_cdf(level) for level in adaptive.nominal_levels(fractions, ALPHA, spending)])
    crossed = z >= bounds
    first = np.where(crossed.any(axis=1), crossed.argmax(axis=1), -1)
    spent = np.array([adaptive.spent(t, ALPHA, spending) for t in times])
    expected = np.diff(spent, prepend=0.0)
    found = np.array([(first == k).mean() for k in range(times.size)])
    assert found == pytest.approx(expected, abs=4 * math.sqrt(ALPHA / 400_000) + 1e-5)


@pytest.mark.parametrize("fractions", [(0.5, 0.4, 1.0), (0.5,), (0.0, 1.0), ()])
def test_fractions_must_rise_to_one(fractions):
    with pytest.raises(ValueError, match="information fractions"):
        adaptive.nominal_levels(fractions, ALPHA)


@pytest.mark.parametrize(
    ("total", "fractions", "documents"),
    [
        (100, QUARTERS, (25, 50, 75, 100)),
        (3, QUARTERS, (1, 2, 3)),  # stages that would add nothing are left out
        (10, (0.3, 1.0), (3, 10)),  # 0.3 * 10 is 3.0000000000000004 in floats: still 3
        (1, QUARTERS, (1,)),
        (7, (0.5,), (4, 7)),  # the last stage always has every document
    ],
)
def test_stage_documents(total, fractions, documents):
    assert adaptive.stage_documents(total, fractions) == documents


def test_a_design_stages_every_leaf_alike_and_draws_its_documents_from_the_shared_order():
    orders = {"a": adaptive.document_order(range(8), 0, "a"), "b": adaptive.document_order(range(100, 104), 0, "b")}
    design = adaptive.design(orders, QUARTERS, ALPHA)
    assert [dict(stage) for stage in design.documents] == [
        {"a": 2, "b": 1},
        {"a": 4, "b": 2},
        {"a": 6, "b": 3},
        {"a": 8, "b": 4},
    ]
    assert design.stages == 4 and design.total == 12 and design.used(1) == 6
    assert design.samples(1) == {"a": sorted(orders["a"][:4]), "b": sorted(orders["b"][:2])}
    assert design.levels == adaptive.nominal_levels([3 / 12, 6 / 12, 9 / 12, 1.0], ALPHA)
    assert design.share(3) == pytest.approx(design.levels[3] / ALPHA) and design.share(3) < 1


def test_the_document_order_is_fixed_by_seed_and_task_alone():
    first = adaptive.document_order(list(range(50)), 3, "mmlu_dev")
    assert sorted(first) == list(range(50)) and first != list(range(50))
    assert adaptive.document_order(list(reversed(range(50))), 3, "mmlu_dev") == first  # not by the ids' order
    assert adaptive.document_order(list(range(50)), 4, "mmlu_dev") != first
    assert adaptive.document_order(list(range(50)), 3, "pydoc_cloze") != first


@pytest.mark.parametrize(
    ("outcomes", "last", "reason"),
    [
        ((Outcome.WITHIN, Outcome.WITHIN), False, StopReason.WITHIN),
        ((Outcome.WITHIN, Outcome.OVER), False, StopReason.OVER),
        ((Outcome.UNSURE, Outcome.OVER), False, StopReason.OVER),
        ((Outcome.WITHIN, Outcome.UNSURE), False, None),
        ((Outcome.WITHIN, Outcome.UNSURE), True, StopReason.LAST),
        ((), False, None),
        ((), True, StopReason.LAST),
    ],
)
def test_stop_rule(outcomes, last, reason):
    assert adaptive.stop_after(outcomes, last) is reason


def test_a_stage_that_spends_nothing_settles_nothing():
    rule = _rule(2)
    assert adaptive.stage_outcomes([rule], {rule.metric: _flips(1000, 0, 0)}, 0.0, 1) == (Outcome.UNSURE,)
    assert adaptive.stage_outcomes([rule], {}, ALPHA, 1) == (Outcome.UNSURE,)  # no comparison: nothing to judge
    assert adaptive.stage_outcomes([rule], {rule.metric: _flips(1000, 0, 0)}, ALPHA, 1) == (Outcome.WITHIN,)


# --- The error rate, simulated: a variant whose true drop is exactly its limit ---


def _rule(limit_points: float, scale: Scale = Scale.FRACTION) -> DropRule:
    key = "eval/task/acc"
    return DropRule(key, spec(key, {key: Declared(True, scale)}), Limit(limit_points, LimitKind.POINTS, "x"), 0.5)


def _flips(n: int, worse: int, better: int) -> PairedComparison:
    """What `paired.compare` gives for 0/1 scores: the verdict reads n and the flips."""
    diff = (better - worse) / n
    return PairedComparison(n, 0.5, 0.5 + diff, diff, math.nan, math.nan, math.nan, math.nan, "x", worse, better)


def _means(d: np.ndarray) -> PairedComparison:
    """What `paired.compare` gives for continuous scores: the mean difference, its se, Student's t."""
    se = float(d.std(ddof=1)) / math.sqrt(d.size)
    diff = float(d.mean())
    return PairedComparison(d.size, 0.0, diff, diff, se, math.nan, math.nan, math.nan, "paired_t", df=d.size - 1.0)


def _declared_within(comparisons, rule: DropRule, levels) -> bool:
    """Whether a variant is shown within its limit at some stage, stopping at the first that settles it."""
    for stage, (comparison, level) in enumerate(zip(comparisons, levels)):
        outcome = adaptive.stage_outcomes([rule], {rule.metric: comparison}, level, 1)[0]
        if adaptive.stop_after([outcome], stage == len(levels) - 1) is not None:
            return outcome is Outcome.WITHIN
    return False


def _flip_draws(draws: int, documents: int, worse: float, better: float, seed: int) -> tuple[np.ndarray, tuple]:
    """Per draw and stage (quarters): (worse, better) flips among the documents scored so far."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=(draws, documents), p=[worse, better, 1 - worse - better])
    sizes = adaptive.stage_documents(documents, QUARTERS)
    cumulative = np.stack([np.cumsum(kind == 0, axis=1), np.cumsum(kind == 1, axis=1)], axis=-1)
    return cumulative[:, [size - 1 for size in sizes]], sizes


def test_flips_at_the_limit_are_shown_within_no_more_often_than_the_level_however_the_stages_stop():
    """0/1 scores, a 2-point limit, 5% of documents worse and 3% better: the true drop is the limit. Shown within at
    any stage (each at its spent level) happens at most alpha of the time; testing every stage at alpha does not."""
    draws, rule = 3000, _rule(2)
    counts, sizes = _flip_draws(draws, 800, 0.05, 0.03, seed=11)
    spent_levels = adaptive.nominal_levels([size / sizes[-1] for size in sizes], ALPHA)
    naive_levels = [ALPHA] * len(sizes)
    rates = {}
    for name, levels, rows in (("spent", spent_levels, draws), ("naive", naive_levels, draws // 3)):
        within = [
            _declared_within([_flips(n, *counts[i, k]) for k, n in enumerate(sizes)], rule, levels) for i in range(rows)
        ]
        rates[name] = float(np.mean(within))
    slack = 2 * math.sqrt(ALPHA * (1 - ALPHA) / draws)
    assert rates["spent"] <= ALPHA + slack, rates
    assert rates["naive"] > ALPHA + slack, rates  # the test can tell: repeated looks at the full level err more


def test_continuous_drops_at_the_limit_are_shown_within_no_more_often_than_the_level():
    draws, documents, limit = 4000, 400, 0.1
    rng = np.random.default_rng(5)
    differences = rng.normal(-limit, 1.0, size=(draws, documents))  # variant - baseline: a drop of exactly the limit
    rule = replace(_rule(limit), spec=spec("eval/task/x", {"eval/task/x": Declared(True, Scale.SCORE)}))
    rule = replace(rule, metric="eval/task/x", limit=Limit(limit, LimitKind.OWN, "x"))
    sizes = adaptive.stage_documents(documents, QUARTERS)
    levels = adaptive.nominal_levels([size / documents for size in sizes], ALPHA)
    within = [_declared_within([_means(row[:n]) for n in sizes], rule, levels) for row in differences]
    assert float(np.mean(within)) <= ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / draws)


def test_clear_verdicts_stop_early_and_close_ones_run_every_document():
    rule, sizes = _rule(2), adaptive.stage_documents(2000, QUARTERS)
    levels = adaptive.nominal_levels([size / 2000 for size in sizes], ALPHA)

    def stop(worse_rate: float, better_rate: float) -> tuple[int, Outcome]:
        for stage, (n, level) in enumerate(zip(sizes, levels)):
            comparison = _flips(n, round(worse_rate * n), round(better_rate * n))
            outcome = adaptive.stage_outcomes([rule], {rule.metric: comparison}, level, 1)[0]
            if adaptive.stop_after([outcome], stage == len(sizes) - 1) is not None:
                return stage, outcome
        raise AssertionError("the last stage always stops")

    # No flip: the first quarter's 500 documents cannot show 2 points at its level (its bound is 3.6 points), half can.
    assert stop(0.0, 0.0) == (1, Outcome.WITHIN)
    assert stop(0.12, 0.02) == (0, Outcome.OVER)  # 10 points worse
    assert stop(0.04, 0.03)[0] == 3  # 1 point worse against a 2-point limit: every document


# --- In the evaluate stage: lm-eval scores the documents of each stage ---


def _settings(**changes) -> EvalSettings:
    task = EvalTaskSpec(name="mmlu_dev", limit=24)
    return EvalSettings(include_path=str(REPO / "evals"), tasks=[task], batch_size=8, adaptive=True, **changes)


@pytest.fixture(scope="module")
def scored_in_full(tiny_llama):
    from quantlab.stages.evaluate import evaluate_tasks

    model, tokenizer = tiny_llama.load()
    outcome = evaluate_tasks(model, tokenizer, _settings(), REPO / "evals", lambda step: None, None)
    return model, tokenizer, outcome


def _baseline(outcome, scores=None) -> BaselineOutputs:
    documents = outcome.documents
    if scores is not None:  # every document scored `scores`
        documents = {key: replace(d, values=dict.fromkeys(d.values, scores)) for key, d in documents.items()}
    values = {key: d.aggregate() for key, d in documents.items()}
    return BaselineOutputs(None, documents, outcome.groups, outcome.scores | values, outcome.primary)


def _adaptive(scored_in_full, baseline: BaselineOutputs, limit: float):
    from quantlab.stages.evaluate import AdaptivePlan, answer_damage, evaluate_tasks

    model, tokenizer, _ = scored_in_full
    plan = AdaptivePlan(baseline, Policy(max_drop_any_task=limit), ALPHA)
    outcome = evaluate_tasks(model, tokenizer, _settings(), REPO / "evals", lambda step: None, None, plan)
    return outcome, answer_damage(outcome, baseline)


def test_a_variant_clearly_within_stops_early_on_the_shared_order(scored_in_full):
    """The same model as the baseline: no flip. At a 45-point limit (what a few documents can show) the second stage's
    half of them settles it; the first quarter cannot at its level."""
    _, _, full = scored_in_full
    outcome, damage = _adaptive(scored_in_full, _baseline(full), 45)
    assert outcome.metrics[adaptive_key("mmlu_dev", "documents_used")] == 12
    assert outcome.metrics[adaptive_key("mmlu_dev", "documents_total")] == 24
    assert outcome.metrics[adaptive_key("mmlu_dev", "stage")] == 2
    assert 0 < outcome.metrics[adaptive_key("mmlu_dev", "level_share")] < 1
    assert outcome.tags["quantlab.adaptive/mmlu_dev"].startswith(StopReason.WITHIN.value)
    order = adaptive.document_order(range(24), 0, "mmlu_dev")
    assert set(outcome.documents["eval/mmlu_dev/acc"].values) == set(order[:12])
    # Paired with the baseline on those documents alone, with the same values there.
    assert damage.metrics["quality/paired/eval/mmlu_dev/acc/n"] == 12
    assert damage.metrics["quality/paired/eval/mmlu_dev/acc/correct_to_wrong"] == 0
    assert "eval.adaptive" in outcome.params and outcome.params["eval.mmlu_dev.documents"] == "12"


def test_a_variant_clearly_over_stops_early(scored_in_full):
    """Against a baseline that answered every document right, the tiny random model is far over a 20-point limit."""
    _, _, full = scored_in_full
    outcome, damage = _adaptive(scored_in_full, _baseline(full, scores=1.0), 20)
    assert outcome.metrics[adaptive_key("mmlu_dev", "stage")] < 4
    assert outcome.tags["quantlab.adaptive/mmlu_dev"].startswith(StopReason.OVER.value)
    used = int(outcome.metrics[adaptive_key("mmlu_dev", "documents_used")])
    assert damage.metrics["quality/paired/eval/mmlu_dev/acc/n"] == used < 24


def test_a_variant_its_damage_already_rejects_stops_every_task_at_its_first_stage(scored_in_full):
    """No flip (it would pass at stage 2, as above), but its KL is over the policy's max_kld: its tasks stop at the
    first stage, saying why, and their claims stay at that stage's level (pick judges them there)."""
    from quantlab.stages.evaluate import AdaptivePlan, evaluate_tasks

    model, tokenizer, full = scored_in_full
    why = "quality/kld_mean is 0.2, above the maximum of 0.05"
    plan = AdaptivePlan(_baseline(full), Policy(max_drop_any_task=45), ALPHA, rejected_by=why)
    outcome = evaluate_tasks(model, tokenizer, _settings(), REPO / "evals", lambda step: None, None, plan)
    assert outcome.metrics[adaptive_key("mmlu_dev", "stage")] == 1
    assert outcome.metrics[adaptive_key("mmlu_dev", "documents_used")] == 6
    first_share = adaptive.design({"mmlu_dev": list(range(24))}, QUARTERS, ALPHA).share(0)
    assert outcome.metrics[adaptive_key("mmlu_dev", "level_share")] == pytest.approx(first_share)
    assert (
        outcome.tags["quantlab.adaptive/mmlu_dev"]
        == f"{StopReason.REJECTED.value}: {why} (stage 1 of 4, 6 of 24 documents)"
    )


@pytest.mark.parametrize(
    ("policy", "damage", "rejected_by"),
    [
        ({"max_kld": 0.05}, {"quality/kld_mean": 0.2}, "quality/kld_mean is 0.2, above the maximum of 0.05"),
        ({"max_kld": 0.05}, {"quality/kld_mean": 0.05}, None),  # at the limit: meets it
        ({"max_kld": 0.05}, {}, None),  # quality off: nothing to judge before the tasks
        ({"min_top1_agreement": 0.9}, {"quality/top1_agreement": 0.8}, "below the minimum"),
        ({"max_peak_memory_bytes": 1}, {"quality/kld_mean": 0.2}, None),  # measured later: not judged here
        ({}, {"quality/kld_mean": 9.0}, None),
    ],
)
def test_the_plan_names_a_plain_limit_the_damage_already_fails(tmp_path, policy, damage, rejected_by):
    from quantlab.stages.evaluate import DamageOutcome, adaptive_plan

    raw = tiny_recipe(tmp_path / "model")
    raw |= {"evals": raw["evals"] | {"adaptive": True}, "frontier": {"default_policy": policy}}
    recipe = load_recipe(write(tmp_path / "recipe.yaml", raw)).recipe
    job = SimpleNamespace(is_baseline=False, baseline=SimpleNamespace())
    plan = adaptive_plan(recipe, job, DamageOutcome(damage))
    if rejected_by is None:
        assert plan.rejected_by is None
    else:
        assert rejected_by in plan.rejected_by


def test_a_task_no_limit_applies_to_runs_every_document(scored_in_full):
    _, _, full = scored_in_full
    from quantlab.stages.evaluate import AdaptivePlan, evaluate_tasks

    model, tokenizer, _ = scored_in_full
    plan = AdaptivePlan(_baseline(full), Policy(max_drop_any_task=None), ALPHA)
    outcome = evaluate_tasks(model, tokenizer, _settings(), REPO / "evals", lambda step: None, None, plan)
    assert outcome.metrics[adaptive_key("mmlu_dev", "documents_used")] == 24
    assert adaptive_key("mmlu_dev", "level_share") not in outcome.metrics  # judged as without adaptive evaluation
    assert outcome.tags["quantlab.adaptive/mmlu_dev"].startswith(StopReason.UNCHECKED.value)
    assert outcome.documents["eval/mmlu_dev/acc"].values == full.documents["eval/mmlu_dev/acc"].values


# --- The recipe ---


def test_adaptive_settings_are_left_out_of_the_run_key_when_off():
    assert not any(key.startswith("adaptive") for key in EvalSettings().model_dump())
    assert EvalSettings(adaptive=True).model_dump()["adaptive_stages"] == list(QUARTERS)


@pytest.mark.parametrize(
    ("evals", "field", "message"),
    [
        ({"adaptive": True, "adaptive_stages": [0.5, 0.4, 1]}, "evals.adaptive_stages", "not strictly increasing"),
        ({"adaptive": True, "adaptive_stages": [0.5, 0.9]}, "evals.adaptive_stages", "must end with 1"),
        ({"adaptive_spending": "linear"}, "evals.adaptive_spending", "obrien_fleming"),
        ({"adaptive": True, "engine": "both"}, "evals.adaptive", "engine: both"),
    ],
)
def test_bad_adaptive_settings_name_their_field(tmp_path, evals, field, message):
    recipe = tiny_recipe(tmp_path / "model")
    path = write(tmp_path / "recipe.yaml", recipe | {"evals": recipe["evals"] | evals})
    with pytest.raises(BadInput) as caught:
        load_recipe(path)
    problems = [str(problem) for problem in caught.value.problems]
    assert any(p.startswith(f"{path}: {field}") and message in p for p in problems), problems


# --- The final verdict tests a task stopped in stages at its stage's level ---


@pytest.mark.parametrize(("share", "status"), [(None, "passed"), (1.0, "passed"), (1e-4, "undecided")])
def test_pick_judges_a_staged_task_at_the_level_of_its_last_stage(share, status):
    """No flip in 1,000 documents shows a 1-point limit at 2.5% (Tango's bound 0.38 pts), not at 2.5% x 1e-4 (2.0)."""
    from quantlab.decision import pick
    from quantlab.frontier import Axis, VariantSummary

    key, declared = "eval/t/acc", {"eval/t/acc": Declared(True, Scale.FRACTION)}
    paired = {f"quality/paired/{key}/{name}": value for name, value in [("diff", 0.0), ("se", 0.0), ("n", 1000)]}
    flips = {f"quality/paired/{key}/{name}": 0 for name in ("correct_to_wrong", "wrong_to_correct")}
    staged = {} if share is None else {adaptive_key("t", "level_share"): share}
    cost = {"cost/weight_bytes": 1.0}
    baseline = VariantSummary("base", "bf16", True, {key: 0.5} | cost, is_baseline=True, declared=declared)
    variant = VariantSummary("v", "x", True, {key: 0.5} | paired | flips | staged | cost, declared=declared)
    policy = Policy(max_drop={key: 1}, max_drop_any_task=None)
    (check,) = pick([baseline, variant], "base", policy, Axis("cost/weight_bytes", False)).verdict("v").checks
    assert check.status.value == status
    assert check.alpha == pytest.approx(ALPHA * (1.0 if share is None else share))
