"""Known answers for the pure damage statistics (hand-computed tables)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from quantlab.evaluate.damage import (
    context_buckets,
    context_lengths,
    damage_by_context,
    flip_metrics,
    kld_stats,
    kv_cache_pairs,
    mcnemar_exact_p,
    paired_flips,
    perplexity,
    recovery,
    token_contexts,
    token_damage,
)

TOKEN_KEYS = {
    "quality/ppl",
    "quality/ppl_tokens",
    "quality/kld_mean",
    "quality/kld_mean_stderr",
    "quality/kld_median",
    "quality/kld_p90",
    "quality/kld_p95",
    "quality/kld_p99",
    "quality/kld_p999",
    "quality/kld_max",
    "quality/top1_agreement",
    "quality/delta_p_mean",
    "quality/delta_p_rms",
    "quality/ln_ppl_ratio",
}


def test_perplexity_is_exp_of_mean_nll():
    assert perplexity(np.array([math.log(2), math.log(8)])) == pytest.approx(4.0, rel=1e-12)


def test_perplexity_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="no scored tokens"):
        perplexity(np.array([]))


def test_kld_stats_on_a_known_grid():
    values = np.arange(1001) / 1000  # 0.000, 0.001, ..., 1.000: percentile q sits at q/100
    stats = kld_stats(values)
    assert stats["mean"] == pytest.approx(0.5)
    assert stats["median"] == pytest.approx(0.5)
    assert stats["p90"] == pytest.approx(0.9)
    assert stats["p95"] == pytest.approx(0.95)
    assert stats["p99"] == pytest.approx(0.99)
    assert stats["p999"] == pytest.approx(0.999)
    assert stats["max"] == 1.0
    expected_stderr = statistics.stdev(values.tolist()) / math.sqrt(len(values))
    assert stats["mean_stderr"] == pytest.approx(expected_stderr, rel=1e-12)


def test_kld_stderr_is_cluster_robust_over_windows():
    # Two windows of two tokens: x = (1, 3 | 2, 6), mean 3; window sums of x - mean: (-2, 2);
    # se = sqrt(2 / 1 * (4 + 4)) / 4 = 1.0 (independent tokens: stdev 2.16 / 2 = 1.08).
    stats = kld_stats(np.array([1.0, 3.0, 2.0, 6.0]), clusters=np.array([0, 0, 1, 1]))
    assert stats["mean_stderr"] == pytest.approx(1.0)
    # Window sums that cancel: no spread between windows, se 0 (not the 1.08 of independent tokens).
    assert kld_stats(np.array([1.0, 5.0, 5.0, 1.0]), clusters=np.array([0, 0, 1, 1]))["mean_stderr"] == 0.0
    with pytest.raises(ValueError, match="clusters has 3 entries for 4 tokens"):
        kld_stats(np.ones(4), clusters=np.zeros(3))


def test_kld_percentiles_interpolate_linearly_like_llama_cpp():
    # llama.cpp: p = q·(n-1), value = (1-frac)·v[floor p] + frac·v[floor p + 1]
    stats = kld_stats(np.array([0.0, 1.0, 10.0]))
    assert stats["p90"] == pytest.approx(0.2 * 1.0 + 0.8 * 10.0)  # p = 1.8: 0.8 of the way from v[1] to v[2]
    assert stats["median"] == 1.0


def test_token_damage_by_hand():
    baseline_nll = np.array([math.log(2), math.log(4)])  # p = 0.5, 0.25
    variant_nll = np.array([math.log(4), math.log(4)])  # p = 0.25, 0.25
    metrics = token_damage(
        kld=np.array([0.1, 0.3]), baseline_nll=baseline_nll, variant_nll=variant_nll, top1_match=np.array([True, False])
    )
    assert metrics["quality/ppl"] == pytest.approx(4.0)
    assert metrics["quality/ppl_tokens"] == 2.0
    assert metrics["quality/top1_agreement"] == 0.5
    assert metrics["quality/delta_p_mean"] == pytest.approx(-0.125)
    assert metrics["quality/delta_p_rms"] == pytest.approx(math.sqrt(0.25**2 / 2))
    assert metrics["quality/ln_ppl_ratio"] == pytest.approx(math.log(4.0 / math.sqrt(8)))
    assert metrics["quality/kld_mean"] == pytest.approx(0.2)
    assert set(metrics) == TOKEN_KEYS
    assert all(type(v) is float for v in metrics.values())


def test_baseline_against_itself_gives_zero_damage_with_the_same_keys():
    nll = np.array([0.5, 1.5, 2.5])
    metrics = token_damage(np.zeros(3), nll, nll, np.ones(3, dtype=bool))
    assert set(metrics) == TOKEN_KEYS
    for key in TOKEN_KEYS - {"quality/ppl", "quality/ppl_tokens", "quality/top1_agreement"}:
        assert metrics[key] == 0.0, key
    assert metrics["quality/top1_agreement"] == 1.0
    assert metrics["quality/ppl"] == pytest.approx(math.exp(1.5))


def test_token_damage_refuses_misaligned_arrays():
    with pytest.raises(ValueError, match="differ in length"):
        token_damage(np.zeros(3), np.ones(3), np.ones(2), np.ones(3, dtype=bool))


@pytest.mark.parametrize(
    ("correct_to_wrong", "wrong_to_correct", "expected"),
    [
        (0, 0, 1.0),  # no discordant pair
        (1, 0, 1.0),  # 2 · 1/2, capped
        (3, 3, 1.0),  # 2 · 42/64 > 1, capped
        (5, 0, 2 / 32),  # 2 · (1/2)^5
        (0, 5, 2 / 32),  # symmetric
        (2, 7, 2 * 46 / 512),  # 2 · (1 + 9 + 36) / 2^9
        (10, 2, 2 * 79 / 4096),  # 2 · (1 + 12 + 66) / 2^12
    ],
)
def test_mcnemar_exact_p(correct_to_wrong, wrong_to_correct, expected):
    assert mcnemar_exact_p(correct_to_wrong, wrong_to_correct) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("baseline", "variant", "to_wrong", "to_correct", "p"),
    [
        (
            {0: 1.0, 1: 1.0, 2: 0.0, 3: 0.0, 4: 1.0},
            {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0},
            [1, 4],
            [2],
            1.0,  # 2 · P(X <= 1 | n=3) = 1
        ),
        (
            {i: 1.0 for i in range(8)},
            {i: 1.0 if i < 3 else 0.0 for i in range(8)},
            [3, 4, 5, 6, 7],
            [],
            2 / 32,
        ),
        ({0: 0.0, 1: 1.0}, {0: 0.0, 1: 1.0}, [], [], 1.0),
        # lm-eval's int doc ids first, in order, then other harnesses' string ids
        ({"b": 1.0, 10: 1.0, 2: 1.0, "a": 1.0}, {"b": 0.0, 10: 0.0, 2: 0.0, "a": 0.0}, [2, 10, "a", "b"], [], 1 / 8),
    ],
)
def test_paired_flips_tables(baseline, variant, to_wrong, to_correct, p):
    flips = paired_flips("arc", baseline, variant)
    assert flips == {"correct_to_wrong": to_wrong, "wrong_to_correct": to_correct}
    assert flip_metrics("arc", len(to_wrong), len(to_correct)) == {
        "quality/flips/arc": float(len(to_wrong) + len(to_correct)),
        "quality/flips/arc/correct_to_wrong": float(len(to_wrong)),
        "quality/flips/arc/wrong_to_correct": float(len(to_correct)),
        "quality/mcnemar_p/arc": pytest.approx(p),
    }


def test_baseline_against_itself_has_no_flips():
    correctness = {0: 1.0, 1: 0.0, 2: 1.0}
    assert paired_flips("mmlu_dev", correctness, correctness) == {"correct_to_wrong": [], "wrong_to_correct": []}
    assert flip_metrics("mmlu_dev", 0, 0) == {
        "quality/flips/mmlu_dev": 0.0,
        "quality/flips/mmlu_dev/correct_to_wrong": 0.0,
        "quality/flips/mmlu_dev/wrong_to_correct": 0.0,
        "quality/mcnemar_p/mmlu_dev": 1.0,
    }


def test_paired_flips_refuses_unpaired_samples():
    with pytest.raises(ValueError, match="1 only in baseline, 0 only in variant"):
        paired_flips("arc", {0: 1.0, 1: 0.0}, {0: 1.0})


def test_paired_flips_refuses_non_binary_correctness():
    with pytest.raises(ValueError, match="doc 0"):
        paired_flips("arc", {0: 0.5}, {0: 1.0})


def test_recovery_table():
    baseline = {"eval/arc/acc": 0.5, "eval/arc/acc_stderr": 0.1, "eval/arc/acc_norm": 0.0, "eval/arc/f1": 0.0}
    variant = {"eval/arc/acc": 0.4, "eval/arc/acc_stderr": 0.1, "eval/arc/acc_norm": 0.0, "eval/arc/f1": 0.2}
    baseline |= {"eval/arc/only_baseline": 1.0, "quality/ppl": 3.0}
    variant |= {"eval/arc/only_variant": 1.0, "quality/ppl": 4.0}
    metrics = recovery(baseline, variant)
    assert set(metrics) == {"quality/recovery/arc/acc", "quality/recovery/arc/acc_norm", "quality/recovery/arc/f1"}
    assert metrics["quality/recovery/arc/acc"] == pytest.approx(0.8)
    assert metrics["quality/recovery/arc/acc_norm"] == 1.0  # 0 of 0: nothing lost
    assert math.isnan(metrics["quality/recovery/arc/f1"])  # undefined, but the column stays
    assert recovery({"eval/gsm8k/exact_match:strict-match": 0.5}, {"eval/gsm8k/exact_match:strict-match": 0.25}) == {
        "quality/recovery/gsm8k/exact_match:strict-match": 0.5
    }


def test_baseline_recovers_itself_fully():
    scores = {"eval/arc/acc": 0.31, "eval/arc/acc_norm": 0.0}
    assert recovery(scores, scores) == {"quality/recovery/arc/acc": 1.0, "quality/recovery/arc/acc_norm": 1.0}


# recipe lengths, model max positions -> the lengths measured
CONTEXT_LENGTHS = [
    ([256, 1024, 4096], 8192, (256, 1024, 4096)),
    ([256, 1024, 4096], 4096, (256, 1024, 4096)),
    ([256, 1024, 4096], 2048, (256, 1024, 2048)),  # the model's limit replaces what it cannot take
    ([256, 1024, 4096], 1024, (256, 1024)),
    ([256, 1024, 4096], 200, (200,)),
    ([256, 1024], None, (256, 1024)),  # no max positions in the config: as written
]


@pytest.mark.parametrize(("lengths", "limit", "expected"), CONTEXT_LENGTHS)
def test_context_lengths_are_clipped_to_the_models_positions(lengths, limit, expected):
    assert context_lengths(lengths, limit) == expected


class _W:  # reference.Window's fields: tokens [start, end) in, targets [score_from, end) scored
    def __init__(self, start, end, score_from):
        self.start, self.end, self.score_from = start, end, score_from


def test_token_contexts_count_the_tokens_before_each_target_in_its_window():
    # windows of 4 over 10 tokens: [0,4) scores targets 1-3 (contexts 1,2,3), [4,8) and [8,10) score all theirs
    windows = [_W(0, 4, 1), _W(4, 8, 4), _W(8, 10, 8)]
    assert token_contexts(windows).tolist() == [1, 2, 3, 0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize(
    ("contexts", "lengths", "buckets"),
    [
        ([0, 1, 3, 4, 7, 8, 15], (4, 8, 16), [0, 0, 0, 1, 1, 2, 2]),  # [0,4) [4,8) [8,16)
        ([1, 255, 256, 1023, 1024, 4095], (256, 1024, 4096), [0, 0, 1, 1, 2, 2]),
    ],
)
def test_context_buckets_by_hand(contexts, lengths, buckets):
    assert context_buckets(np.array(contexts), lengths).tolist() == buckets


def test_a_context_past_the_longest_length_is_refused():
    with pytest.raises(ValueError, match="past the longest length 16"):
        context_buckets(np.array([3, 16]), (4, 16))


def test_damage_by_context_by_hand():
    kld = [0.1, 0.3, 0.5, 1.0, 2.0]
    top1 = [True, True, False, True, False]
    figures = damage_by_context(np.array(kld), np.array(top1), np.array([1, 2, 5, 6, 7]), (4, 8, 16))
    assert figures["quality/kld_mean/ctx4"] == pytest.approx(0.2)
    assert figures["quality/kld_mean/ctx8"] == pytest.approx((0.5 + 1.0 + 2.0) / 3)
    assert figures["quality/top1_agreement/ctx4"] == 1.0 and figures["quality/top1_agreement/ctx8"] == pytest.approx(
        1 / 3
    )
    assert figures["quality/kld_p99/ctx8"] == pytest.approx(np.percentile([0.5, 1.0, 2.0], 99))  # 1.98, interpolated
    assert figures["quality/ppl_tokens/ctx4"] == 2 and figures["quality/ppl_tokens/ctx8"] == 3
    assert not any(key.endswith("/ctx16") for key in figures)  # no token had 8 or more before it


class _V:
    def __init__(self, name, method, params=None, kv_cache=None):
        self.name, self.method, self.params, self.kv_cache = name, method, params or {}, kv_cache


KV = {"format": "fp8", "granularity": "tensor"}
# the recipe's variants -> each KV-cache variant's plain twin
KV_PAIRS = {
    "twin found": ([_V("fp8", "fp8"), _V("fp8-kv", "fp8", kv_cache=KV)], {"fp8-kv": "fp8"}),
    "no twin in the recipe": ([_V("bf16", "bf16"), _V("fp8-kv", "fp8", kv_cache=KV)], {"fp8-kv": None}),
    "other params are not a twin": (
        [_V("g32", "gptq_int4", {"group_size": 32}), _V("g64-kv", "gptq_int4", {"group_size": 64}, KV)],
        {"g64-kv": None},
    ),
    "same params, its own twin": (
        [
            _V("g64-kv", "gptq_int4", {"group_size": 64}, KV),
            _V("g32", "gptq_int4", {"group_size": 32}),
            _V("g64", "gptq_int4", {"group_size": 64}),
        ],
        {"g64-kv": "g64"},
    ),
    "two KV variants, one twin": (
        [
            _V("bf16", "bf16"),
            _V("bf16-kv", "bf16", kv_cache=KV),
            _V("bf16-kvh", "bf16", kv_cache={**KV, "granularity": "head"}),
        ],
        {"bf16-kv": "bf16", "bf16-kvh": "bf16"},
    ),
    "a KV variant is nobody's twin": (
        [_V("a-kv", "fp8", kv_cache=KV), _V("b-kv", "fp8", kv_cache=KV)],
        {"a-kv": None, "b-kv": None},
    ),
    "no KV variant": ([_V("bf16", "bf16"), _V("fp8", "fp8")], {}),
}


@pytest.mark.parametrize("case", KV_PAIRS, ids=KV_PAIRS)
def test_kv_cache_variant_pairs_with_its_twin_without_it(case):
    variants, expected = KV_PAIRS[case]
    assert kv_cache_pairs(variants) == expected
