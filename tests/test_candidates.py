"""The error rate of the choice among candidates: the order a fixed sequence tests them in, what each control
says, how `pick` applies it, and a seeded simulation through `pick` of K = 1..10 candidates all at their limits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from test_decision import ACC, BASELINE_METRICS, DECLARED, WEIGHTS, baseline, candidate, decide, leaf_comparison, only

from quantlab.candidates import ChoiceControl, SequenceError, control_choice, sequence_order
from quantlab.decision import CheckStatus, Status
from quantlab.frontier import VariantSummary
from quantlab.metrics import paired_key
from quantlab.policy import CandidateControl, Policy, PolicyError
from quantlab.report import decision_text

FIXED, BONFERRONI, NONE = CandidateControl.FIXED_SEQUENCE, CandidateControl.BONFERRONI, CandidateControl.NONE


@pytest.mark.parametrize(
    ("values", "declared", "higher_is_better", "order"),
    [
        # weight bytes, lower is better: the largest (least compressed) first
        ({"int4": 90.0, "fp8": 170.0, "w8": 180.0}, [], False, ("w8", "fp8", "int4")),
        # a throughput, higher is better: the slowest first
        ({"int4": 50.0, "fp8": 40.0, "w8": 30.0}, [], True, ("w8", "fp8", "int4")),
        ({"int4": 90.0, "fp8": 170.0, "w8": 180.0}, ["int4"], False, ("int4", "w8", "fp8")),
        ({"a": None, "b": 1.0, "c": math.nan}, [], False, ("b", "a", "c")),  # without the objective: last, by name
        ({}, [], False, ()),
    ],
)
def test_sequence_order(values, declared, higher_is_better, order):
    assert sequence_order(values, declared, higher_is_better) == order


def test_a_sequence_naming_no_candidate_is_refused():
    with pytest.raises(SequenceError, match="sequence names nf4, not among the candidates \\(fp8, int4\\)"):
        sequence_order({"fp8": 1.0, "int4": 2.0}, ["nf4"], False)


ORDER = ("w8", "fp8", "int4")


@pytest.mark.parametrize(
    ("method", "within", "drops", "stopped", "untested", "candidate_alpha", "rate", "words"),
    [
        (
            FIXED,
            {"w8": True, "fp8": True, "int4": True},
            True,
            None,
            (),
            0.025,
            0.025,
            "The chance of shipping a variant truly over a drop limit is at most 2.5%: the 3 candidates tested in a "
            "fixed sequence (w8, fp8, int4), each at 2.5%, stopping at the first not shown within every drop limit.",
        ),
        (
            FIXED,
            {"w8": True, "fp8": False, "int4": True},
            True,
            "fp8",
            ("int4",),
            0.025,
            0.025,
            "The chance of shipping a variant truly over a drop limit is at most 2.5%: the 3 candidates tested in a "
            "fixed sequence (w8, fp8, int4), each at 2.5%, stopping at the first not shown within every drop limit; "
            "it stopped at fp8, so int4 could not be shipped.",
        ),
        (
            BONFERRONI,
            {"w8": True, "fp8": False, "int4": True},
            True,
            None,
            (),
            0.025 / 3,
            0.025,
            "The chance of shipping a variant truly over a drop limit is at most 2.5%: each of the 3 candidates "
            "tested at 2.5% / 3 = 0.833% (Bonferroni).",
        ),
        (
            NONE,
            {"w8": False},
            True,
            None,
            (),
            0.025,
            0.075,
            "The chance of shipping a variant truly over a drop limit is up to 7.5%: 3 candidates, each tested at "
            "2.5% with no correction for their number (policy candidates: none).",
        ),
        (
            FIXED,
            {"w8": False},
            False,
            None,
            (),
            0.025,
            None,
            "No drop limits: the choice rests on logged figures alone, with no error rate to state.",
        ),
    ],
)
def test_what_each_control_makes_of_the_family(method, within, drops, stopped, untested, candidate_alpha, rate, words):
    control = control_choice(method, ORDER, within, 0.025, has_drop_limits=drops)
    assert (control.stopped_at, control.untested) == (stopped, untested)
    assert control.candidate_alpha == pytest.approx(candidate_alpha)
    assert control.error_rate == (pytest.approx(rate) if rate is not None else None)
    assert control.words == words


def test_one_candidate_needs_no_correction():
    for method in CandidateControl:
        control = ChoiceControl(method, ("fp8",), 0.025)
        assert (control.candidate_alpha, control.error_rate) == (0.025, 0.025)


# --- in pick ---

SE = 0.004  # 0.4 pt: a 1-pt limit is shown within at a drop of 0, not at a drop of 0.5 pt (upper bound 1.28 pts)


def _sized(name: str, weights: float, drop_pts: float, se: float = SE):
    return candidate(name, se=se, **{WEIGHTS: weights, ACC: BASELINE_METRICS[ACC] - drop_pts / 100})


def test_the_fixed_sequence_stops_at_the_first_candidate_not_shown_within():
    variants = [baseline(), _sized("w8", 180e6, 0.0), _sized("fp8", 170e6, 0.5), _sized("int4", 90e6, 0.0)]
    decision = decide(variants, only(max_drop={ACC: 1}))
    assert decision.chosen == "w8"
    assert decision.verdict("fp8").status is Status.UNDECIDED
    (reason,) = decision.verdict("int4").reasons
    assert decision.verdict("int4").status is Status.UNDECIDED and "stopped at fp8" in reason
    assert decision.control.order == ("w8", "fp8", "int4") and decision.control.untested == ("int4",)
    assert decision.to_dict()["error_control"]["untested"] == ["int4"]
    assert decision_text(decision, variants).why.endswith(
        "The chance that the choice is over a limit: at most 2.5% (fixed sequence of 3 candidates)."
    )
    # Uncorrected, int4 would have shipped on the same figures.
    assert decide(variants, only(max_drop={ACC: 1}, candidates="none")).chosen == "int4"
    # Declared first, int4 is tested first and ships.
    assert decide(variants, only(max_drop={ACC: 1}, sequence=["int4"])).chosen == "int4"


def test_bonferroni_tests_each_candidate_at_the_level_over_their_number():
    """A drop of 0.2 pt with se 0.4 pt: upper bound 0.2 + 1.96 x 0.4 = 0.98 pt at 2.5%, within a 1-pt limit; at
    2.5% / 2 it is 0.2 + 2.24 x 0.4 = 1.10 pts, not within."""
    variants = [baseline(), _sized("fp8", 170e6, 0.2), _sized("int4", 90e6, 0.2)]
    assert decide(variants, only(max_drop={ACC: 1}, candidates="none")).chosen == "int4"
    decision = decide(variants, only(max_drop={ACC: 1}, candidates="bonferroni"))
    assert decision.chosen == "bf16"
    check = decision.verdict("int4").checks[0]
    assert check.alpha == pytest.approx(0.0125)
    assert check.upper == pytest.approx(0.002 + stats.norm.ppf(1 - 0.0125) * SE)


def test_a_sequence_naming_an_unknown_variant_is_refused_naming_the_field():
    with pytest.raises(PolicyError, match="sequence names nf4") as refused:
        decide([baseline(), _sized("fp8", 170e6, 0.0)], only(max_drop={ACC: 1}, sequence=["nf4"]))
    assert (refused.value.field, refused.value.recipe_field) == ("sequence", "frontier.default_policy.sequence")


def test_the_policy_refuses_an_unknown_control():
    with pytest.raises(ValueError, match="candidates"):
        Policy(candidates="holm")


# --- the error rate of the choice, simulated through pick ---

DRAWS = 400
LIMIT_PTS, SE_PTS = 1.0, 0.5


def _ships_over(method: str, k: int, drops: np.ndarray) -> bool:
    """Whether pick ships a variant when every one of the k candidates is truly at its limit (`drops`: their
    observed drops, in points)."""
    variants = [baseline(), *(_sized(f"c{i}", 200e6 - i * 1e6, drops[i], SE_PTS / 100) for i in range(k))]
    return decide(variants, only(max_drop={ACC: LIMIT_PTS}, candidates=method)).chosen != "bf16"


@pytest.mark.parametrize("method", ["fixed_sequence", "bonferroni"])
def test_the_chance_of_shipping_a_variant_over_its_limit_stays_the_level_for_1_to_10_candidates(method):
    """Each of K candidates truly at its 1-pt limit (its observed drop ~ N(1 pt, 0.5 pt), the worst case of the
    null): pick ships one at most 2.5% of the time. 400 seeded draws per K; the bound allows three binomial
    standard errors per K (4.8%) and over all 4,000 draws (3.2%). Uncorrected, K = 10 ships over 15% of the time."""
    rng = np.random.default_rng(45)
    shipped = []
    for k in range(1, 11):
        drops = rng.normal(LIMIT_PTS, SE_PTS, size=(DRAWS, k))
        rate = np.mean([_ships_over(method, k, row) for row in drops])
        assert rate <= 0.025 + 3 * math.sqrt(0.025 * 0.975 / DRAWS), (k, rate)
        shipped.append(rate)
    assert np.mean(shipped) <= 0.025 + 3 * math.sqrt(0.025 * 0.975 / (10 * DRAWS))


def test_uncorrected_the_chance_grows_with_the_candidates():
    rng = np.random.default_rng(45)
    drops = rng.normal(LIMIT_PTS, SE_PTS, size=(DRAWS, 10))
    rate = np.mean([_ships_over("none", 10, row) for row in drops])
    assert rate > 0.15  # 1 - 0.975^10 = 22%


# --- the chosen variant's figures, adjusted for having been chosen ---

TRUE_DROP_PTS, SELECTED_SE_PTS = 0.7, 0.25


def test_the_chosen_variants_adjusted_interval_covers_its_true_drop_at_95_percent():
    """Three candidates each truly 0.7 pt down (observed ~ N(0.7, 0.25) pt, limit 1 pt: one passes when its draw
    is at most 0.51 pt, 22% of the time), the cheapest passing one shipped (each candidate's own pass is what
    selects it: their draws are independent). Its plain 95% interval covers the truth 89% of the time; the interval
    given that it passed, 95% (three binomial standard errors allowed). Seeded, 1,500 draws."""
    rng = np.random.default_rng(2)
    adjusted, plain = [], []
    z = stats.norm.ppf(0.975)
    se = SELECTED_SE_PTS / 100
    for drops in rng.normal(TRUE_DROP_PTS, SELECTED_SE_PTS, size=(1500, 3)):
        variants = [baseline(), *(_sized(f"c{i}", 200e6 - i * 1e6, drops[i], se) for i in range(3))]
        decision = decide(variants, only(max_drop={ACC: LIMIT_PTS}, candidates="none"))
        if decision.chosen == "bf16":
            continue
        (check,) = decision.verdict(decision.chosen).checks
        truth = TRUE_DROP_PTS / 100
        high = math.inf if check.selected_high is None else check.selected_high
        adjusted.append(check.selected_low <= truth <= high)
        plain.append(abs(check.drop - truth) <= z * se)
    chosen = len(adjusted)
    assert chosen > 600  # about half the draws ship one
    assert np.mean(adjusted) >= 0.95 - 3 * math.sqrt(0.05 * 0.95 / chosen), np.mean(adjusted)
    assert np.mean(plain) < np.mean(adjusted) - 0.02  # the winner's curse the adjustment removes


def _binary_candidate(name: str, weights: float, n: int, to_wrong: int, to_right: int) -> VariantSummary:
    """A candidate whose ACC changed on 0/1 scores of n documents with these flips, logged as a sweep logs them."""
    comparison = leaf_comparison(n, to_wrong, to_right, BASELINE_METRICS[ACC])
    metrics = {WEIGHTS: weights, ACC: comparison.variant}
    metrics |= {paired_key(ACC, stat): value for stat, value in comparison.statistics().items()}
    return VariantSummary(name, name, True, metrics, declared=DECLARED)


@pytest.mark.parametrize(
    ("n", "to_wrong", "to_right", "limit_pts"),
    [
        (1319, 0.035, 0.025, 2),  # GSM8K-sized, 1 pt down
        (300, 0.05, 0.03, 3),  # 2 pts down, near the limit: one of the three passes in a fifth of the draws
        (100, 0.03, 0.01, 8),
        (40, 0.05, 0.0, 12),  # the bundled MMLU's 40: only a draw without a flip passes, 5 pts down in truth
    ],
)
def test_on_0_1_scores_the_adjusted_interval_covers_the_true_drop_at_95_percent(n, to_wrong, to_right, limit_pts):
    """As above, on flips drawn per document (rates `to_wrong`, `to_right`): the interval rests on the se that Tango's
    interval implies. On Agresti and Min's Wald se, the 40-document case covered the truth 0% of the time (a draw
    without flips got +-4.7 pts where Tango's interval is +-8.8) and the 100-document one 90.1%. Seeded, 1,500 draws."""
    rng = np.random.default_rng(3)
    truth = to_wrong - to_right
    covered = []
    for draws in rng.multinomial(n, [to_wrong, to_right, 1 - to_wrong - to_right], size=(1500, 3)):
        variants = [baseline(), *(_binary_candidate(f"c{i}", 200e6 - i * 1e6, n, *draws[i][:2]) for i in range(3))]
        decision = decide(variants, only(max_drop={ACC: limit_pts}, candidates="none"))
        if decision.chosen == "bf16":
            continue
        (check,) = decision.verdict(decision.chosen).checks
        covered.append(
            check.selected_low <= truth <= (math.inf if check.selected_high is None else check.selected_high)
        )
    assert len(covered) > 200
    assert np.mean(covered) >= 0.95 - 3 * math.sqrt(0.05 * 0.95 / len(covered)), np.mean(covered)


def test_the_recommendation_says_its_figures_are_selected_with_the_adjusted_intervals():
    # A drop of 0.5 pt with se 0.2 pt passes a 1-pt limit near its edge (bound 0.89 pt): given that it passed, the
    # truth may be larger than its plain interval [0.11, 0.89] pts says ([0.13, 1.89] pts); at the edge itself (0.6
    # pt, bound 0.99 pt) nothing bounds it above; far within the limit the plain interval stands.
    near = decide([baseline(), _sized("fp8", 170e6, 0.5, 0.2 / 100)], only(max_drop={ACC: LIMIT_PTS}))
    (check,) = near.verdict("fp8").checks
    assert check.selected_high > check.drop + 2 * z_plain(check) and check.selected_low > check.drop - z_plain(check)
    edge = decide([baseline(), _sized("fp8", 170e6, 0.6, 0.2 / 100)], only(max_drop={ACC: LIMIT_PTS}))
    (at_edge,) = edge.verdict("fp8").checks
    assert at_edge.selected_high is None and at_edge.selected_words.endswith("no upper bound]")
    far = decide([baseline(), _sized("fp8", 170e6, 0.2, 0.1 / 100)], only(max_drop={ACC: LIMIT_PTS}))
    (plain,) = far.verdict("fp8").checks
    assert plain.selected_low == pytest.approx(plain.drop - z_plain(plain), rel=1e-3)
    assert plain.selected_high == pytest.approx(plain.drop + z_plain(plain), rel=1e-3)
    # 32 documents, one answer changed, passing a 16-pt limit near its edge: the interval given that it passed reaches
    # past 100 pts above (a drop no 0-1 score can have), so it has no upper bound.
    few = decide([baseline(), _binary_candidate("fp8", 170e6, 32, 1, 0)], only(max_drop={ACC: 16}))
    (sparse,) = few.verdict("fp8").checks
    assert sparse.status is CheckStatus.PASSED and sparse.selected_high is None and -1 < sparse.selected_low < 0
    assert sparse.selected_words.endswith("no upper bound]")
    decision = near
    assert decision.chosen == "fp8"
    words = decision.selection_words
    assert words.startswith("fp8's figures are selected") and check.selected_words in words
    assert decision.to_dict()["selection"] == words
    assert decide([baseline()], only(max_drop={ACC: LIMIT_PTS})).selection_words == ""  # the baseline: no drop


def z_plain(check) -> float:
    """The plain two-sided 95% half-width of a check's drop, from its one-sided bound."""
    return (check.upper - check.drop) * stats.norm.ppf(0.975) / stats.norm.ppf(1 - check.alpha)
