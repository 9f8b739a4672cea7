"""On-policy damage: the pure pieces on tables with known answers, then the baseline's stored pass over its own
greedy continuations on the tiny Llama, compared with itself and with a perturbed copy of itself."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from quantlab.errors import BadInput
from quantlab.evaluate import on_policy, reference
from quantlab.evaluate.served_damage import bucketed_ear
from quantlab.frontier import VariantSummary
from quantlab.metrics import has_entry, paired_key, spec
from quantlab.paired import compare
from quantlab.policy import Policy, PolicyError
from quantlab.recipe import QualitySettings, parse_recipe
from quantlab.report import on_policy_table


@pytest.mark.parametrize(
    ("generate", "field", "message"),
    [
        ({"max_new_tokens": 0}, "quality.generate.max_new_tokens", "greater than 0"),
        ({"prompts": "many"}, "quality.generate.prompts", "integer"),
        ({"prompt_tokens": 1}, "quality.generate.prompt_tokens", "greater than 1"),
        ({"temperature": 0.7}, "quality.generate.temperature", ""),
    ],
)
def test_bad_generate_settings_are_named_by_file_and_field(generate, field, message):
    data = {"name": "x", "model": {"source": "m"}, "baseline": "a", "variants": [{"name": "a", "method": "bf16"}]}
    with pytest.raises(BadInput) as caught:
        parse_recipe("r.yaml", "", data | {"quality": {"generate": generate}})
    problems = [str(problem) for problem in caught.value.problems]
    assert any(p.startswith(f"r.yaml: {field}: ") and message in p for p in problems), problems
    assert all("\n" not in p for p in problems)


def test_generate_is_on_by_default_and_can_be_turned_off():
    assert QualitySettings().generate.enabled
    assert not QualitySettings.model_validate({"generate": {"enabled": False}}).generate.enabled


@pytest.mark.parametrize(
    ("n_tokens", "prompts", "prompt_tokens", "expected"),
    [
        (100, 3, 10, (0, 45, 90)),
        (100, 1, 10, (0,)),
        (10, 3, 10, (0, 0, 0)),  # a corpus of one prompt: the same prompt each time
        (11, 4, 2, (0, 3, 6, 9)),
    ],
)
def test_prompt_offsets_spread_over_the_corpus(n_tokens, prompts, prompt_tokens, expected):
    assert on_policy.prompt_offsets(n_tokens, prompts, prompt_tokens) == expected


def test_prompt_offsets_refuse_a_corpus_shorter_than_a_prompt():
    with pytest.raises(ValueError, match="fewer than one prompt"):
        on_policy.prompt_offsets(5, 2, 10)


@pytest.mark.parametrize(
    ("prompts", "lengths", "expected"),
    [
        ([2, 3], [4, 3], [0, 1, 2, 0, 0]),  # targets 1..3 of the first (prompt 0..1), 1..2 of the second (all prompt)
        ([1], [4], [1, 2, 3]),
        ([5], [5], [0, 0, 0, 0]),  # nothing generated
    ],
)
def test_generated_positions_by_hand(prompts, lengths, expected):
    assert on_policy.generated_positions(prompts, lengths).tolist() == expected


@pytest.mark.parametrize(
    ("positions", "expected"),
    [
        (
            [0, 1, 32, 33, 128, 129],
            {
                "prompt": [1, 0, 0, 0, 0, 0],
                "generated": [0, 1, 1, 1, 1, 1],
                "gen1-32": [0, 1, 1, 0, 0, 0],
                "gen33-128": [0, 0, 0, 1, 1, 0],
                "gen129-512": [0, 0, 0, 0, 0, 1],
            },
        ),
        ([0, 0], {"prompt": [1, 1]}),  # no generated token: no generated part, no bucket
        ([3, 40], {"generated": [1, 1], "gen1-32": [1, 0], "gen33-128": [0, 1]}),
    ],
)
def test_parts_only_those_with_tokens(positions, expected):
    found = on_policy.parts(np.array(positions), (32, 128, 512))
    assert {name: mask.astype(int).tolist() for name, mask in found.items()} == expected


def test_parts_refuse_a_position_past_the_last_bucket():
    with pytest.raises(ValueError, match="past the last bucket"):
        on_policy.parts(np.array([0, 513]), (32, 128, 512))


@pytest.mark.parametrize(
    ("p", "q", "ear"),
    [
        ([0.5, 0.5], [0.5, 0.5], 1.0),
        ([0.9, 0.1], [0.6, 0.4], 0.7),
        ([0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0], 0.5),
        ([1.0, 0.0], [0.0, 1.0], 0.0),  # disjoint: nothing accepted
    ],
)
def test_expected_acceptance_is_the_overlap_of_the_two_distributions(p, q, ear):
    stored = reference.encode_logprobs(torch.tensor([p]).log())
    found = reference.expected_acceptance(stored, torch.tensor([q]).log())
    assert found.tolist() == [pytest.approx(ear, abs=1e-3)]  # fp16 storage of log p


@pytest.mark.parametrize(
    ("p", "q", "known", "ear"),
    [
        ([0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0, 1, 2], 1.0),  # the whole vocabulary reported: exact
        ([0.9, 0.05, 0.05], [0.6, 0.3, 0.1], [0, 1, 2], 0.6 + 0.05 + 0.05),
        # top 1 reported: 0.6 + min(0.1, 0.4), above the exact 0.7 (the bucket merges 0.05 vs 0.3 and 0.05 vs 0.1)
        ([0.9, 0.05, 0.05], [0.6, 0.3, 0.1], [0], 0.7),
        ([0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0, 1], 0.25 + 0.1 + 0.2),  # exact 0.55; a bound of 0.55
        ([0.8, 0.1, 0.1], [0.1, 0.1, 0.8], [0], 0.1 + 0.2),  # exact 0.3 (0.1 + 0.1 + 0.1); bounded by 0.3
    ],
)
def test_the_served_top_k_acceptance_bounds_the_exact_one_from_above(p, q, known, ear):
    """The engine reports its top k: the rest of the vocabulary is one bucket on each side, and a sum of minima over
    merged outcomes can only be larger (min(a + b, c + d) >= min(a, c) + min(b, d))."""
    p, q = np.array(p), np.array(q)
    bound = bucketed_ear(np.log(p[known]), np.log(q[known]))
    assert bound == pytest.approx(ear)
    assert bound >= float(np.minimum(p, q).sum()) - 1e-12


def test_figures_and_documents_by_hand():
    figures = {"kld_mean": np.array([0.0, 0.2, 0.4, 0.6]), "ear": np.array([1.0, 0.9, 0.8, 0.5])}
    masks = on_policy.parts(np.array([0, 1, 2, 40]), (32, 128))
    assert on_policy.on_policy_figures(figures, masks) == {
        "quality/on_policy/prompt/kld_mean": 0.0,
        "quality/on_policy/prompt/ear": 1.0,
        "quality/on_policy/prompt/tokens": 1.0,
        "quality/on_policy/generated/kld_mean": pytest.approx(0.4),
        "quality/on_policy/generated/ear": pytest.approx(2.2 / 3),
        "quality/on_policy/generated/tokens": 3.0,
        "quality/on_policy/gen1-32/kld_mean": pytest.approx(0.3),
        "quality/on_policy/gen1-32/ear": pytest.approx(0.85),
        "quality/on_policy/gen1-32/tokens": 2.0,
        "quality/on_policy/gen33-128/kld_mean": pytest.approx(0.6),
        "quality/on_policy/gen33-128/ear": pytest.approx(0.5),
        "quality/on_policy/gen33-128/tokens": 1.0,
    }
    documents = on_policy.on_policy_documents(figures, masks, np.array([0, 0, 1, 1]))
    generated = documents["quality/on_policy/generated/kld_mean"]
    assert dict(generated.values) == {1: 0.2, 2: 0.4, 3: 0.6}
    assert dict(generated.clusters) == {1: 0, 2: 1, 3: 1}  # each token in its sequence's cluster


def test_every_figure_is_in_the_contract_with_a_direction():
    for figure in on_policy.FIGURES:
        key = f"quality/on_policy/gen33-128/{figure}"
        assert has_entry(key) and spec(key).direction_known, key
        assert has_entry(f"{key}_design_effect") and not spec(f"{key}_design_effect").direction_known
        assert spec(paired_key(key, "ci95_low")).higher_is_better == spec(key).higher_is_better
    assert spec("quality/on_policy/generated/ear").higher_is_better is True


def test_the_policy_bounds_and_limits_them_as_any_figure():
    policy = Policy.model_validate(
        {
            "at_most": {"quality/on_policy/generated/kld_mean": 0.05},
            "max_drop": {"quality/on_policy/gen33-128/ear": 2, "quality/on_policy/generated/top1_agreement": 5},
        }
    )
    assert [(b.metric, b.upper) for b in policy.bounds()] == [("quality/on_policy/generated/kld_mean", True)]
    baseline = {"quality/on_policy/gen33-128/ear": 1.0, "quality/on_policy/generated/top1_agreement": 1.0}
    rules = policy.drop_rules(baseline, {})
    assert {rule.metric: rule.allowed for rule in rules} == {
        "quality/on_policy/gen33-128/ear": pytest.approx(0.02),
        "quality/on_policy/generated/top1_agreement": pytest.approx(0.05),
    }
    with pytest.raises((PolicyError, ValueError), match="no known better direction"):
        Policy.model_validate({"max_drop": {"quality/on_policy/generated/tokens": 2}})


def test_the_report_shows_damage_by_generated_position_with_intervals():
    metrics = {}
    for part, kld in (("gen33-128", 0.03), ("prompt", 0.01), ("generated", 0.02), ("gen1-32", 0.015)):
        key = f"quality/on_policy/{part}/kld_mean"
        metrics |= {key: kld, f"quality/on_policy/{part}/tokens": 10.0, paired_key(key, "diff"): kld}
        metrics |= {paired_key(key, "ci95_low"): kld - 0.005, paired_key(key, "ci95_high"): kld + 0.005}
        ear = f"quality/on_policy/{part}/ear"  # paired against the baseline's 1
        metrics |= {ear: 0.9, paired_key(ear, "diff"): -0.1, paired_key(ear, "ci95_low"): -0.15}
        metrics |= {paired_key(ear, "ci95_high"): -0.05}
    variants = [
        VariantSummary("bf16", "bf16", True, {"quality/on_policy/generated/kld_mean": 0.0}, is_baseline=True),
        VariantSummary("fp8", "fp8", True, metrics),
    ]
    table = on_policy_table(variants)
    assert [row[:3] for row in table.rows] == [
        ("fp8", "prompt", "10"),
        ("", "generated", "10"),
        ("", "generated 1-32", "10"),
        ("", "generated 33-128", "10"),
    ]
    kld_column, ear_column = table.headers.index("on-policy mean KL divergence"), 4
    assert "0.03" in table.rows[3][kld_column] and "[0.025" in table.rows[3][kld_column]
    assert table.rows[0][ear_column].replace(" ", "").startswith("90.0%[85.0%,95.0%]")
    assert on_policy_table(variants[:1]) is None


@pytest.fixture(scope="module")
def on_policy_pass(tiny_llama, tmp_path_factory):
    """The tiny Llama as the baseline writing its on-policy pass, and a copy of it with noise on every weight."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = tmp_path_factory.mktemp("on-policy")
    (work / "corpus.txt").write_text(Path(reference.__file__).read_text())  # any real prose and code will do
    settings = QualitySettings.model_validate(
        {"corpus": "corpus.txt", "max_tokens": 64, "generate": {"prompts": 3, "prompt_tokens": 8, "max_new_tokens": 12}}
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama.path, dtype=torch.float32)
    main_reference = work / "references" / "key"
    baseline_job = SimpleNamespace(is_baseline=True, force=False)
    baseline = on_policy.on_policy_damage(model, tokenizer, settings, work, main_reference, baseline_job)
    itself = reference.compare_tokens(model, on_policy.on_policy_reference_dir(main_reference))
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * parameter.std() * torch.randn_like(parameter))
    variant_job = SimpleNamespace(is_baseline=False, force=False)
    variant = on_policy.on_policy_damage(model, tokenizer, settings, work, main_reference, variant_job)
    return SimpleNamespace(baseline=baseline, itself=itself, variant=variant, tokenizer=tokenizer, work=work)


def test_the_baseline_against_its_own_pass_loses_nothing(on_policy_pass):
    """Teacher-forced again over its own continuations: KL 0, EAR 1, top-1 1, delta-NLL 0, from a real pass."""
    itself = on_policy_pass.itself
    assert np.all(itself.kld == 0.0) and np.all(itself.top1_match)
    assert itself.ear == pytest.approx(np.ones_like(itself.ear), abs=1e-5)
    assert np.array_equal(itself.variant_nll, itself.baseline_nll)
    metrics = on_policy_pass.baseline.metrics
    assert metrics["quality/on_policy/generated/kld_mean"] == 0.0
    assert metrics["quality/on_policy/generated/ear"] == 1.0
    assert metrics["quality/on_policy/generated/top1_agreement"] == 1.0


def test_the_stored_sequences_are_prompt_and_greedy_continuation(on_policy_pass):
    ref_dir = on_policy.on_policy_reference_dir(on_policy_pass.work / "references" / "key")
    info = reference.read_reference(ref_dir)
    windows = reference.reference_windows(info)
    prompt_lengths = reference.read_meta(ref_dir)["prompt_lengths"]
    assert len(windows) == 3 and all(w.score_from == w.start + 1 for w in windows)
    assert sum(w.n_scored for w in windows) == info.n_scored
    tokens = np.load(ref_dir / reference.TOKENS_FILE)
    first = on_policy_pass.tokenizer.decode(tokens[windows[0].start : windows[0].start + prompt_lengths[0]].tolist())
    assert "<|im_start|>user" in first and first.rstrip().endswith("<|im_start|>assistant")  # the chat template
    generated = on_policy_pass.baseline.metrics["quality/on_policy/generated/tokens"]
    assert 3 <= generated <= 3 * 12
    # Greedy: the baseline's arg-max over the generated positions is the next stored token wherever it continued.
    top1 = np.load(ref_dir / reference.TOP1_FILE)
    positions = on_policy.generated_positions(prompt_lengths, [w.end - w.start for w in windows])
    targets = np.concatenate([tokens[w.score_from : w.end] for w in windows])
    assert np.mean(top1[positions > 0] == targets[positions > 0]) > 0.9  # batch arithmetic may flip a near tie


def test_a_perturbed_variant_shows_damage_with_clustered_intervals(on_policy_pass):
    variant, baseline = on_policy_pass.variant, on_policy_pass.baseline
    metrics = variant.metrics
    assert set(metrics) == set(baseline.metrics)
    assert {key.split("/")[2] for key in metrics} == {"prompt", "generated", "gen1-32"}
    for part in ("prompt", "generated"):
        assert metrics[f"quality/on_policy/{part}/kld_mean"] > 0.0
        assert 0.0 < metrics[f"quality/on_policy/{part}/ear"] < 1.0
    key = "quality/on_policy/generated/kld_mean"
    paired = compare(key, variant.baseline_documents[key], variant.documents[key])
    assert paired.diff == pytest.approx(metrics[key])
    assert paired.df == 2.0  # three sequences, the clusters
    assert paired.ci95_low < paired.diff < paired.ci95_high and math.isfinite(paired.ci95_high)
