"""The release policy shared by the recipe and `quantlab pick`: limit units, relative limits, bad limits."""

from __future__ import annotations

import math
import re

import pytest
import yaml
from pydantic import ValidationError

from quantlab.errors import BadInput
from quantlab.metrics import Declared, Scale
from quantlab.paired import Group
from quantlab.policy import (
    Limit,
    LimitKind,
    Policy,
    PolicyError,
    grouped_scores,
    parse_limit,
    parse_max_drops,
    unchecked_by_any_task,
)
from quantlab.recipe import load_recipe
from recipes import tiny_recipe, write

ACC = "eval/mmlu_dev/acc"
GSM = "eval/gsm8k/exact_match:strict-match"
WORD_PPL = "eval/wikitext/word_perplexity"
BLEU = "eval/custom/bleu"
PPL = "quality/ppl"

DECLARED = {
    ACC: Declared(True, Scale.FRACTION),
    GSM: Declared(True, Scale.FRACTION),
    WORD_PPL: Declared(False, Scale.PERPLEXITY),
    BLEU: Declared(None, Scale.SCORE),  # lm-eval gave no direction
}
BASELINE = {
    ACC: 0.60,
    GSM: 0.35,
    WORD_PPL: 20.0,
    BLEU: 12.0,
    PPL: 10.0,
    "quality/kld_mean": 0.0,
    ACC + "_stderr": 0.015,
    "cost/weight_bytes": 270e6,
}


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        (1, Limit(1.0, LimitKind.OWN, "1")),
        (0.5, Limit(0.5, LimitKind.OWN, "0.5")),
        ("1", Limit(1.0, LimitKind.OWN, "1")),
        (" 2.5 ", Limit(2.5, LimitKind.OWN, "2.5")),
        ("1e-3", Limit(1e-3, LimitKind.OWN, "1e-3")),
        ("0.5 pts", Limit(0.5, LimitKind.POINTS, "0.5 pts")),
        ("1pt", Limit(1.0, LimitKind.POINTS, "1pt")),
        ("+2%", Limit(2.0, LimitKind.RELATIVE, "+2%")),
        ("5 %", Limit(5.0, LimitKind.RELATIVE, "5 %")),
        ("0", Limit(0.0, LimitKind.OWN, "0")),
    ],
)
def test_limits_as_written(written, expected):
    assert parse_limit(written) == expected


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("-1", "must be >= 0"),
        ("-2%", "must be >= 0"),
        ("nan", "finite"),
        ("inf", "finite"),
        ("one", "not a number"),
        ("", "not a number"),
        ("1 bananas", "not a number"),
        (True, "a limit is a number"),
        ([1], "a limit is a number"),
    ],
)
def test_bad_limits_say_why(written, message):
    with pytest.raises(ValueError, match=message):
        parse_limit(written)


# (metric, limit as written, largest allowed drop in the metric's own units against BASELINE)
@pytest.mark.parametrize(
    ("metric", "written", "allowed"),
    [
        pytest.param(ACC, 1, 0.01, id="fraction-plain-number-is-points"),
        pytest.param(ACC, "0.5 pts", 0.005, id="fraction-explicit-points"),
        pytest.param(GSM, 2, 0.02, id="filtered-key"),
        pytest.param(PPL, 0.5, 0.5, id="perplexity-own-unit"),
        pytest.param(PPL, "+2%", 0.2, id="perplexity-relative"),
        pytest.param(WORD_PPL, "+5%", 1.0, id="lm-eval-perplexity-relative"),
        pytest.param(WORD_PPL, 3, 3.0, id="lm-eval-perplexity-own-unit"),
        pytest.param("quality/kld_mean", 0.01, 0.01, id="nats"),
    ],
)
def test_drop_limits_in_the_metrics_own_terms(metric, written, allowed):
    policy = Policy(max_drop={metric: written}, max_drop_any_task=None)

    (rule,) = policy.drop_rules(BASELINE, DECLARED)

    assert rule.metric == metric
    assert rule.allowed == pytest.approx(allowed)


def test_the_reported_bug_ppl_1_is_one_unit_of_perplexity_not_100_points():
    (rule,) = Policy(max_drop={PPL: 1}, max_drop_any_task=None).drop_rules(BASELINE, DECLARED)

    assert rule.allowed == 1.0  # 10.00 -> 10.05 is a drop of 0.05, far inside


# Limits that the key alone shows do not fit: refused when the model is built (recipe load or flags).
@pytest.mark.parametrize(
    ("metric", "written", "message"),
    [
        pytest.param(PPL, "1 pts", "not a 0-1 metric (perplexity), so points do not apply", id="points-on-perplexity"),
        pytest.param(
            "quality/top1_agreement", "2%", "0-1 metric, whose limits are percentage points", id="percent-on-fraction"
        ),
        pytest.param("cost/weight_bytes", 1, "is a cost, not a quality metric", id="cost-metric"),
        pytest.param("time/quantize_seconds", 1, "is a cost, not a quality metric", id="time-metric"),
        pytest.param(ACC + "_stderr", 1, "standard error", id="stderr"),
        pytest.param("quality/paired/eval/mmlu_dev/acc/diff", 1, "paired statistic", id="paired-key"),
        pytest.param("quality/ppl_tokens", 1, "no known better direction", id="count-without-direction"),
        pytest.param("quality/made_up", 1, "not in quantlab's metric contract", id="unknown-key"),
        pytest.param(ACC, -1, "must be >= 0", id="negative"),
        pytest.param(ACC, float("nan"), "finite", id="nan"),
    ],
)
def test_limits_that_do_not_fit_are_refused_with_the_metric_named(metric, written, message):
    with pytest.raises(ValidationError) as raised:
        Policy(max_drop={metric: written})

    (error,) = raised.value.errors()
    assert error["loc"][0] == "max_drop"
    assert message in error["msg"]
    assert "\n" not in error["msg"]


# Limits on lm-eval scores whose direction and scale come with the sweep's runs: refused when
# applied to the sweep, before any variant is judged.
@pytest.mark.parametrize(
    ("metric", "written", "message"),
    [
        pytest.param(WORD_PPL, "1 pts", "not a 0-1 metric (perplexity)", id="points-on-lm-eval-perplexity"),
        pytest.param(ACC, "+2%", "0-1 metric, whose limits are percentage points", id="percent-on-lm-eval-fraction"),
        pytest.param(BLEU, 1, "no known better direction", id="direction-unknown"),
    ],
)
def test_limits_checked_against_the_sweeps_declarations(metric, written, message):
    policy = Policy(max_drop={metric: written}, max_drop_any_task=None)  # the key alone cannot tell

    with pytest.raises(PolicyError, match=re.escape(message)) as raised:
        policy.drop_rules(BASELINE, DECLARED)

    assert raised.value.field == "max_drop"
    assert raised.value.recipe_field == "frontier.default_policy.max_drop"
    assert str(raised.value).startswith(f"{metric}={written}: ")


def test_a_metric_the_baseline_lacks_is_left_to_the_verdicts_not_bad_input():
    (rule,) = Policy(max_drop={"eval/mmlu/acc": "+2%"}, max_drop_any_task=None).drop_rules(BASELINE, DECLARED)

    assert rule.baseline_value is None and rule.allowed is None


def test_default_policy_covers_every_known_0_1_lm_eval_score_and_names_the_rest():
    policy = Policy()

    rules = policy.drop_rules(BASELINE, DECLARED)

    assert policy.max_drop_any_task == 1.0
    assert [(r.metric, r.allowed) for r in rules] == [(GSM, 0.01), (ACC, 0.01)]  # sorted by key
    assert unchecked_by_any_task(BASELINE, DECLARED) == [
        f"{BLEU} (better direction unknown)",
        f"{WORD_PPL} (not a 0-1 score: perplexity; give it its own max_drop)",
    ]


def test_a_named_limit_overrides_the_any_task_limit_for_its_metric():
    rules = Policy(max_drop={ACC: 3}, max_drop_any_task=0.5).drop_rules(BASELINE, DECLARED)

    assert {r.metric: r.allowed for r in rules} == {ACC: pytest.approx(0.03), GSM: pytest.approx(0.005)}


def test_without_declarations_no_lm_eval_score_is_guessed_into_the_any_task_limit():
    assert Policy().drop_rules(BASELINE, {}) == ()


def test_the_recipe_section_reads_and_dumps_the_same_policy():
    text = f"""
max_drop:
  {ACC}: 1
  {PPL}: +2%
  {WORD_PPL}: "0.5"
max_drop_any_task: 0.5
max_kld: 0.05
min_top1_agreement: 0.9
at_most: {{cost/ttft_ms_p99: 200}}
"""
    policy = Policy.model_validate(yaml.safe_load(text))

    assert policy.max_drop[PPL] == Limit(2.0, LimitKind.RELATIVE, "+2%")
    dumped = policy.model_dump(mode="json")
    assert dumped["max_drop"] == {ACC: 1.0, PPL: "+2%", WORD_PPL: 0.5}
    assert Policy.model_validate(dumped) == policy
    assert [(b.metric, b.limit, b.upper) for b in policy.bounds()] == [
        ("quality/kld_mean", 0.05, True),
        ("cost/ttft_ms_p99", 200.0, True),
        ("quality/top1_agreement", 0.9, False),
    ]
    overridden = Policy(
        max_kld=0.05, max_peak_memory_bytes=1e9, at_most={"quality/kld_mean": 0.1}, at_least={"x": 2}
    ).bounds()
    assert [(b.metric, b.limit, b.upper) for b in overridden] == [
        ("quality/kld_mean", 0.1, True),
        ("cost/peak_memory_bytes", 1e9, True),
        ("x", 2.0, False),
    ]


def test_a_recipe_with_a_limit_that_does_not_fit_names_the_file_and_field(tmp_path):
    policy = {"max_drop": {PPL: "1 pts", ACC: 1}, "max_kld": -1}
    recipe = write(tmp_path / "recipe.yaml", tiny_recipe(tmp_path, frontier={"default_policy": policy}))

    with pytest.raises(BadInput) as raised:
        load_recipe(recipe)

    shown = [str(problem) for problem in raised.value.problems]
    assert (
        f"{recipe}: frontier.default_policy.max_drop: {PPL}=1 pts: is not a 0-1 metric (perplexity), so points do not apply: give its own unit ({PPL}=1) or a limit relative to the baseline ({PPL}=+1%)"
        in shown
    )
    assert f"{recipe}: frontier.default_policy.max_kld: Input should be greater than or equal to 0" in shown


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"max_kld": -0.1}, "max_kld"),
        ({"max_kld": math.inf}, "max_kld"),
        ({"min_top1_agreement": 1.5}, "min_top1_agreement"),
        ({"max_peak_memory_bytes": 0}, "max_peak_memory_bytes"),
        ({"max_drop_any_task": -1}, "max_drop_any_task"),
        ({"at_most": {"": 1}}, "at_most"),
        ({"at_least": {"cost/decode_tokens_per_s": "fast"}}, "at_least"),
        ({"max_drops": {ACC: 1}}, "max_drops"),  # a typo is an unknown key, not ignored
    ],
)
def test_bad_policy_fields_are_located(section, field):
    with pytest.raises(ValidationError) as raised:
        Policy.model_validate(section)

    assert raised.value.errors()[0]["loc"][0] == field


# --------------------------------------------------------------------------------------
# The command line's METRIC=LIMIT
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"{ACC}=1", (ACC, Limit(1.0, LimitKind.OWN, "1"))),
        (f" {ACC} = 0.5 ", (ACC, Limit(0.5, LimitKind.OWN, "0.5"))),
        (f"{PPL}=+2%", (PPL, Limit(2.0, LimitKind.RELATIVE, "+2%"))),
        (f"{GSM}=2pts", (GSM, Limit(2.0, LimitKind.POINTS, "2pts"))),
    ],
)
def test_parse_max_drop(text, expected):
    assert parse_max_drops([text]) == dict([expected])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(ACC, "expected METRIC=LIMIT", id="no-equals"),
        pytest.param("=1", "metric name before '=' is missing", id="no-metric"),
        pytest.param(f"{ACC}=", "limit after '=' is missing", id="no-limit"),
        pytest.param(f"{ACC}=one", f"{ACC}=one: limit 'one' is not a number", id="not-a-number"),
        pytest.param(f"{ACC}=-1", "must be >= 0", id="negative"),
        pytest.param(f"{ACC}=inf", "finite", id="inf"),
    ],
)
def test_parse_max_drop_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_max_drops([text])


def test_parse_max_drops_rejects_repeats():
    assert parse_max_drops([f"{ACC}=1", f"{PPL}=+2%"]) == {ACC: parse_limit(1), PPL: parse_limit("+2%")}
    with pytest.raises(ValueError, match="given twice"):
        parse_max_drops([f"{ACC}=1", f"{ACC}=2"])


@pytest.mark.parametrize(
    ("metric", "message"),
    [
        ("eval/mmlu_dev/ac", f"did you mean {ACC}"),
        ("eval/zzz/qqq", f"logged: {BLEU}, {GSM}, {ACC}, {WORD_PPL}"),
    ],
)
def test_a_metric_no_run_logged_is_named(metric, message):
    with pytest.raises(PolicyError, match=message):
        Policy(max_drop={metric: 1}).check_logged(set(BASELINE))


# --------------------------------------------------------------------------------------
# Groups, levels, and limits relative to a baseline of 0 (issue 28)
# --------------------------------------------------------------------------------------

MMLU, STEM = "eval/mmlu/acc", "eval/mmlu_stem/acc"
LEAVES = ("eval/mmlu_anatomy/acc", "eval/mmlu_astronomy/acc", "eval/mmlu_law/acc")
GROUPS = {
    MMLU: Group(LEAVES, (0.3, 0.3, 0.4)),
    STEM: Group(LEAVES[:2], (0.5, 0.5)),  # nested: its leaves lie within mmlu's
}


def test_a_group_and_everything_inside_it_is_one_score_for_the_any_task_limit():
    declared = DECLARED | {key: Declared(True, Scale.FRACTION) for key in (MMLU, STEM, *LEAVES)}
    baseline = BASELINE | dict.fromkeys((MMLU, STEM, *LEAVES), 0.5)

    assert grouped_scores(GROUPS) == {STEM, *LEAVES}
    rules = Policy().drop_rules(baseline, declared, GROUPS)
    assert [r.metric for r in rules] == [GSM, MMLU, ACC]
    named = Policy(max_drop={LEAVES[0]: 2}).drop_rules(baseline, declared, GROUPS)
    assert [r.metric for r in named] == [LEAVES[0], GSM, MMLU, ACC]  # a named leaf is checked, beside its group
    assert Policy().drop_rules(baseline, declared) != rules  # without the groups, every score as before


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"one_sided_alpha": 0}, "one_sided_alpha"),
        ({"one_sided_alpha": 0.5}, "one_sided_alpha"),
        ({"power": 0.4}, "power"),
        ({"power": 1}, "power"),
    ],
)
def test_bad_levels_are_located(section, field):
    with pytest.raises(ValidationError) as raised:
        Policy.model_validate(section)

    assert raised.value.errors()[0]["loc"][0] == field


def test_the_default_level_is_the_non_inferiority_convention():
    policy = Policy()
    assert (policy.one_sided_alpha, policy.power) == (0.025, 0.8)
    assert Policy.model_validate(policy.model_dump(mode="json")) == policy


def test_a_relative_limit_on_a_metric_whose_baseline_is_0_is_refused():
    policy = Policy(max_drop={"quality/kld_mean": "+5%"}, max_drop_any_task=None)

    with pytest.raises(PolicyError) as raised:
        policy.drop_rules(BASELINE, DECLARED)  # the baseline's KL from itself: 0

    assert str(raised.value) == (
        "quality/kld_mean=+5%: is relative to the baseline, whose value is 0, so it would allow no change at all: "
        "give the limit in the metric's own unit"
    )
    (rule,) = Policy(max_drop={"quality/kld_mean": 0.05}, max_drop_any_task=None).drop_rules(BASELINE, DECLARED)
    assert rule.allowed == 0.05
