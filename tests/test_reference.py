"""The stored baseline pass and the comparison against it, on a tiny random Llama and a perturbed copy."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_llama_config
from transformers import LlamaForCausalLM

from quantlab.evaluate.reference import (
    TokenComparison,
    Window,
    baseline_comparison,
    compare_tokens,
    corpus_token_ids,
    encode_logprobs,
    read_reference,
    reference_bytes_bound,
    scoring_windows,
    stored_kld,
    window_index,
    write_reference,
)

VOCAB = 512
N_TOKENS = 150


def tiny_llama(vocab_size: int = VOCAB, seed: int = 0) -> LlamaForCausalLM:
    config = tiny_llama_config(vocab_size=vocab_size, max_position_embeddings=256)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def baseline() -> LlamaForCausalLM:
    model = tiny_llama()
    # Random init gives nearly uniform predictions; sharper ones resemble a trained model.
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


@pytest.fixture(scope="module")
def variant(baseline) -> LlamaForCausalLM:
    """The baseline with every weight disturbed by 5% relative noise: a stand-in for quantization."""
    model = copy.deepcopy(baseline)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.add_(0.05 * parameter.abs().mean() * noise)
    return model


@pytest.fixture(scope="module")
def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (N_TOKENS,), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def reference(baseline, token_ids, tmp_path_factory):
    return write_reference(baseline, token_ids, tmp_path_factory.mktemp("ref") / "baseline", window=64, stride=32)


@pytest.mark.parametrize(
    ("n_tokens", "window", "stride", "expected"),
    [
        # non-overlapping: each window's first token is context only
        (10, 4, 4, [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]),
        # a last window with a single token scores nothing and is dropped
        (9, 4, 4, [Window(0, 4, 1), Window(4, 8, 5)]),
        # overlapping: the first window scores all it can, later ones their last `stride` tokens
        (10, 4, 2, [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]),
        (11, 4, 2, [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8), Window(8, 11, 10)]),
        # one window covers everything
        (5, 8, 8, [Window(0, 5, 1)]),
    ],
)
def test_scoring_windows(n_tokens, window, stride, expected):
    windows = scoring_windows(n_tokens, window, stride)
    assert list(windows) == expected
    targets = [t for w in windows for t in range(w.score_from, w.end)]
    assert len(targets) == len(set(targets)), "a token is scored twice"


@pytest.mark.parametrize(("n_tokens", "window", "stride"), [(1, 4, 4), (10, 1, 1), (10, 4, 5), (10, 4, 0)])
def test_scoring_windows_refuses_bad_shapes(n_tokens, window, stride):
    with pytest.raises(ValueError):
        scoring_windows(n_tokens, window, stride)


def _direct_perplexity(model, token_ids, window, stride) -> tuple[float, int]:
    """Hugging Face's documented strided perplexity loop, with plain cross-entropy."""
    total_nll, scored, previous_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, len(token_ids), stride):
            end = min(begin + window, len(token_ids))
            target_length = end - previous_end
            inputs = token_ids[begin:end]
            targets = inputs.clone()
            targets[:-target_length] = -100
            logits = model(inputs[None]).logits[0].float()
            total_nll += F.cross_entropy(logits[:-1], targets[1:], ignore_index=-100, reduction="sum").item()
            scored += int((targets[1:] != -100).sum())
            previous_end = end
            if end == len(token_ids):
                break
    return math.exp(total_nll / scored), scored


@pytest.mark.parametrize(("window", "stride"), [(64, 64), (64, 16), (50, 50), (200, 200)])
def test_perplexity_equals_direct_cross_entropy(baseline, variant, token_ids, tmp_path, window, stride):
    info = write_reference(baseline, token_ids, tmp_path / "ref", window=window, stride=stride)
    damage = compare_tokens(variant, info.path).metrics()

    baseline_ppl, scored = _direct_perplexity(baseline, token_ids, window, stride)
    variant_ppl, _ = _direct_perplexity(variant, token_ids, window, stride)
    assert info.n_scored == damage["quality/ppl_tokens"] == scored
    assert info.baseline_ppl == pytest.approx(baseline_ppl, rel=1e-4)
    assert damage["quality/ppl"] == pytest.approx(variant_ppl, rel=1e-4)
    assert damage["quality/ln_ppl_ratio"] == pytest.approx(math.log(variant_ppl / baseline_ppl), abs=1e-4)


def test_model_against_itself_is_exactly_zero(baseline, reference):
    comparison = compare_tokens(baseline, reference.path)
    assert np.all(comparison.kld == 0.0)
    assert comparison.top1_match.all()
    np.testing.assert_array_equal(comparison.variant_nll, comparison.baseline_nll)
    metrics = comparison.metrics()
    assert metrics["quality/kld_max"] == 0.0
    assert metrics["quality/top1_agreement"] == 1.0
    assert metrics["quality/delta_p_rms"] == 0.0
    assert metrics["quality/ln_ppl_ratio"] == 0.0


def test_baseline_row_has_the_same_keys_and_values_as_a_self_comparison(baseline, variant, reference):
    own_row = baseline_comparison(reference.path).metrics()
    assert own_row == compare_tokens(baseline, reference.path).metrics()
    assert own_row.keys() == compare_tokens(variant, reference.path).metrics().keys()
    assert own_row["quality/ppl"] == pytest.approx(reference.baseline_ppl)


def _exact_per_token(baseline, variant, token_ids, windows):
    """Float32 in-memory KL(P||Q), argmax agreement and variant NLL over the same scored tokens."""
    kld, agree, nll = [], [], []
    with torch.no_grad():
        for w in windows:
            inputs = token_ids[w.start : w.end][None]
            rows = slice(w.score_from - w.start - 1, w.end - w.start - 1)
            log_p = baseline(inputs).logits[0, rows].float().log_softmax(-1)
            log_q = variant(inputs).logits[0, rows].float().log_softmax(-1)
            kld.append((log_p.exp() * (log_p - log_q)).sum(-1))
            agree.append(log_p.argmax(-1) == log_q.argmax(-1))
            nll.append(-log_q.gather(-1, token_ids[w.score_from : w.end, None])[:, 0])
    return torch.cat(kld).numpy(), torch.cat(agree).numpy(), torch.cat(nll).numpy()


def test_stored_form_reproduces_exact_kl_within_its_bound(baseline, variant, token_ids, reference):
    comparison = compare_tokens(variant, reference.path)
    windows = scoring_windows(reference.n_tokens, reference.window, reference.stride)
    exact_kld, exact_agree, exact_nll = _exact_per_token(baseline, variant, token_ids, windows)

    error = np.abs(comparison.kld.astype(np.float64) - exact_kld)
    assert np.all(error <= comparison.kld_error_bound), f"worst excess {np.max(error - comparison.kld_error_bound)}"
    # The variant differs measurably, and the bound is small against the divergence it bounds.
    assert exact_kld.mean() > 1e-3
    assert comparison.kld_error_bound.mean() < 0.05 * exact_kld.mean()
    np.testing.assert_array_equal(comparison.top1_match, exact_agree)
    np.testing.assert_allclose(comparison.variant_nll, exact_nll, rtol=1e-5)
    assert 0.0 < comparison.metrics()["quality/top1_agreement"] < 1.0


@pytest.mark.parametrize(
    ("p", "q", "closed_form"),
    [
        ([0.5, 0.25, 0.25], [0.25, 0.5, 0.25], 0.25 * math.log(2)),
        ([0.7, 0.2, 0.1], [0.1, 0.2, 0.7], 0.6 * math.log(7)),
        ([0.9, 0.1], [0.9, 0.1], 0.0),
    ],
)
def test_stored_kld_of_fixed_distributions_equals_closed_form(p, q, closed_form):
    log_p = torch.tensor([p]).log()
    log_q = torch.tensor([q]).log()
    kld, bound = stored_kld(encode_logprobs(log_p), log_q)
    assert abs(kld.item() - closed_form) <= bound.item()
    assert bound.item() < 1e-3
    if p == q:
        assert kld.item() == 0.0


def test_size_bound_holds_on_disk(reference):
    on_disk = sum(f.stat().st_size for f in reference.path.iterdir())
    assert 2 * reference.n_scored * VOCAB <= on_disk <= reference_bytes_bound(N_TOKENS, reference.n_scored, VOCAB)


def test_size_bound_of_a_large_vocabulary_model():
    # The module docstring's example: 128k vocabulary, 4,096 scored tokens, at most 1 GiB.
    assert reference_bytes_bound(4097, 4096, 128 * 1024) <= 2**30 + 2**16


def test_a_failed_pass_leaves_no_partial_reference(baseline, token_ids, tmp_path):
    def crash(done, total):
        raise RuntimeError("killed mid-pass")

    out_dir = tmp_path / "ref"
    with pytest.raises(RuntimeError, match="killed mid-pass"):
        write_reference(baseline, token_ids, out_dir, window=32, progress=crash)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        read_reference(out_dir)


def test_a_failed_rewrite_keeps_the_previous_reference(baseline, token_ids, tmp_path):
    out_dir = tmp_path / "ref"
    first = write_reference(baseline, token_ids, out_dir, window=64)

    def crash(done, total):
        raise RuntimeError("killed mid-pass")

    with pytest.raises(RuntimeError):
        write_reference(baseline, token_ids[:100], out_dir, window=32, progress=crash)
    assert read_reference(out_dir) == first
    assert [p.name for p in tmp_path.iterdir()] == ["ref"]


def test_an_existing_reference_is_replaced_and_anything_else_refused(baseline, token_ids, tmp_path):
    out_dir = tmp_path / "ref"
    write_reference(baseline, token_ids, out_dir, window=64)
    second = write_reference(baseline, token_ids[:100], out_dir, window=32)
    assert (second.n_tokens, second.window) == (100, 32)

    foreign = tmp_path / "results"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not a reference")
    with pytest.raises(FileExistsError, match="not a baseline reference"):
        write_reference(baseline, token_ids, foreign, window=64)
    assert (foreign / "keep.txt").read_text() == "not a reference"


def test_progress_reports_scored_tokens(baseline, token_ids, tmp_path):
    calls = []
    info = write_reference(baseline, token_ids, tmp_path / "ref", window=64, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(63, 147), (126, 147), (147, 147)]
    assert info.n_scored == 147


def test_a_model_with_another_vocabulary_is_refused(reference):
    with pytest.raises(ValueError, match="not the same tokenizer"):
        compare_tokens(tiny_llama(vocab_size=256), reference.path)


def test_a_directory_without_reference_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no baseline reference"):
        compare_tokens(tiny_llama(), tmp_path)


def test_compare_restores_training_mode(variant, reference):
    variant.train()
    try:
        compare_tokens(variant, reference.path)
        assert variant.training
    finally:
        variant.eval()


class _WordTokenizer:
    """Stands in for a Hugging Face tokenizer: one id per whitespace-separated word."""

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [len(word) for word in text.split()]}


def test_corpus_token_ids_takes_the_first_tokens():
    ids = corpus_token_ids(_WordTokenizer(), "a bb ccc dddd eeeee", max_tokens=3)
    assert ids.dtype == torch.int64
    assert ids.tolist() == [1, 2, 3]
    assert corpus_token_ids(_WordTokenizer(), "a bb", max_tokens=10).tolist() == [1, 2]


def test_corpus_token_ids_needs_two_tokens():
    with pytest.raises(ValueError, match="at least 2"):
        corpus_token_ids(_WordTokenizer(), "lonely", max_tokens=10)


def test_a_comparison_carries_the_window_of_every_scored_token(variant, reference):
    """Tokens of one window share their context: the windows are the clusters of the standard errors."""
    comparison = compare_tokens(variant, reference.path)
    windows = scoring_windows(reference.n_tokens, reference.window, reference.stride)
    expected = np.concatenate([np.full(w.n_scored, i) for i, w in enumerate(windows)])
    np.testing.assert_array_equal(comparison.windows, expected)
    np.testing.assert_array_equal(baseline_comparison(reference.path).windows, expected)
    assert len(windows) > 1

    documents = comparison.documents()
    assert all(scores.clusters == dict(enumerate(expected.tolist())) for scores in documents.values())
    # kld_mean_stderr: cluster-robust by hand, sqrt(G / (G - 1) * sum over windows of (sum of x - mean)^2) / N.
    kld = comparison.kld.astype(np.float64)
    sums = np.array([np.sum(kld[expected == g] - kld.mean()) for g in range(len(windows))])
    by_hand = math.sqrt(len(windows) / (len(windows) - 1) * np.sum(sums**2)) / kld.size
    assert comparison.metrics()["quality/kld_mean_stderr"] == pytest.approx(by_hand, rel=1e-9)


def test_window_index_by_hand():
    windows = scoring_windows(10, 4, 4)  # scores tokens 1-3, 5-7 and 9 (a window's first token is only context)
    np.testing.assert_array_equal(window_index(windows), [0, 0, 0, 1, 1, 1, 2])


def test_a_comparison_without_a_window_per_token_is_refused():
    nll = np.ones(4)
    with pytest.raises(ValueError, match="windows has shape"):
        TokenComparison.of_baseline(nll, np.zeros(3))
