"""The metric contract: key spelling, directions and scales."""

from __future__ import annotations

import pytest

from quantlab.metrics import (
    Declared,
    EvalKey,
    Scale,
    declared_from_tags,
    declared_tags,
    has_entry,
    paired_key,
    spec,
    unknown_directions,
)

GSM8K = {
    "eval/gsm8k/exact_match:strict-match": Declared(True, Scale.FRACTION),
    "eval/wikitext/word_perplexity": Declared(False, Scale.PERPLEXITY),
}


@pytest.mark.parametrize(
    ("task", "metric", "filter_name", "stderr", "key"),
    [
        ("arc_easy", "acc", "none", False, "eval/arc_easy/acc"),
        ("arc_easy", "acc_norm", "none", True, "eval/arc_easy/acc_norm_stderr"),
        ("gsm8k", "exact_match", "strict-match", False, "eval/gsm8k/exact_match:strict-match"),
        ("gsm8k", "exact_match", "flexible-extract", True, "eval/gsm8k/exact_match_stderr:flexible-extract"),
        ("wikitext", "word_perplexity", "none", False, "eval/wikitext/word_perplexity"),
    ],
)
def test_eval_keys_are_reversible(task: str, metric: str, filter_name: str, stderr: bool, key: str) -> None:
    assert str(EvalKey(task, metric, filter_name, stderr)) == key
    assert EvalKey.parse(key) == EvalKey(task, metric, filter_name, stderr)


@pytest.mark.parametrize("key", ["quality/ppl", "eval/", "eval/acc", "eval/task/", "eval/task/_stderr"])
def test_non_eval_keys_do_not_parse(key: str) -> None:
    assert EvalKey.parse(key) is None


@pytest.mark.parametrize(
    ("key", "higher_is_better", "scale"),
    [
        ("eval/gsm8k/exact_match:strict-match", True, Scale.FRACTION),
        ("eval/gsm8k/exact_match:flexible-extract", None, Scale.SCORE),  # not declared: unknown, not guessed
        ("eval/wikitext/word_perplexity", False, Scale.PERPLEXITY),
        ("eval/gsm8k/exact_match_stderr:strict-match", None, Scale.FRACTION),
        ("quality/ppl", False, Scale.PERPLEXITY),
        ("quality/kld_mean", False, Scale.NATS),
        ("quality/top1_agreement", True, Scale.FRACTION),
        ("cost/weight_bytes", False, Scale.BYTES),
        ("cost/decode_tokens_per_s", True, Scale.TOKENS_PER_S),
        ("cost/decode_tokens_per_s_bs8", True, Scale.TOKENS_PER_S),
        ("cost/ttft_ms_p99_bs4", False, Scale.MILLISECONDS),
        ("time/prepare model_seconds", False, Scale.SECONDS),
        ("quality/flips/mmlu", False, Scale.COUNT),
        ("quality/mcnemar_p/mmlu", None, Scale.P_VALUE),
        ("quality/recovery/gsm8k/exact_match:strict-match", True, Scale.RATIO),
        ("quality/paired/eval/gsm8k/exact_match:strict-match/ci95_low", True, Scale.FRACTION),
        ("quality/paired/quality/ppl/diff", False, Scale.PERPLEXITY),
        ("quality/paired/quality/ppl/n", None, Scale.COUNT),
        ("quality/paired/eval/wikitext/word_perplexity/p_value", None, Scale.P_VALUE),
        ("quality/paired/quality/kld_mean/df", None, Scale.COUNT),  # t's degrees of freedom (issue 28)
        ("quality/kld_mean_design_effect", None, Scale.RATIO),  # correlated tokens: a fact, not a quality
        ("quality/ppl_design_effect", None, Scale.RATIO),
        ("quality/top1_agreement_design_effect", None, Scale.RATIO),
    ],
)
def test_contract_directions_and_scales(key: str, higher_is_better: bool | None, scale: Scale) -> None:
    found = spec(key, GSM8K)
    assert (found.higher_is_better, found.scale) == (higher_is_better, scale)
    assert found.entry, f"{key} has no contract entry"


def test_unknown_keys_are_named_not_guessed() -> None:
    assert not has_entry("cost/something_new")
    assert not has_entry("eval/gsm8k/exact_match:flexible-extract", GSM8K)
    assert has_entry("eval/gsm8k/exact_match:strict-match", GSM8K)
    keys = ["eval/gsm8k/exact_match:strict-match", "eval/gsm8k/exact_match:flexible-extract", "quality/ppl"]
    assert unknown_directions(keys, GSM8K) == ["eval/gsm8k/exact_match:flexible-extract"]


def test_paired_keys_round_trip() -> None:
    key = paired_key("eval/gsm8k/exact_match:strict-match", "se")
    assert key == "quality/paired/eval/gsm8k/exact_match:strict-match/se"
    assert spec(key, GSM8K).entry == "quality/paired/<metric>/se"
    assert spec(key, GSM8K).label == "gsm8k exact_match (strict-match): paired se"
    with pytest.raises(ValueError, match="unknown paired statistic"):
        paired_key("quality/ppl", "stderr")


def test_declarations_travel_as_tags() -> None:
    declared = {**GSM8K, "eval/custom/score": Declared(None, Scale.SCORE)}
    tags = declared_tags(declared)
    assert tags["quantlab.metric/eval/gsm8k/exact_match:strict-match"] == "higher fraction"
    assert declared_from_tags({**tags, "quantlab.variant": "fp8"}) == declared


def test_every_timed_entry_is_an_entry_of_the_contract() -> None:
    """The `timed` column names entries by their contract spelling: a misspelt one would quietly time nothing."""
    from quantlab import metrics

    entries = set(metrics._FIXED) | set(metrics.BATCH_ENTRIES)
    assert not metrics.TIMED - entries, metrics.TIMED - entries
    for prefix in metrics.TIMED_PREFIXES:
        assert any(entry.startswith(prefix) for entry in metrics._FIXED), prefix


def test_every_figure_shown_somewhere_is_an_entry_of_the_contract() -> None:
    """What a reader sees is derived from the contract's `SHOWN` column: a key there with no entry would be shown with
    no direction, scale or label."""
    from quantlab.metrics import SHOWN

    assert SHOWN and all(has_entry(key) for key in SHOWN), [key for key in SHOWN if not has_entry(key)]
    assert all(places for places in SHOWN.values())  # a figure listed is shown somewhere


@pytest.mark.parametrize(
    ("place", "first", "direction"),
    [
        ("FRONTIER_COST", "cost/weight_bytes", False),
        ("FRONTIER_DAMAGE", "quality/kld_mean", False),
        ("SERVING_TABLE", "cost/serving/goodput_tokens_per_s", True),
        ("SENSITIVITY", "quality/kld_mean", False),
    ],
)
def test_each_place_lists_its_figures_in_the_contracts_order(place, first, direction) -> None:
    from quantlab.metrics import Shown, shown_in

    listed = shown_in(Shown[place])
    assert listed[0] == first and spec(first).higher_is_better is direction
    assert all(spec(key).direction_known for key in listed)  # every figure shown is ordered by its direction
