"""Picking under a policy: non-inferiority verdicts from paired statistics, every rejection reason,
undecided variants, tie-breaks, the decision record."""

from __future__ import annotations

import itertools
import json
import math
from functools import cache, partial

import numpy as np
import pytest
from scipy import optimize, stats

from quantlab.decision import CheckStatus, DecisionError, Status, pick
from quantlab.frontier import Axis, VariantSummary
from quantlab.metrics import Declared, Scale, paired_key
from quantlab.paired import (
    Aggregation,
    DocumentScores,
    Group,
    Outcome,
    PairedComparison,
    agresti_min_se,
    combine,
    compare,
    flip_interval,
    holm_alphas,
    paired_binary_non_inferiority,
    paired_binary_over_p,
    tango_restricted_rate,
    tango_statistic,
)
from quantlab.policy import Policy, PolicyError
from quantlab.serving.goodput import NOT_STOCK_TAG

ACC = "eval/mmlu_dev/acc"
CLOZE = "eval/cloze/acc"
KLD = "quality/kld_mean"
PPL = "quality/ppl"
TOP1 = "quality/top1_agreement"
WEIGHTS = "cost/weight_bytes"
PEAK = "cost/peak_memory_bytes"
DECODE = "cost/decode_tokens_per_s"
TTFT = "cost/ttft_ms_p99"

BY_SIZE = Axis(WEIGHTS, higher_is_better=False)
BY_SPEED = Axis(DECODE, higher_is_better=True)
Z = stats.norm.ppf(0.975)  # one-sided 97.5%: the policy's default level (2.5% one-sided)
Z95 = stats.norm.ppf(0.95)  # one-sided 95%, the level before issue 28

DECLARED = {ACC: Declared(True, Scale.FRACTION), CLOZE: Declared(True, Scale.FRACTION)}
BASELINE_METRICS = {
    ACC: 0.50,
    CLOZE: 0.60,
    KLD: 0.0,
    TOP1: 1.0,
    PPL: 10.0,
    WEIGHTS: 270e6,
    PEAK: 1.2e9,
    DECODE: 40.0,
    TTFT: 100.0,
}
N = 1000
SE = 0.001  # a paired standard error small enough that verdicts follow the point estimate


def paired(metric: str, diff: float, se: float, n: int) -> dict[str, float]:
    return {paired_key(metric, "diff"): diff, paired_key(metric, "se"): se, paired_key(metric, "n"): float(n)}


def baseline(**overrides: float) -> VariantSummary:
    return VariantSummary("bf16", "bf16", True, {**BASELINE_METRICS, **overrides}, is_baseline=True, declared=DECLARED)


def candidate(
    name: str = "fp8",
    *,
    drop: tuple[str, ...] = (),
    unpaired: tuple[str, ...] = (),
    succeeded: bool = True,
    se: float = SE,
    **overrides: float,
) -> VariantSummary:
    """A cheaper variant close to the baseline: `overrides` change metrics, and each eval score
    gets paired figures against the baseline (diff from the values, standard error `se`);
    `drop` removes metrics and their paired figures, `unpaired` only the paired figures."""
    metrics = {**BASELINE_METRICS, KLD: 0.03, TOP1: 0.9, WEIGHTS: 170e6, **overrides}
    for metric in (ACC, CLOZE):
        metrics |= paired(metric, metrics[metric] - BASELINE_METRICS[metric], se, N)
    removed = [*drop, *(f"quality/paired/{metric}/" for metric in (*drop, *unpaired))]
    kept = {
        k: v for k, v in metrics.items() if not any(k == r or (r.endswith("/") and k.startswith(r)) for r in removed)
    }
    return VariantSummary(name, name, succeeded, kept, declared=DECLARED)


def decide(variants, policy: Policy, objective: Axis = BY_SIZE):
    return pick(variants, "bf16", policy, objective)


def only(**fields) -> Policy:
    """A policy with just these limits (no implicit any-task limit)."""
    return Policy(**{"max_drop_any_task": None, **fields})


# --------------------------------------------------------------------------------------
# Non-inferiority from paired statistics, against hand computations and scipy
# --------------------------------------------------------------------------------------


def documents(
    right_to_wrong: int, wrong_to_right: int, both_right: int, both_wrong: int
) -> tuple[DocumentScores, DocumentScores]:
    """Synthetic 0/1 per-document scores of baseline and variant with the given flips."""
    pairs = [(1, 0)] * right_to_wrong + [(0, 1)] * wrong_to_right + [(1, 1)] * both_right + [(0, 0)] * both_wrong
    base = DocumentScores(Aggregation.MEAN, {i: float(b) for i, (b, _) in enumerate(pairs)})
    variant = DocumentScores(Aggregation.MEAN, {i: float(v) for i, (_, v) in enumerate(pairs)})
    return base, variant


def summaries(base_docs: DocumentScores, variant_docs: DocumentScores) -> list[VariantSummary]:
    """Baseline and variant as their runs log them: the score, and the paired figures from `compare`."""
    comparison = compare("mmlu_dev", base_docs, variant_docs)
    logged = {paired_key(ACC, stat): value for stat, value in comparison.statistics().items()}
    base = VariantSummary(
        "bf16", "bf16", True, {ACC: base_docs.aggregate(), WEIGHTS: 270e6}, is_baseline=True, declared=DECLARED
    )
    variant = VariantSummary(
        "int4", "int4", True, {ACC: variant_docs.aggregate(), WEIGHTS: 90e6, **logged}, declared=DECLARED
    )
    return [base, variant]


def restricted_log_likelihood(q: float, worse: int, better: int, rest: int, delta: float) -> float:
    """Of paired 0/1 scores with p_better = q and p_worse = q + delta (every cell observed)."""
    return worse * math.log(q + delta) + better * math.log(q) + rest * math.log(1 - 2 * q - delta)


def score_test_documents(worse_rate: float, better_rate: float, limit: float, z_level: float, z_power: float) -> float:
    """The score test's sample size by hand, ((z_level sd_0 + z_power sd) / (limit - drop))^2: sd the per-document sd of
    worse - better at these rates, sd_0 its null one at the limit, sqrt(2 q + limit (1 - limit)), q Tango's
    restricted rate of wrong->right flips."""
    drop = worse_rate - better_rate
    sd = math.sqrt(worse_rate + better_rate - drop**2)
    sd_0 = math.sqrt(2 * tango_restricted_rate(1, worse_rate, better_rate, limit) + limit * (1 - limit))
    return ((z_level * sd_0 + z_power * sd) / (limit - drop)) ** 2


def test_the_issue_example_is_shown_over_a_one_point_limit():
    # n = 1000, 0.60 -> 0.58 through 25 right->wrong and 5 wrong->right.
    variants = summaries(*documents(25, 5, 575, 395))
    logged = variants[1].metrics

    # By hand: per-document differences are -1 (25x), +1 (5x), 0 (970x); mean -0.02;
    # sample variance (30 - 1000 * 0.02^2) / 999 = 29.6 / 999; se = sqrt(that / 1000) = 0.5443 pts.
    assert logged[ACC] == pytest.approx(0.58)
    assert logged[paired_key(ACC, "diff")] == pytest.approx(-0.02)
    assert logged[paired_key(ACC, "se")] == pytest.approx(math.sqrt(29.6 / 999 / 1000))
    assert logged[paired_key(ACC, "se")] * 100 == pytest.approx(0.544, abs=5e-4)
    # Exact McNemar: 2 * P(X <= 5), X ~ Binomial(30, 1/2) = 2 * 174437 / 2^30 = 3.25e-4.
    assert logged[paired_key(ACC, "p_value")] == pytest.approx(2 * 174437 / 2**30)
    assert logged[paired_key(ACC, "p_value")] == pytest.approx(stats.binomtest(25, 30, 0.5).pvalue)

    decision = decide(variants, only(max_drop={ACC: 1}, one_sided_alpha=0.05))

    (check,) = decision.verdict("int4").checks
    # 0/1 scores are judged on Tango's score bounds from the flips (issue 45): each is the null drop at which the
    # score statistic meets the one-sided quantile, here 1.16 and 3.00 pts. "Shown over" also needs the Wald bound on
    # Agresti and Min's se over the limit (Tango's is liberal where few documents flip), so the lower bound reported
    # is the smaller of the two: 2.00 - 1.645 * 0.5521 = 1.09 pts, with se = sqrt(25.5 + 5.5 - 20^2 / 1002) / 1002.
    tango_lower = optimize.brentq(lambda drop: tango_statistic(1000, 25, 5, drop) - Z95, 0.0, 0.02, xtol=1e-12)
    wald_lower = 0.02 - Z95 * math.sqrt(31 - 20**2 / 1002) / 1002
    assert agresti_min_se(1000, 25, 5) == pytest.approx(math.sqrt(31 - 20**2 / 1002) / 1002)
    assert tango_lower == pytest.approx(0.01157, abs=1e-5) and wald_lower == pytest.approx(0.01092, abs=1e-5)
    assert check.outcome is Outcome.OVER and check.status is CheckStatus.FAILED
    assert check.drop == pytest.approx(0.02)
    assert check.lower == pytest.approx(min(tango_lower, wald_lower))
    assert tango_statistic(1000, 25, 5, check.upper) == pytest.approx(-Z95)
    assert check.lower > 0.01  # even the optimistic end of both tests loses more than a point
    assert check.detail == (
        f"{ACC}: shown over the limit: drop 2.00 pts, one-sided 95% bounds from the flips "
        "[1.09 pts, 3.00 pts], limit 1 pt (paired, n=1,000)"
    )
    assert decision.verdict("int4").status is Status.REJECTED
    assert decision.chosen == "bf16"
    # At the default one-sided 2.5% (issue 28) the same evidence does not show it: Tango's lower bound is 0.997 pts,
    # the Wald one 2.00 - 1.960 * 0.5521 = 0.918 pts, and the p of "shown over" the larger of theirs, 0.0350 (Wald's;
    # Tango's 0.0253).
    (default,) = decide(variants, only(max_drop={ACC: 1})).verdict("int4").checks
    assert default.outcome is Outcome.UNSURE and default.lower == pytest.approx(0.00918, abs=1e-5)
    assert default.lower == pytest.approx(0.02 - Z * agresti_min_se(1000, 25, 5))
    assert tango_statistic(1000, 25, 5, 0.00997) == pytest.approx(Z, abs=1e-3)
    assert paired_binary_over_p(1000, 25, 5, 0.01) == pytest.approx(stats.norm.sf(0.01 / agresti_min_se(1000, 25, 5)))
    assert "one-sided 97.5% bounds from the flips [0.92 pts, 3.22 pts]" in default.detail


def test_the_same_flip_rate_is_undecided_on_40_documents_and_shown_within_on_4000():
    # 5% of documents flip each way: no drop on average, and a spread that only many documents tame.
    small = decide(summaries(*documents(2, 2, 18, 18)), only(max_drop={ACC: 1}))
    large = decide(summaries(*documents(200, 200, 1800, 1800)), only(max_drop={ACC: 1}))

    (unsure,) = small.verdict("int4").checks
    assert unsure.outcome is Outcome.UNSURE and unsure.status is CheckStatus.UNDECIDED
    # Tango's upper bound: where the score statistic falls to -z_0.975, 12.52 pts.
    assert tango_statistic(40, 2, 2, unsure.upper) == pytest.approx(-Z)
    assert unsure.upper == pytest.approx(0.12519, abs=1e-5)
    # Documents that settle it with 80% power, the score test's sample size at the same flip rates (5% each way):
    # ((z_0.975 sd_0 + z_0.8 sd) / 0.01)^2, sd = sqrt(0.1) = 0.316228 the observed per-document sd of worse - better,
    # sd_0 = sqrt(2 q + 0.01 * 0.99) = 0.317478 the null one at the limit, q = (sqrt(0.08^2 + 8 * 0.000495) + 0.08) / 4
    # = 0.045446 (Tango's restricted rate): (1.959964 * 0.317478 + 0.841621 * 0.316228) / 0.01 = 88.839; 7892.3 -> 7893.
    assert tango_restricted_rate(40, 2, 2, 0.01) == pytest.approx(0.045446, abs=1e-6)
    assert unsure.documents_needed == 7893
    assert "not enough evidence" in unsure.detail
    assert "about 7,893 documents would settle it (80% power)" in unsure.detail
    assert small.verdict("int4").status is Status.UNDECIDED
    assert small.chosen == "bf16"  # "not enough evidence" is not a pass
    assert "int4 would need ~7,893 documents" in small.summary

    (within,) = large.verdict("int4").checks
    # Upper bound 0.98 pts <= 1 pt.
    assert tango_statistic(4000, 200, 200, within.upper) == pytest.approx(-Z)
    assert within.outcome is Outcome.WITHIN and within.upper < 0.01
    assert large.chosen == "int4"


def test_the_documents_estimate_settles_it_at_that_size_with_the_policys_power():
    """A simulation of the claim: 7,893 documents flipping 5% each way (the 40-document task's rates) are shown
    within a point in about 80% of samples."""
    rng = np.random.default_rng(45)
    flips = rng.multinomial(7893, [0.05, 0.05, 0.9], size=1000)
    shown = [paired_binary_non_inferiority(7893, int(b), int(c), 0.01).outcome is Outcome.WITHIN for b, c, _ in flips]
    assert np.mean(shown) == pytest.approx(0.80, abs=0.03)


# (limit, paired diff of quality/ppl, its se): lower is better, so the drop is +diff.
@pytest.mark.parametrize(
    ("limit", "diff", "se", "outcome"),
    [
        pytest.param("+2%", 0.05, 0.01, Outcome.WITHIN, id="relative-within"),  # 0.05 + 1.96*0.01 <= 0.2
        pytest.param(0.06, 0.05, 0.01, Outcome.UNSURE, id="own-unit-straddles"),  # [0.0304, 0.0696] around 0.06
        pytest.param(0.03, 0.05, 0.01, Outcome.OVER, id="own-unit-over"),  # 0.0304 > 0.03
        pytest.param(0.0, -0.5, 0.01, Outcome.WITHIN, id="an-improvement-passes-a-zero-limit"),
    ],
)
def test_lower_is_better_metrics_in_their_own_units(limit, diff, se, outcome):
    # The reported bug: `quality/ppl=1` rejected 10.00 -> 10.05 as "dropped 5 pts".
    variant = candidate(**{PPL: 10.0 + diff}, **paired(PPL, diff, se, 2000))

    (check,) = decide([baseline(), variant], only(max_drop={PPL: limit})).verdict("fp8").checks

    assert check.outcome is outcome
    assert check.drop == pytest.approx(diff)
    assert (check.lower, check.upper) == (pytest.approx(diff - Z * se), pytest.approx(diff + Z * se))
    assert "pts" not in check.detail


def test_without_paired_statistics_a_drop_is_undecided_never_passed_on_unpaired_stderr():
    # Same score and a tiny unpaired stderr: the old code passed this; paired figures are missing.
    variant = candidate(unpaired=(ACC,), **{ACC: 0.50, f"{ACC}_stderr": 1e-6})

    decision = decide([baseline(**{f"{ACC}_stderr": 1e-6}), variant], only(max_drop={ACC: 1}))

    (check,) = decision.verdict("fp8").checks
    assert check.status is CheckStatus.UNDECIDED and check.outcome is Outcome.UNSURE
    assert check.detail == f"{ACC}: not enough evidence: no paired statistics logged (50.0% -> 50.0%)"
    assert decision.verdict("fp8").status is Status.UNDECIDED
    assert decision.chosen == "bf16"
    assert f"fp8 has no paired statistics for {ACC}." in decision.summary


def test_a_drop_of_exactly_the_limit_passes_despite_float_rounding():
    # 0.50 - 0.49 is 0.010000000000000009 in binary floating point; no spread at all.
    decision = decide([baseline(), candidate(se=0.0, **{ACC: 0.49})], only(max_drop={ACC: 1}))

    assert decision.chosen == "fp8"


# --------------------------------------------------------------------------------------
# Rejection reasons
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "variant", "expected_reason"),
    [
        pytest.param(
            only(max_drop={ACC: 1}),
            candidate(**{ACC: 0.48}),
            f"{ACC}: shown over the limit: drop 2.00 pts, one-sided 97.5% bounds [1.80 pts, 2.20 pts], limit 1 pt (paired, n=1,000)",
            id="task-drop",
        ),
        pytest.param(
            Policy(max_drop_any_task=1),
            candidate(**{CLOZE: 0.55}),
            # Two drop checks (mmlu_dev and cloze): "over" at Holm's 0.025 / 2 for the smaller p, 5 - 2.2414 * 0.1.
            f"{CLOZE}: shown over the limit: drop 5.00 pts, one-sided bounds [4.78 pts at 98.75% (Holm, 2 checks), "
            "5.20 pts at 97.5%], limit 1 pt (paired, n=1,000)",
            id="any-task-drop",
        ),
        pytest.param(
            only(max_drop={ACC: 1}), candidate(drop=(ACC,)), f"missing metric {ACC}", id="missing-task-metric"
        ),
        pytest.param(
            Policy(max_drop_any_task=1),
            candidate(drop=(CLOZE,)),
            f"missing metric {CLOZE}",
            id="missing-metric-of-any-task-limit",
        ),
        pytest.param(only(max_kld=0.1), candidate(**{KLD: 0.18}), f"{KLD} is 0.18, above the maximum of 0.1", id="kld"),
        pytest.param(only(max_kld=0.1), candidate(drop=(KLD,)), f"missing metric {KLD}", id="missing-kld"),
        pytest.param(
            only(min_top1_agreement=0.95),
            candidate(**{TOP1: 0.9}),
            f"{TOP1} is 90.0%, below the minimum of 95.0%",
            id="top1",
        ),
        pytest.param(
            only(max_peak_memory_bytes=1e9),
            candidate(**{PEAK: 1.1e9}),
            f"{PEAK} is 1.1 GB, above the maximum of 1.0 GB",
            id="peak-memory",
        ),
        pytest.param(
            only(max_peak_memory_bytes=1e9), candidate(drop=(PEAK,)), f"missing metric {PEAK}", id="missing-peak-memory"
        ),
        pytest.param(
            only(at_most={TTFT: 50.0}),
            candidate(),
            f"{TTFT} is 100.0 ms, above the maximum of 50.0 ms",
            id="generic-upper",
        ),
        pytest.param(
            only(at_least={DECODE: 60.0}),
            candidate(),
            f"{DECODE} is 40.0 tok/s, below the minimum of 60.0 tok/s",
            id="generic-lower",
        ),
        pytest.param(
            only(), candidate(drop=(WEIGHTS,)), f"missing metric {WEIGHTS} (the objective)", id="missing-objective"
        ),
        pytest.param(only(), candidate(succeeded=False), "failed", id="failed"),
    ],
)
def test_each_rejection_reason(policy, variant, expected_reason):
    decision = decide([baseline(), variant], policy)

    verdict = decision.verdict(variant.name)
    assert verdict.status in (Status.REJECTED, Status.FAILED)
    assert expected_reason in verdict.reasons
    assert decision.chosen != variant.name


def test_every_failed_limit_is_listed_not_only_the_first():
    variant = candidate(**{ACC: 0.40, KLD: 0.5, TOP1: 0.5})

    decision = decide([baseline(), variant], only(max_drop={ACC: 1}, max_kld=0.1, min_top1_agreement=0.8))

    assert len(decision.verdict("fp8").reasons) == 3


def test_a_rejected_variant_also_lists_what_is_undecided():
    variant = candidate(unpaired=(CLOZE,), **{KLD: 0.5, CLOZE: 0.6})

    reasons = decide([baseline(), variant], only(max_drop={CLOZE: 1}, max_kld=0.1)).verdict("fp8").reasons

    assert reasons == (
        f"{KLD} is 0.5, above the maximum of 0.1",
        f"{CLOZE}: not enough evidence: no paired statistics logged (60.0% -> 60.0%)",
    )


def test_improvements_pass_drop_limits():
    decision = decide([baseline(), candidate(**{ACC: 0.7})], only(max_drop={ACC: 0}))

    assert decision.chosen == "fp8"


def test_nothing_shown_within_says_what_would_settle_it():
    undecided = candidate("int4", se=0.02, **{ACC: 0.50, WEIGHTS: 90e6, PEAK: 0.9e9})
    variants = [baseline(), undecided, candidate(**{ACC: 0.40, PEAK: 0.9e9})]

    decision = decide(variants, only(max_drop={ACC: 1}, max_peak_memory_bytes=1e9))

    assert decision.chosen is None
    # se 2 pts over 1000 documents: sd = 0.02 * sqrt(1000); n = ((z_0.975 + z_0.8) * sd / 0.01)^2
    # = (2.801585 * 0.632456 / 0.01)^2 = 177.19^2 = 31,395.5 -> 31,396.
    needed = math.ceil(((Z + stats.norm.ppf(0.8)) * 0.02 * math.sqrt(1000) / 0.01) ** 2)
    assert needed == 31396
    assert decision.verdict("int4").documents_needed == needed
    assert decision.summary.startswith("No variant shown within the limits; nothing chosen")
    assert "int4 would need ~31,396 documents" in decision.summary
    assert [v.status for v in decision.verdicts] == [Status.UNDECIDED, Status.REJECTED, Status.REJECTED]


def test_satisfying_but_more_expensive_variants_say_so():
    decision = decide([baseline(), candidate()], Policy(max_drop_any_task=1))

    assert decision.chosen == "fp8"
    (reason,) = decision.verdict("bf16").reasons
    assert reason == "costs more: cost/weight_bytes 270.0 MB vs 170.0 MB for fp8"
    assert decision.verdict("bf16").status is Status.COSTS_MORE


def test_no_variant_satisfying_gives_no_choice_and_reasons_for_all():
    variants = [baseline(**{PEAK: 2e9}), candidate(**{PEAK: 3e9}), candidate("broken", succeeded=False)]

    decision = decide(variants, only(max_peak_memory_bytes=1e9))

    assert decision.chosen is None
    assert {v.name for v in decision.verdicts} == {"bf16", "fp8", "broken"}
    assert all(v.reasons for v in decision.verdicts)
    assert decision.summary.startswith("No variant satisfies")


def test_baseline_that_failed_cannot_vouch_for_drops():
    failed_baseline = VariantSummary("bf16", "bf16", False, {}, is_baseline=True)

    decision = decide([failed_baseline, candidate()], Policy(max_drop_any_task=1))

    assert decision.chosen is None
    assert any("baseline bf16 failed" in reason for reason in decision.verdict("fp8").reasons)


def test_baseline_that_failed_is_irrelevant_without_drop_limits():
    failed_baseline = VariantSummary("bf16", "bf16", False, {}, is_baseline=True)

    assert decide([failed_baseline, candidate()], only(max_kld=0.1)).chosen == "fp8"


def test_baseline_lacking_the_metric_rejects_instead_of_passing():
    decision = decide([baseline(), candidate()], only(max_drop={"eval/mmlu/acc": 1}))

    assert decision.chosen is None
    assert decision.verdict("fp8").reasons == ("baseline lacks metric eval/mmlu/acc",)


def test_a_limit_that_does_not_fit_the_sweeps_metric_is_an_error_not_a_verdict():
    word_ppl = "eval/wikitext/word_perplexity"
    base = VariantSummary(
        "bf16",
        "bf16",
        True,
        {word_ppl: 20.0, WEIGHTS: 270e6},
        is_baseline=True,
        declared={word_ppl: Declared(False, Scale.PERPLEXITY)},
    )

    with pytest.raises(PolicyError, match="points do not apply"):
        pick([base], "bf16", only(max_drop={word_ppl: "1 pts"}), BY_SIZE)


def test_unknown_baseline_name_is_an_error():
    with pytest.raises(DecisionError, match="'fp16' is not among the variants"):
        pick([baseline(), candidate()], "fp16", only(), BY_SIZE)


def test_scores_the_any_task_limit_cannot_check_are_named():
    declared = {**DECLARED, "eval/custom/bleu": Declared(None, Scale.SCORE)}
    base = VariantSummary(
        "bf16", "bf16", True, {**BASELINE_METRICS, "eval/custom/bleu": 12.0}, is_baseline=True, declared=declared
    )

    decision = decide([base, candidate()], Policy())

    assert decision.unchecked == ("eval/custom/bleu (better direction unknown)",)


# --------------------------------------------------------------------------------------
# Choice and tie-breaks
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variants", "objective", "expected"),
    [
        pytest.param(
            [candidate("int4", **{WEIGHTS: 90e6}), candidate("fp8", **{WEIGHTS: 170e6})],
            BY_SIZE,
            "int4",
            id="smallest-weights",
        ),
        pytest.param(
            [candidate("a", **{DECODE: 50.0}), candidate("b", **{DECODE: 80.0})],
            BY_SPEED,
            "b",
            id="fastest-when-higher-is-better",
        ),
        pytest.param(
            [candidate("a", **{ACC: 0.495}), candidate("b", **{ACC: 0.50})],
            BY_SIZE,
            "b",
            id="tie-on-cost-smaller-drop-wins",
        ),
        pytest.param(
            [candidate("a", **{KLD: 0.05}), candidate("b", **{KLD: 0.02})],
            BY_SIZE,
            "b",
            id="tie-on-cost-and-drop-lower-kld-wins",
        ),
        pytest.param([candidate("b"), candidate("a")], BY_SIZE, "a", id="full-tie-name-wins"),
    ],
)
def test_pick_chooses_the_best_satisfying_variant(variants, objective, expected):
    policy = Policy(max_drop_any_task=1)

    for order in itertools.permutations([baseline(), *variants]):
        assert pick(list(order), "bf16", policy, objective).chosen == expected


def test_tie_loser_is_told_it_lost_the_tie_break():
    decision = decide([baseline(), candidate("b"), candidate("a")], only())

    (reason,) = decision.verdict("b").reasons
    assert "ties a" in reason


def test_verdicts_are_ordered_chosen_then_costs_more_undecided_rejected_failed():
    variants = [
        baseline(),
        candidate("int4", **{WEIGHTS: 90e6, ACC: 0.3}),
        candidate("fp8"),
        candidate("x", succeeded=False),
        candidate("w8", se=0.05, **{WEIGHTS: 180e6}),
    ]

    # Each candidate on its own evidence (a fixed sequence would stop at w8: tests/test_candidates.py)
    decision = decide(variants, Policy(max_drop_any_task=1, candidates="none"))

    assert [(v.name, v.status) for v in decision.verdicts] == [
        ("fp8", Status.CHOSEN),
        ("bf16", Status.COSTS_MORE),
        ("w8", Status.UNDECIDED),
        ("int4", Status.REJECTED),
        ("x", Status.FAILED),
    ]
    assert decision.summary.startswith("Chosen: fp8")
    assert "Better by the objective but not shown within the limits" not in decision.summary  # w8 costs more


def test_a_cheaper_undecided_variant_is_named_beside_the_choice():
    decision = decide([baseline(), candidate("int4", se=0.05, **{WEIGHTS: 90e6})], Policy(max_drop_any_task=1))

    assert decision.chosen == "bf16"
    assert "Better by the objective but not shown within the limits: int4 would need ~" in decision.summary


def test_decision_record_is_json_with_each_verdict_and_interval():
    decision = decide([baseline(), candidate()], only(max_drop={ACC: 1, PPL: "+2%"}, max_kld=0.1))

    record = json.loads(json.dumps(decision.to_dict()))

    assert record["chosen"] == "bf16"  # fp8 logged no paired ppl figures: undecided
    assert record["objective"] == {"metric": WEIGHTS, "higher_is_better": False}
    assert record["policy"]["max_drop"] == {ACC: 1.0, PPL: "+2%"}
    assert record["checks"] == [
        f"{ACC} at most 1 pt worse than the baseline",
        f"{PPL} at most +2% of the baseline (0.2) worse than the baseline",
        f"{KLD} at most 0.1",
    ]
    fp8 = next(v for v in record["variants"] if v["name"] == "fp8")
    assert fp8["status"] == "undecided"
    acc = fp8["checks"][0]
    assert acc["outcome"] == "shown within the limit" and acc["status"] == "passed"
    assert acc["drop"] == pytest.approx(0.0) and acc["upper"] == pytest.approx(Z * SE) and acc["limit"] == 0.01
    assert fp8["checks"][1]["outcome"] == "not enough evidence"


@pytest.mark.parametrize("seed", [0, 1])
def test_verdicts_agree_with_scipys_one_sided_bounds_on_random_documents(seed):
    rng = np.random.default_rng(seed)
    base = rng.random(500) < 0.6
    flip = rng.random(500) < 0.1
    variant = np.where(flip, ~base, base)
    base_docs = DocumentScores(Aggregation.MEAN, {i: float(b) for i, b in enumerate(base)})
    variant_docs = DocumentScores(Aggregation.MEAN, {i: float(v) for i, v in enumerate(variant)})

    (check,) = decide(summaries(base_docs, variant_docs), only(max_drop={ACC: 1})).verdict("int4").checks

    d = variant.astype(float) - base.astype(float)
    worse, better = int(np.sum(d < 0)), int(np.sum(d > 0))
    assert check.drop == pytest.approx(-d.mean())
    # Tango's upper bound by hand: there the score statistic, on the rate of wrong->right flips that maximises the
    # likelihood under the null drop (found by scipy), is -z_0.975.
    null = check.upper
    log_likelihood = partial(
        restricted_log_likelihood, worse=worse, better=better, rest=500 - worse - better, delta=null
    )
    rate = optimize.minimize_scalar(
        lambda q: -log_likelihood(q), bounds=(max(0, -null), (1 - null) / 2), method="bounded", options={"xatol": 1e-12}
    ).x
    statistic = (worse - better - 500 * null) / math.sqrt(500 * (2 * rate + null * (1 - null)))
    assert statistic == pytest.approx(-stats.norm.ppf(0.975), abs=1e-4)
    expected = Outcome.WITHIN if check.upper <= 0.01 else Outcome.OVER if check.lower > 0.01 else Outcome.UNSURE
    assert check.outcome is expected


def test_a_few_identical_answers_are_not_proof_of_no_loss():
    # 5 documents, no flip: the plain paired se is 0, but 5 documents cannot show a 1-point limit.
    (check,) = decide(summaries(*documents(0, 0, 3, 2)), only(max_drop={ACC: 1})).verdict("int4").checks
    assert check.drop == 0 and check.outcome is Outcome.UNSURE
    # Tango's bound without flips solves 5 d / (1 - d) = z^2: d = z^2 / (5 + z^2) = 43.4 pts.
    assert check.upper == pytest.approx(Z**2 / (5 + Z**2))
    assert "one-sided 97.5% bounds from the flips [-43.45 pts, 43.45 pts]" in check.detail
    # With 10,000 identical answers the same limit is shown.
    (many,) = decide(summaries(*documents(0, 0, 6000, 4000)), only(max_drop={ACC: 1})).verdict("int4").checks
    assert many.outcome is Outcome.WITHIN


# --------------------------------------------------------------------------------------
# Whole suites (issue 28): a group is one check by default; named leaves are many, Holm-corrected
# --------------------------------------------------------------------------------------

# MMLU's 57 subjects and their test-set sizes (14,042 questions in all; 24 subjects under 163), as the
# dataset card of cais/mmlu on Hugging Face lists them (dataset_info, split "test", num_examples).
MMLU_TEST_SIZES = {
    "abstract_algebra": 100, "anatomy": 135, "astronomy": 152, "business_ethics": 100, "clinical_knowledge": 265,
    "college_biology": 144, "college_chemistry": 100, "college_computer_science": 100, "college_mathematics": 100,
    "college_medicine": 173, "college_physics": 102, "computer_security": 100, "conceptual_physics": 235,
    "econometrics": 114, "electrical_engineering": 145, "elementary_mathematics": 378, "formal_logic": 126,
    "global_facts": 100, "high_school_biology": 310, "high_school_chemistry": 203,
    "high_school_computer_science": 100, "high_school_european_history": 165, "high_school_geography": 198,
    "high_school_government_and_politics": 193, "high_school_macroeconomics": 390,
    "high_school_mathematics": 270, "high_school_microeconomics": 238, "high_school_physics": 151,
    "high_school_psychology": 545, "high_school_statistics": 216, "high_school_us_history": 204,
    "high_school_world_history": 237, "human_aging": 223, "human_sexuality": 131, "international_law": 121,
    "jurisprudence": 108, "logical_fallacies": 163, "machine_learning": 112, "management": 103, "marketing": 234,
    "medical_genetics": 100, "miscellaneous": 783, "moral_disputes": 346, "moral_scenarios": 895, "nutrition": 306,
    "philosophy": 311, "prehistory": 324, "professional_accounting": 282, "professional_law": 1534,
    "professional_medicine": 272, "professional_psychology": 612, "public_relations": 110,
    "security_studies": 245, "sociology": 201, "us_foreign_policy": 100, "virology": 166, "world_religions": 171,
}  # fmt: skip
MMLU = "eval/mmlu/acc"
MMLU_LEAVES = tuple(f"eval/mmlu_{subject}/acc" for subject in MMLU_TEST_SIZES)
MMLU_DECLARED = {key: Declared(True, Scale.FRACTION) for key in (MMLU, *MMLU_LEAVES)}
MMLU_GROUP = Group(MMLU_LEAVES, tuple(n / 14042 for n in MMLU_TEST_SIZES.values()))  # lm-eval: weight_by_size


# The simulated sweeps below repeat the same small flip counts across thousands of leaves
_flip_interval = cache(flip_interval)


def leaf_comparison(n: int, to_wrong: int, to_right: int, correct: float = 0.6) -> PairedComparison:
    """What `compare` gives for n 0/1 documents with these flips, without building them (checked against
    `compare` below): diff (c - b) / n, plain paired se sqrt((b + c - n diff^2) / (n - 1) / n), the interval a verdict
    on the flips judges by. Its McNemar p is left out (nan): no verdict reads it, and 57 exact tests per simulated
    sweep would dominate the test's time."""
    diff = (to_right - to_wrong) / n
    se = math.sqrt((to_wrong + to_right - n * diff**2) / (n - 1) / n)
    low, high = _flip_interval(n, to_wrong, to_right)
    return PairedComparison(
        n, correct, correct + diff, diff, se, low, high, math.nan, "mcnemar_exact", to_wrong, to_right
    )


def test_the_hand_built_leaf_comparison_is_compares():
    built, real = leaf_comparison(100, 3, 1, 0.6), compare("x", *documents(3, 1, 57, 39))
    assert (built.diff, built.se, built.ci95_low, built.ci95_high) == pytest.approx(
        (real.diff, real.se, real.ci95_low, real.ci95_high)
    )
    assert (built.correct_to_wrong, built.wrong_to_correct) == (3, 1)


def logged_flips(variant: VariantSummary, metric: str) -> tuple[int, int]:
    return tuple(int(variant.value(paired_key(metric, name))) for name in ("correct_to_wrong", "wrong_to_correct"))


def mmlu_sweep(rng: np.random.Generator, flip_rate: float) -> list[VariantSummary]:
    """Baseline and an fp8 variant that loses nothing on average: each question flips with probability
    `flip_rate`, either way alike. Logged as a sweep logs them: leaves, and the group combined from them."""
    leaves = {}
    for key, n in zip(MMLU_LEAVES, MMLU_TEST_SIZES.values()):
        to_wrong, to_right, _ = rng.multinomial(n, [flip_rate / 2, flip_rate / 2, 1 - flip_rate])
        leaves[key] = leaf_comparison(n, int(to_wrong), int(to_right))
    comparisons = leaves | {MMLU: combine(list(leaves.values()), MMLU_GROUP.weights)}
    logged = {paired_key(key, stat): value for key, c in comparisons.items() for stat, value in c.statistics().items()}
    scores = {key: c.variant for key, c in comparisons.items()}
    base_metrics = {**dict.fromkeys(comparisons, 0.6), WEIGHTS: 270e6}
    base = VariantSummary("bf16", "bf16", True, base_metrics, is_baseline=True, declared=MMLU_DECLARED)
    return [base, VariantSummary("fp8", "fp8", True, {**scores, **logged, WEIGHTS: 170e6}, declared=MMLU_DECLARED)]


@pytest.mark.parametrize("flip_rate", [0.02, 0.04, 0.06])
def test_the_default_policy_passes_an_unharmed_variant_on_mmlu(flip_rate):
    """Issue 28: with every subject its own 1-point check the default policy could never pass such a variant
    (51 subjects have under 381 questions: even with no flip Tango's bound, z^2 / (n + z^2), is above a point).
    By default the group is one check, its size-weighted aggregate: 14,042 questions."""
    rng = np.random.default_rng(2028)
    runs = 400
    passed = 0
    for _ in range(runs):
        decision = pick(mmlu_sweep(rng, flip_rate), "bf16", Policy(), BY_SIZE, groups={MMLU: MMLU_GROUP})
        passed += decision.chosen == "fp8"
    assert decision.checks == (f"{MMLU} at most 1 pt worse than the baseline",)
    assert decision.grouped == (f"{MMLU} (one check for its 57 leaves; name a leaf in max_drop to check it alone)",)
    assert decision.verdict("fp8").basis == "1 check: 1 drop limit"
    assert passed / runs >= 0.95


@pytest.mark.parametrize(("flip_rate", "uncorrected_at_least"), [(0.02, 0.005), (0.06, 0.20)])
def test_named_mmlu_subjects_are_held_to_holms_family_wise_rate(flip_rate, uncorrected_at_least):
    """Every subject named: 57 checks. "Shown over" on any subject rejects the variant, so without a correction
    an unharmed variant is rejected by chance on some subject; Holm holds that to the policy's 2.5%. (Passing
    needs every subject shown within a point, which the small ones cannot: not enough evidence, never a pass.)"""
    rng = np.random.default_rng(57)
    policy = only(max_drop=dict.fromkeys(MMLU_LEAVES, 1))
    runs, rejected, uncorrected = 300, 0, 0
    for _ in range(runs):
        variants = mmlu_sweep(rng, flip_rate)
        verdict = pick(variants, "bf16", policy, BY_SIZE, groups={MMLU: MMLU_GROUP}).verdict("fp8")
        rejected += verdict.status is Status.REJECTED
        # The same checks each at 2.5% alone, as before the correction.
        uncorrected += any(
            paired_binary_over_p(check.n, *logged_flips(variants[1], check.metric), 0.01) < 0.025
            for check in verdict.checks
        )
    assert len(verdict.checks) == 57 and {check.family for check in verdict.checks} == {57}
    assert verdict.basis == '57 checks: 57 drop limits ("over" Holm-corrected for 57)'
    assert verdict.status is not Status.COSTS_MORE
    assert rejected / runs <= 0.025
    # Uncorrected, 57 chances at 2.5% each: 22% of unharmed variants shown over at a 6% flip rate (67 of 300), 0.7% at
    # 2% (2 of 300), where few subjects flip enough to show anything. "Shown over" needs both Tango's and the Wald test
    # on Agresti and Min's se: Tango's alone, the bolder where few documents flip, showed 36% and 7% (108 and 22).
    assert uncorrected >= rejected and uncorrected / runs >= uncorrected_at_least


def test_a_named_leaf_is_checked_beside_its_group():
    variants = mmlu_sweep(np.random.default_rng(1), 0.02)
    leaf = MMLU_LEAVES[0]

    decision = pick(variants, "bf16", Policy(max_drop={leaf: 5}), BY_SIZE, groups={MMLU: MMLU_GROUP})

    assert decision.checks == (
        f"{leaf} at most 5 pts worse than the baseline",
        f"{MMLU} at most 1 pt worse than the baseline",
    )


def test_without_its_groups_every_leaf_is_checked_as_before():
    decision = pick(mmlu_sweep(np.random.default_rng(1), 0.02), "bf16", Policy(), BY_SIZE)
    assert len(decision.checks) == 58 and decision.grouped == ()


def test_a_task_too_small_to_settle_a_limit_says_what_it_can_settle():
    variants = summaries(*documents(2, 2, 18, 18))  # 40 documents, 5% flips each way
    decision = pick(variants, "bf16", only(max_drop={ACC: 1}), BY_SIZE, documents={"mmlu_dev": 40})

    (check,) = decision.verdict("int4").checks
    # 7,893 documents needed (above); 40 settle the limit at which the score test's sample size is 40: 17.89 pts.
    assert check.documents_available == 40 and check.documents_needed == 7893
    assert score_test_documents(0.05, 0.05, check.best_limit, Z, stats.norm.ppf(0.8)) == pytest.approx(40)
    assert check.detail.endswith(
        "; mmlu_dev has 40 documents: for a drop like this one, a task of that size shows a limit of 17.89 pts with 80% "
        "power"
    )
    # Not "at best": the run's own bound is tighter, a draw at the level without the power
    assert check.upper < check.best_limit
    # The summary says the documents needed are more than the task has.
    assert "int4 would need ~7,893 documents (mmlu_dev has 40: more documents, or a wider limit)" in decision.summary


def test_small_n_continuous_scores_use_students_t():
    """truthfulqa_mc2 on 12 documents: a z bound showed it within; t with 11 df (2.201 vs 1.960) does not."""
    mc2 = "eval/truthfulqa_mc2/acc"
    a = 0.0048 * math.sqrt(11)  # differences +-a alternately: mean 0, se = a / sqrt(11) = 0.48 pts
    base = DocumentScores(Aggregation.MEAN, dict.fromkeys(range(12), 0.5))
    variant = DocumentScores(Aggregation.MEAN, {i: 0.5 + (a if i % 2 else -a) for i in range(12)})
    comparison = compare("truthfulqa_mc2", base, variant)
    assert comparison.se == pytest.approx(0.0048) and comparison.df == 11
    logged = {paired_key(mc2, stat): value for stat, value in comparison.statistics().items()}
    declared = {mc2: Declared(True, Scale.FRACTION)}
    runs = [
        VariantSummary("bf16", "bf16", True, {mc2: 0.5, WEIGHTS: 2.0}, is_baseline=True, declared=declared),
        VariantSummary("fp8", "fp8", True, {mc2: 0.5, WEIGHTS: 1.0, **logged}, declared=declared),
    ]

    (check,) = pick(runs, "bf16", only(max_drop={mc2: 1}), BY_SIZE).verdict("fp8").checks

    assert 1.959964 * 0.0048 <= 0.01  # z: 0.94 pts, within
    assert check.upper == pytest.approx(stats.t.ppf(0.975, 11) * 0.0048)  # t: 1.06 pts
    assert check.outcome is Outcome.UNSURE and check.df == 11
    assert "(paired, n=12, t with 11 df)" in check.detail


def test_a_limit_relative_to_a_baseline_of_zero_is_an_error():
    with pytest.raises(PolicyError, match=r"quality/kld_mean=\+5%: is relative to the baseline, whose value is 0"):
        decide([baseline(), candidate()], only(max_drop={KLD: "+5%"}))


def test_the_policy_sets_the_level_and_the_power():
    variants = summaries(*documents(2, 2, 18, 18))
    (check,) = decide(variants, only(max_drop={ACC: 1}, one_sided_alpha=0.05, power=0.9)).verdict("int4").checks
    assert tango_statistic(40, 2, 2, check.upper) == pytest.approx(-Z95)
    assert check.documents_needed == math.ceil(score_test_documents(0.05, 0.05, 0.01, Z95, stats.norm.ppf(0.9)))
    assert "one-sided 95% bounds from the flips" in check.detail and "(90% power)" in check.detail


# --------------------------------------------------------------------------------------
# 0/1 checks with logged flips: Tango's score bounds (issue 45)
# --------------------------------------------------------------------------------------

ERRORS = "eval/mmlu_dev/error_rate"  # a 0/1 score where lower is better


def binary_sweep(flips: dict[str, tuple[int, int]], n: int = 1000) -> list[VariantSummary]:
    """Baseline and int4 on n 0/1 documents per metric, int4 with these (correct_to_wrong, wrong_to_correct) flips
    (1 -> 0 and 0 -> 1 of the score, whatever its direction), logged as a sweep logs them."""
    declared = {metric: Declared(metric != ERRORS, Scale.FRACTION) for metric in flips}
    base_metrics, int4_metrics = {WEIGHTS: 270e6}, {WEIGHTS: 90e6}
    for metric, (to_zero, to_one) in flips.items():
        right = n // 2
        comparison = compare("mmlu_dev", *documents(to_zero, to_one, right - to_zero, n - right - to_one))
        base_metrics[metric] = comparison.baseline
        int4_metrics |= {metric: comparison.variant}
        int4_metrics |= {paired_key(metric, stat): value for stat, value in comparison.statistics().items()}
    return [
        VariantSummary("bf16", "bf16", True, base_metrics, is_baseline=True, declared=declared),
        VariantSummary("int4", "int4", True, int4_metrics, declared=declared),
    ]


@pytest.mark.parametrize(
    ("metric", "flips", "limit", "higher_is_better"),
    [
        (ACC, (12, 7), 1, True),  # undecided: 0.5 pts lost, give or take 1
        (ACC, (28, 3), 1, True),  # shown over
        (ACC, (3, 3), 1, True),  # shown within
        (ERRORS, (3, 12), 1, False),  # lower is better: 12 errors more, 3 fewer, 0.9 pts worse
        (ERRORS, (12, 3), 1, False),  # 0.9 pts better
    ],
)
def test_a_check_with_logged_flips_is_judged_on_tangos_score_bounds(metric, flips, limit, higher_is_better):
    variants = binary_sweep({metric: flips})

    (check,) = decide(variants, only(max_drop={metric: limit})).verdict("int4").checks

    expected = paired_binary_non_inferiority(1000, *flips, limit / 100, higher_is_better=higher_is_better)
    assert (check.outcome, check.drop, check.lower, check.upper, check.documents_needed) == (
        expected.outcome,
        pytest.approx(expected.drop),
        pytest.approx(expected.lower),
        pytest.approx(expected.upper),
        expected.documents_needed,
    )
    worse, better = flips if higher_is_better else flips[::-1]
    assert check.drop == pytest.approx((worse - better) / 1000)
    assert f"one-sided 97.5% bounds from the flips [{100 * check.lower:.2f} pts" in check.detail
    assert check.df is None  # the normal quantile


def test_without_logged_flips_the_same_check_keeps_its_wald_bounds():
    (with_flips, without) = (binary_sweep({ACC: (12, 7)}) for _ in range(2))
    without[1] = VariantSummary(
        "int4",
        "int4",
        True,
        {key: value for key, value in without[1].metrics.items() if not key.endswith(("_to_wrong", "_to_correct"))},
        declared=DECLARED,
    )
    se = without[1].value(paired_key(ACC, "se"))

    (tango,) = decide(with_flips, only(max_drop={ACC: 1})).verdict("int4").checks
    (wald,) = decide(without, only(max_drop={ACC: 1})).verdict("int4").checks

    assert wald.upper == pytest.approx(0.005 + Z * se) and "one-sided 97.5% bounds [" in wald.detail
    assert tango.upper > wald.upper  # 1.47 pts against 1.35 on the plain paired se
    assert "Tango" not in wald.detail and "bounds from the flips" in tango.detail


def test_holm_orders_the_checks_by_tangos_p_values():
    flips = {ACC: (28, 3), CLOZE: (25, 5)}
    variants = binary_sweep(flips)

    checks = decide(variants, only(max_drop=dict.fromkeys(flips, 1))).verdict("int4").checks

    # The p of "shown over" on 0/1 scores: the larger of Tango's and the Wald test's on Agresti and Min's se.
    p_values = [paired_binary_over_p(1000, *flips[check.metric], 0.01) for check in checks]
    assert [check.over_alpha for check in checks] == pytest.approx(holm_alphas(p_values, 0.025))
    assert p_values[0] < 0.025 / 2 < 0.025 < p_values[1]  # 28/3 shown over at Holm's first rank, 25/5 not at all
    assert [check.outcome for check in checks] == [Outcome.OVER, Outcome.UNSURE]
    assert "one-sided bounds from the flips [" in checks[0].detail and "(Holm, 2 checks)" in checks[0].detail


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_drop": {ACC: 1}}, "shown within every limit"),  # a claim at the policy's level
        ({"max_kld": 0.1}, "meeting every limit"),  # a plain comparison of a logged figure
        ({"max_drop": {ACC: 1}, "max_kld": 0.1}, "shown within every drop limit and meeting every bound"),
    ],
)
def test_a_bound_on_a_logged_figure_is_met_not_shown_within(fields, words):
    decision = decide([baseline(), candidate("fp8")], only(**fields))
    assert decision.passing_words == words
    assert decision.summary.startswith("Chosen: fp8,") and f"variants {words}." in decision.summary


def test_a_bound_on_a_figure_the_run_left_out_says_why():
    """A bound on a tail the timings could not support rejects the variant with the run's own reason."""
    why = "3 timed runs: a p99 needs at least 100 (the p99 of 3 is their maximum)"
    fp8 = candidate("fp8", drop=(TTFT,))
    fp8 = VariantSummary(fp8.name, fp8.method, True, fp8.metrics, {"quantlab.cost.unavailable.ttft_ms_p99": why})
    decision = decide([baseline(), fp8], only(at_most={TTFT: 200.0}))
    (reason,) = decision.verdict("fp8").reasons
    assert reason == f"missing metric {TTFT} ({why})"


def test_a_per_token_limit_counts_its_evidence_and_its_advice_in_scoring_windows():
    """Perplexity's paired figures are per token, their se clustered on the corpus' scoring windows (df = windows - 1):
    the advice is in windows, not in "documents" that are tokens."""
    ratio = "quality/ln_ppl_ratio"
    logged = {
        paired_key(ratio, "diff"): 0.004,
        paired_key(ratio, "se"): 0.003,
        paired_key(ratio, "n"): 4096,
        paired_key(ratio, "df"): 15,  # 16 windows
    }
    runs = [
        VariantSummary("bf16", "bf16", True, {ratio: 0.0, WEIGHTS: 2.0}, is_baseline=True),
        VariantSummary("fp8", "fp8", True, {ratio: 0.004, WEIGHTS: 1.0, **logged}),
    ]
    decision = pick(runs, "bf16", only(max_drop={ratio: 0.01}), BY_SIZE)
    (check,) = decision.verdict("fp8").checks
    assert check.outcome is Outcome.UNSURE and check.n == 16 and check.unit == "scoring windows"
    assert "(paired, n=4,096 tokens in 16 scoring windows, t with 15 df)" in check.detail
    assert f"about {check.documents_needed:,} scoring windows would settle it" in check.detail
    assert f"fp8 would need ~{check.documents_needed:,} scoring windows" in decision.summary


# (objective, bound) -> whether a variant served with quantlab's engine plugin can be chosen
@pytest.mark.parametrize(
    ("objective", "bounds", "eligible"),
    [
        pytest.param(BY_SIZE, {}, True, id="a-size-is-the-checkpoints-own"),
        pytest.param(BY_SPEED, {}, False, id="a-timed-objective"),
        pytest.param(BY_SIZE, {"at_most": {TTFT: 1e6}}, False, id="a-timed-bound"),
    ],
)
def test_a_variant_served_with_quantlabs_plugin_is_kept_out_of_a_decision_on_timed_figures(objective, bounds, eligible):
    plugged = candidate("fp8")
    plugged.tags[NOT_STOCK_TAG] = "fp8-upcast-gemm"
    stock = candidate("int8", **{WEIGHTS: 200e6, DECODE: BASELINE_METRICS[DECODE] * 1.5})
    decision = decide([baseline(), plugged, stock], only(**bounds), objective)
    verdict = next(v for v in decision.verdicts if v.name == "fp8")
    if eligible:
        assert verdict.status in (Status.CHOSEN, Status.COSTS_MORE)
    else:
        assert verdict.status is Status.REJECTED and decision.chosen == "int8"
        assert any(
            reason.startswith("served with quantlab's engine plugin fp8-upcast-gemm (not the stock engine)")
            for reason in verdict.reasons
        )
    assert any("fp8: served with quantlab's engine plugin fp8-upcast-gemm" in line for line in decision.warnings)
