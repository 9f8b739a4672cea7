"""The baseline's forward pass over the perplexity corpus, stored once per sweep, and every variant's
comparison against it, in the variant's own process (two models are never loaded at once): perplexity,
KL divergence, top-1 agreement, Δp. Size on disk: at most :func:`reference_bytes_bound`, e.g. a 128k
vocabulary over 4,096 scored tokens takes at most 1 GiB + 53 KiB."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantlab import cache
from quantlab.evaluate.damage import perplexity, token_damage
from quantlab.paired import Aggregation, DocumentScores

FORMAT = "quantlab.reference/1"
INFO_FILE = "reference.json"
TOKENS_FILE = "token_ids.npy"
NLL_FILE = "baseline_nll.npy"
TOP1_FILE = "baseline_top1.npy"
LOGPROBS_FILE = "logprobs.npy"
# Explicit windows ([start, end, score_from] rows), where the stored tokens are several sequences rather than one text
# cut by window and stride (quantlab.evaluate.on_policy: a prompt and its continuation per window).
WINDOWS_FILE = "windows.npy"
_INFO_FIELDS = ("window", "stride", "n_tokens", "n_scored", "vocab_size", "baseline_ppl", "baseline_model")

# Largest float32 block of log-probability rows processed at once (~10 temporaries live: ~40 MiB beyond
# the logits). Small on purpose: on CPU, glibc page-faults temporaries above its mmap threshold afresh.
BLOCK_BYTES = 4 * 2**20

FP16_LOWEST = float(torch.finfo(torch.float16).min)  # stored log-probabilities are clamped here (-65504)
FP16_UNIT_ROUNDOFF = 2.0**-11
FP16_SUBNORMAL_ERROR = 2.0**-25
_FIXED_OVERHEAD_BYTES = 4096  # four .npy headers (128 bytes each) and reference.json

Progress = Callable[[int, int], None]  # progress(scored_tokens_done, scored_tokens_total) after each window


@dataclass(frozen=True)
class Window:
    """Tokens ``[start, end)`` go through the model; targets ``[score_from, end)`` are scored."""

    start: int
    end: int
    score_from: int

    @property
    def n_scored(self) -> int:
        return self.end - self.score_from


def scoring_windows(n_tokens: int, window: int, stride: int) -> tuple[Window, ...]:
    """Windows of ``window`` tokens started every ``stride`` tokens. Every token from the second on is
    scored once, predicted from the tokens before it in its window: the first window scores all it
    can, each later one the tokens the previous one did not reach (its last ``stride``), so with
    ``stride < window`` every scored token sees at least ``window - stride`` tokens of context."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be between 1 and window ({window}), got {stride}")
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score one, got {n_tokens}")
    windows = [Window(start=0, end=min(window, n_tokens), score_from=1)]  # token 0 is never a target
    while windows[-1].end < n_tokens:
        start = windows[-1].start + stride
        windows.append(Window(start, min(start + window, n_tokens), score_from=max(start + 1, windows[-1].end)))
    return tuple(w for w in windows if w.n_scored > 0)  # a last window of one token scores nothing


def reference_bytes_bound(n_tokens: int, n_scored: int, vocab_size: int) -> int:
    """Upper bound on a stored reference's size on disk, in bytes."""
    return 2 * n_scored * vocab_size + 4 * n_tokens + 8 * n_scored + _FIXED_OVERHEAD_BYTES


@dataclass(frozen=True)
class ReferenceInfo:
    """A complete stored baseline pass."""

    path: Path
    window: int
    stride: int
    n_tokens: int
    n_scored: int
    vocab_size: int
    baseline_ppl: float
    baseline_model: str


def corpus_token_ids(tokenizer: Callable[..., Mapping[str, Any]], text: str, max_tokens: int) -> torch.Tensor:
    """The first ``max_tokens`` token ids of ``text`` (fewer if the text is shorter), int64 1-D; no
    special tokens are added: the windows score plain text, the same for every variant."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the text gives {len(ids)} token(s); at least 2 are needed")
    return torch.tensor(ids, dtype=torch.int64)


def write_reference(
    model: torch.nn.Module,
    token_ids: torch.Tensor | Sequence[int],
    out_dir: Path,
    *,
    window: int = 512,
    stride: int | None = None,
    progress: Progress | None = None,
    windows: Sequence[Window] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> ReferenceInfo:
    """Run the baseline (a Hugging Face causal LM, on any device) over ``token_ids`` and store in
    ``out_dir``, written aside and renamed into place when complete: the corpus, and per scored token
    the baseline's exact NLL, float32 arg-max and log-probabilities rounded to fp16 ``[n_scored, vocab]``.

    ``stride`` defaults to ``window`` (non-overlapping). ``windows``, instead of ``window`` and ``stride``: the
    windows themselves (each within the tokens; ``window`` and ``stride`` are then recorded as the longest), stored
    with the reference. ``meta``: JSON-able facts stored with it for whoever wrote it (`read_meta`). An existing
    reference at ``out_dir`` is replaced; any other existing non-empty path is refused. The model's train/eval mode
    is restored.
    """
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu()
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    explicit = windows is not None
    if windows is None:
        stride = window if stride is None else stride
        windows = scoring_windows(len(token_ids), window, stride)
    else:
        windows = _checked_windows(windows, len(token_ids))
        window = stride = max(w.end - w.start for w in windows)
    n_scored = sum(w.n_scored for w in windows)
    out_dir = Path(out_dir)
    # Replacing means deleting: only ever delete something that is recognisably a reference.
    if out_dir.exists() and not (out_dir / INFO_FILE).is_file() and (out_dir.is_file() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not a baseline reference; refusing to replace it")
    with cache.atomic_directory(out_dir, replace_existing=True) as staging:
        np.save(staging / TOKENS_FILE, token_ids.numpy().astype(np.int32))
        if explicit:
            np.save(staging / WINDOWS_FILE, np.array([[w.start, w.end, w.score_from] for w in windows], dtype=np.int64))
        nll = np.empty(n_scored, dtype=np.float32)
        top1 = np.empty(n_scored, dtype=np.int32)
        logprobs: np.memmap | None = None
        for rows, block, block_nll, block_top1 in _logprob_blocks(model, token_ids, windows, progress):
            if logprobs is None:
                shape = (n_scored, block.shape[-1])
                logprobs = np.lib.format.open_memmap(staging / LOGPROBS_FILE, mode="w+", dtype=np.float16, shape=shape)
            logprobs[rows] = encode_logprobs(block).cpu().numpy()
            nll[rows], top1[rows] = block_nll, block_top1
        assert logprobs is not None
        vocab_size = int(logprobs.shape[1])
        logprobs.flush()
        del logprobs  # close the map before the directory moves
        np.save(staging / NLL_FILE, nll)
        np.save(staging / TOP1_FILE, top1)
        config = getattr(model, "config", None)
        info = {
            "format": FORMAT,
            "window": window,
            "stride": stride,
            "n_tokens": len(token_ids),
            "n_scored": n_scored,
            "vocab_size": vocab_size,
            "baseline_ppl": perplexity(nll),
            "baseline_model": str(getattr(config, "_name_or_path", "") or type(model).__name__)[:256],
            "logprobs_dtype": "float16",
        } | ({"meta": dict(meta)} if meta is not None else {})
        (staging / INFO_FILE).write_text(json.dumps(info, indent=1))
    return read_reference(out_dir)


def read_reference(ref_dir: Path) -> ReferenceInfo:
    """The description of a complete reference; raises if ``ref_dir`` is not one."""
    ref_dir = Path(ref_dir)
    info_path = ref_dir / INFO_FILE
    if not info_path.is_file():
        raise FileNotFoundError(f"{ref_dir} holds no baseline reference ({INFO_FILE} missing)")
    info = json.loads(info_path.read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{info_path}: format {info.get('format')!r}, expected {FORMAT!r}")
    missing = [name for name in (TOKENS_FILE, NLL_FILE, TOP1_FILE, LOGPROBS_FILE) if not (ref_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{ref_dir}: incomplete reference, missing {missing}")
    return ReferenceInfo(path=ref_dir, **{name: info[name] for name in _INFO_FIELDS})


def read_meta(ref_dir: Path) -> dict[str, Any]:
    """What the reference's writer stored with it (`write_reference`'s ``meta``; empty if none)."""
    return dict(json.loads((read_reference(ref_dir).path / INFO_FILE).read_text()).get("meta", {}))


def reference_windows(info: ReferenceInfo) -> tuple[Window, ...]:
    """The windows the reference scored: its stored ones, else those of its window and stride."""
    if (info.path / WINDOWS_FILE).is_file():
        return tuple(Window(*map(int, row)) for row in np.load(info.path / WINDOWS_FILE))
    return scoring_windows(info.n_tokens, info.window, info.stride)


def _checked_windows(windows: Sequence[Window], n_tokens: int) -> tuple[Window, ...]:
    windows = tuple(windows)
    if not windows:
        raise ValueError("no windows given")
    for w in windows:
        if not 0 <= w.start < w.score_from < w.end <= n_tokens:
            raise ValueError(f"{w} scores nothing or lies outside the {n_tokens} tokens")
    return windows


@dataclass(frozen=True, eq=False)
class TokenComparison:
    """Per scored token: the variant against the stored baseline (arrays of length n_scored). `windows`: the
    scoring window (or document) each token was scored in, numbered from 0 (`window_index`): tokens of one
    window share their context and are correlated, so the windows are the sampled units of every standard
    error (cluster-robust). Whoever produces a comparison knows its windows and must give them."""

    kld: np.ndarray
    kld_error_bound: np.ndarray
    baseline_nll: np.ndarray
    variant_nll: np.ndarray
    top1_match: np.ndarray
    windows: np.ndarray
    # Expected acceptance rate per token, sum over the vocabulary of min(p, q) at the stored precision (1 - total
    # variation distance): what a speculative decoder drafting with one model and verifying with the other accepts.
    ear: np.ndarray | None = None

    def __post_init__(self) -> None:
        if np.shape(self.windows) != np.shape(self.variant_nll):
            raise ValueError(
                f"windows has shape {np.shape(self.windows)}, the scored tokens {np.shape(self.variant_nll)}"
            )

    @classmethod
    def of_baseline(cls, nll: np.ndarray, windows: np.ndarray) -> TokenComparison:
        """The baseline against itself: its own NLL, no KL from itself, always its own top-1."""
        return cls(
            np.zeros_like(nll), np.zeros_like(nll), nll, nll, np.ones(nll.shape, dtype=bool), windows, np.ones_like(nll)
        )

    def metrics(self) -> dict[str, float]:
        return token_damage(self.kld, self.baseline_nll, self.variant_nll, self.top1_match, self.windows)

    def documents(self) -> dict[str, DocumentScores]:
        """Per token, as `quantlab.paired` compares: perplexity as a weighted perplexity of one token
        each (the paired difference is the ratio of perplexities), KL and top-1 agreement as means; each
        token in the cluster of its window, so the paired standard errors are cluster-robust over windows."""
        ones = dict.fromkeys(range(len(self.variant_nll)), 1.0)
        clusters = _per_token(self.windows, int)
        return {
            "quality/ppl": DocumentScores(
                Aggregation.WEIGHTED_PERPLEXITY, _per_token(-self.variant_nll), ones, clusters
            ),
            "quality/kld_mean": DocumentScores(Aggregation.MEAN, _per_token(self.kld), clusters=clusters),
            "quality/top1_agreement": DocumentScores(Aggregation.MEAN, _per_token(self.top1_match), clusters=clusters),
        }


def window_index(windows: Sequence[Window]) -> np.ndarray:
    """Per scored token, in scoring order, the index of the window that scored it."""
    return np.repeat(np.arange(len(windows)), [w.n_scored for w in windows])


def baseline_comparison(ref_dir: Path) -> TokenComparison:
    """The baseline's own row: its stored values compared with themselves (no forward pass)."""
    info = read_reference(ref_dir)
    windows = window_index(reference_windows(info))
    return TokenComparison.of_baseline(np.load(info.path / NLL_FILE), windows)


def compare_tokens(model: torch.nn.Module, ref_dir: Path) -> TokenComparison:
    """Run ``model`` over the reference's tokens and windows and compare token by token."""
    info = read_reference(ref_dir)
    token_ids = torch.from_numpy(np.load(info.path / TOKENS_FILE).astype(np.int64))
    windows = reference_windows(info)
    stored = np.load(info.path / LOGPROBS_FILE, mmap_mode="r")
    baseline_top1 = np.load(info.path / TOP1_FILE)
    kld, bound, variant_nll, ear = (np.empty(info.n_scored, dtype=np.float32) for _ in range(4))
    top1_match = np.empty(info.n_scored, dtype=bool)
    # Checked before the first forward pass too: a smaller embedding fails on the corpus' ids.
    _check_vocab(getattr(getattr(model, "config", None), "vocab_size", None), info)
    for rows, block, block_nll, block_top1 in _logprob_blocks(model, token_ids, windows, None):
        _check_vocab(block.shape[-1], info)
        baseline_block = torch.from_numpy(np.array(stored[rows])).to(block.device)
        block_kld, block_bound, block_ear = _stored_comparison(baseline_block, block)
        kld[rows], bound[rows], ear[rows] = block_kld.cpu().numpy(), block_bound.cpu().numpy(), block_ear.cpu().numpy()
        variant_nll[rows], top1_match[rows] = block_nll, block_top1 == baseline_top1[rows]
    baseline_nll = np.load(info.path / NLL_FILE)
    return TokenComparison(kld, bound, baseline_nll, variant_nll, top1_match, window_index(windows), ear)


def encode_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """The stored precision: fp16, clamped to fp16's finite range."""
    return logprobs.clamp_min(FP16_LOWEST).to(torch.float16)


def stored_kld(reference: torch.Tensor, variant_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(P̃ || Q̃) at the stored precision, P̃ = softmax(fp16(log P)) and Q̃ = softmax(fp16(log Q))
    (a deterministic model against itself gives exactly 0), and a bound on its distance from KL(P || Q).

    ``reference``: stored fp16 baseline log-probabilities ``[rows, vocab]``; ``variant_logprobs``: the
    variant's float32 ones ``m``. fp16 moves each stored ``l`` by at most ``u·|l|`` (u = 2^-11; 2^-25
    below fp16's normal range), renormalising by ``c = logsumexp(l̃)``; with ``d = u/(1-u)·|l̃| + 2^-25 + |c|``::

        |KL(P̃||Q̃) - KL(P||Q)| <= Σ P̃·expm1(d)·(|ln P̃ - m| + d) + Σ P̃·e^d·expm1(d)²
                                  + |Σ P̃·(ln Q̃ - m)| + float32 summation slack

    (P̃ vs P weights; KL(P̃||P) <= χ²; the variant's own rounding, known exactly). The dominant term,
    ``u·E_P̃[|ln P̃|·|ln P̃ - ln Q|]``, grows like √KL: the bound is relatively largest for mild variants.
    """
    kld, bound, _ = _stored_comparison(reference, variant_logprobs)
    return kld, bound


def expected_acceptance(reference: torch.Tensor, variant_logprobs: torch.Tensor) -> torch.Tensor:
    """Per row, the sum over the vocabulary of min(P̃, Q̃): the chance a token drawn from one is accepted by
    speculative sampling against the other (1 - total variation distance), 1 for identical rows and 0 for
    disjoint ones. P̃ and Q̃ as in `stored_kld`: both at the stored precision, so a model against itself gives 1."""
    return _stored_comparison(reference, variant_logprobs)[2]


def _stored_comparison(
    reference: torch.Tensor, variant_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(`stored_kld`'s KL and bound, `expected_acceptance`) per row, the renormalised rows computed once."""
    stored = reference.float()
    exact_variant = variant_logprobs.float().clamp_min(FP16_LOWEST)
    log_p, p, shift = _renormalized(stored)
    log_q, q, _ = _renormalized(encode_logprobs(exact_variant).float())
    kld = torch.linalg.vecdot(p, log_p - log_q)
    acceptance = torch.minimum(p, q).sum(-1)
    del q

    # Per entry, ``rounding`` is d and ``distance`` is |ln P̃ - m|. The first two terms are summed
    # as one, P̃·expm1(d)·(distance + d + expm1(d)² + expm1(d)), as e^d = 1 + expm1(d).
    distance = (log_p - exact_variant).abs_()
    rounding = stored.abs().mul_(FP16_UNIT_ROUNDOFF / (1 - FP16_UNIT_ROUNDOFF))
    rounding.add_(FP16_SUBNORMAL_ERROR + shift.abs())
    rounding_m1 = rounding.expm1()
    weights_and_chi_square = torch.addcmul(rounding_m1, rounding_m1, rounding_m1).add_(distance).add_(rounding)
    weights_and_chi_square.mul_(rounding_m1)
    variant_rounding = torch.linalg.vecdot(p, log_q - exact_variant).abs()
    # Sums of up to `vocab` float32 terms, reduced pairwise by torch: a few ulps per level.
    summation_ulps = math.ceil(math.log2(stored.shape[-1])) + 8
    summation = summation_ulps * 2.0**-24 * (1 + torch.linalg.vecdot(p, distance))
    return kld, torch.linalg.vecdot(p, weights_and_chi_square) + variant_rounding + summation, acceptance


def _renormalized(logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probabilities, probabilities, shift) after making rounded log-probabilities sum to 1.
    Plain exp is safe here, unlike for logits: rounded log-probabilities are at most ~0."""
    probs = logprobs.exp()
    total = probs.sum(-1, keepdim=True)
    shift = total.log()
    return logprobs - shift, probs.div_(total), shift


def _logprob_blocks(
    model: torch.nn.Module, token_ids: torch.Tensor, windows: Sequence[Window], progress: Progress | None
) -> Iterator[tuple[slice, torch.Tensor, np.ndarray, np.ndarray]]:
    """(rows among all scored tokens, float32 log-probabilities, NLL of the targets, arg-max) for
    the scored rows, window by window, in blocks of at most ``BLOCK_BYTES``."""
    device = next(model.parameters()).device
    total = sum(w.n_scored for w in windows)
    done = 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for w in windows:
                ids = token_ids[w.start : w.end].to(device)[None]
                # Position p predicts token p + 1: the targets [score_from, end) need the logits of
                # positions [score_from - 1, end - 1); the last position predicts past the window.
                output = model(input_ids=ids, logits_to_keep=w.n_scored + 1, use_cache=False)
                logits = output.logits[0, -(w.n_scored + 1) : -1]
                targets = ids[0, w.score_from - w.start :]
                rows_per_block = max(1, BLOCK_BYTES // (4 * logits.shape[-1]))
                for first in range(0, w.n_scored, rows_per_block):
                    rows = slice(first, min(first + rows_per_block, w.n_scored))
                    block = logits[rows].float().log_softmax(-1)
                    nll = -block.gather(-1, targets[rows, None])[:, 0]
                    scored = slice(done + rows.start, done + rows.stop)
                    yield scored, block, nll.cpu().numpy(), block.argmax(-1).cpu().numpy()
                done += w.n_scored
                if progress is not None:
                    progress(done, total)
    finally:
        model.train(was_training)


def _check_vocab(model_vocab: int | None, info: ReferenceInfo) -> None:
    if model_vocab is not None and model_vocab != info.vocab_size:
        raise ValueError(
            f"the model predicts {model_vocab} token ids, the reference at {info.path} "
            f"{info.vocab_size}: not the same tokenizer"
        )


def _per_token(values: np.ndarray, kind: type = float) -> dict[int, Any]:
    return dict(enumerate(np.asarray(values, dtype=np.int64 if kind is int else np.float64).tolist()))
