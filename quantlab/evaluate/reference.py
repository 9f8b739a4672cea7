"""The baseline's forward pass over the perplexity corpus, stored once per sweep, and every
variant's comparison against it (perplexity, KL divergence, top-1 agreement, Δp).

The baseline variant's process calls :func:`write_reference`; each later variant, in its own
process and possibly on another day, calls :func:`compare_to_reference` on the directory. Two
models are never loaded at once. The baseline's own row comes from :func:`baseline_damage`
(stored values compared with themselves: KL 0, agreement 1) without a second forward pass.

Windows
    The corpus is scored in fixed windows of ``window`` tokens started every ``stride`` tokens
    (non-overlapping by default: ``stride = window``). Every token from the second on is scored
    at most once, predicted from the tokens before it inside its window: the first window
    scores all its ``window - 1`` predictions; each later window scores only the tokens the
    previous one did not reach, i.e. its last ``stride`` tokens (its last ``window - 1`` when
    ``stride = window``, so the first token of each window is context only). With
    ``stride < window`` every scored token therefore sees at least ``window - stride`` tokens of
    context, at the price of ``window / stride`` times the compute. See :func:`scoring_windows`.

Stored form (one directory, written aside and renamed into place when complete, so a partial
reference is never read)::

    reference.json      format, window, stride, token count, vocabulary, baseline perplexity
    token_ids.npy       int32   [n_tokens]          the corpus: every variant scores these tokens
    baseline_nll.npy    float32 [n_scored]          exact -ln p_baseline(correct token)
    baseline_top1.npy   int32   [n_scored]          the baseline's float32 arg-max
    logprobs.npy        float16 [n_scored, vocab]   baseline log-probabilities rounded to fp16

Size bound: :func:`reference_bytes_bound` = ``2·n_scored·vocab + 4·n_tokens + 8·n_scored +
4 KiB`` bytes on disk (``ReferenceInfo.bytes_on_disk`` is the measured size). For example a
128k vocabulary over 4,096 scored tokens takes at most 1 GiB + 53 KiB; SmolLM2 (49,152) over 1,022
scored tokens at most 96 MiB. Memory: the log-probabilities are written and read through a
memory map in blocks of at most ``BLOCK_BYTES`` (4 MiB, or one row if a row is larger) of
float32 rows, of which a comparison keeps about ten temporaries, so the bound beyond the model's
own forward pass (its logits for the scored rows of one window) is about 40 MiB whatever the
corpus length.

Error bound: perplexity, Δp and top-1 agreement use exact float32 values. The KL divergence is
computed between the two distributions at the stored precision, KL(P̃ || Q̃) with
P̃ = softmax(fp16(log P)) and Q̃ = softmax(fp16(log Q)), so a deterministic model compared with
itself gives exactly 0. fp16 rounding moves each stored log-probability ``l`` by at most
``u·|l|`` (u = 2^-11; 2^-25 below fp16's normal range); renormalising adds the shift
``c = logsumexp(l̃)``. With ``d_i = u/(1-u)·|l̃_i| + 2^-25 + |c|`` and the variant's exact
float32 log-probabilities ``m``, per token::

    |KL(P̃||Q̃) - KL(P||Q)| <= Σ P̃·expm1(d)·(|ln P̃ - m| + d) + Σ P̃·e^d·expm1(d)²
                              + |Σ P̃·(ln Q̃ - m)| + float32 summation slack

(first term: P̃ vs P weights, second: KL(P̃||P) <= χ², third: the variant's own rounding,
known exactly). :func:`stored_kld` returns this bound with every KL; ``TokenDamage.
kld_error_bound_mean`` is its mean over tokens, a bound on the error of ``kld_mean``. Its
dominant term is ``u·E_P̃[|ln P̃|·|ln P̃ - ln Q|]``, which grows like the square root of the KL,
so it is relatively largest for the mildest variants. Measured on SmolLM2-135M over 1,022
tokens: a variant with mean KL 0.0123 had a mean bound of 2.2e-4 (actual mean error 1.7e-5);
one with mean KL 0.0011 (BF16 weights) a mean bound of 8e-5.
"""

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
from quantlab.evaluate.damage import TokenDamage, perplexity, token_damage
from quantlab.paired import Aggregation, DocumentScores

FORMAT = "quantlab.reference/1"
INFO_FILE = "reference.json"
TOKENS_FILE = "token_ids.npy"
NLL_FILE = "baseline_nll.npy"
TOP1_FILE = "baseline_top1.npy"
LOGPROBS_FILE = "logprobs.npy"

BLOCK_BYTES = 4 * 2**20
"""Largest float32 block of log-probability rows processed at once. Small on purpose: on CPU,
temporaries above glibc's mmap threshold (at most 32 MiB) are page-faulted afresh each time; on a
shared 2-core machine 4 MiB blocks compared 1,020 rows of SmolLM2's vocabulary in about 0.4 s,
32 MiB blocks in 0.6 to 3.6 s over repeated runs."""

FP16_LOWEST = float(torch.finfo(torch.float16).min)
"""Stored log-probabilities are clamped here (-65504): below it a probability is 0 in float32."""
FP16_UNIT_ROUNDOFF = 2.0**-11
FP16_SUBNORMAL_ERROR = 2.0**-25
_FIXED_OVERHEAD_BYTES = 4096  # four .npy headers (128 bytes each) and reference.json

Progress = Callable[[int, int], None]
"""Called as ``progress(scored_tokens_done, scored_tokens_total)`` after each window."""


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
    """The windows covering ``n_tokens`` tokens; see the module docstring for the rule."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be between 1 and window ({window}), got {stride}")
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score one, got {n_tokens}")
    windows: list[Window] = []
    scored_until = 1  # token 0 has no context and is never a target
    start = 0
    while scored_until < n_tokens:
        end = min(start + window, n_tokens)
        score_from = max(start + 1, scored_until)
        if score_from < end:
            windows.append(Window(start=start, end=end, score_from=score_from))
        scored_until = end
        start += stride
    return tuple(windows)


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
    bytes_on_disk: int

    @property
    def bytes_bound(self) -> int:
        return reference_bytes_bound(self.n_tokens, self.n_scored, self.vocab_size)


def corpus_token_ids(tokenizer: Callable[..., Mapping[str, Any]], text: str, max_tokens: int) -> torch.Tensor:
    """The first ``max_tokens`` token ids of ``text`` (fewer if the text is shorter), int64 1-D.

    No special tokens are added: the windows score plain text, the same for every variant.
    """
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
) -> ReferenceInfo:
    """Run the baseline over ``token_ids`` and store what comparisons need in ``out_dir``.

    ``stride`` defaults to ``window`` (non-overlapping). An existing reference at ``out_dir`` is
    replaced; any other existing non-empty path is refused. ``model`` is a Hugging Face causal
    LM (it takes ``logits_to_keep``), on any device; it runs in eval mode, its mode restored after.
    """
    token_ids = _token_vector(token_ids)
    stride = window if stride is None else stride
    windows = scoring_windows(len(token_ids), window, stride)
    n_scored = sum(w.n_scored for w in windows)
    out_dir = Path(out_dir)
    _refuse_foreign(out_dir)
    with cache.atomic_directory(out_dir, replace_existing=True) as staging:
        np.save(staging / TOKENS_FILE, token_ids.numpy().astype(np.int32))
        nll = np.empty(n_scored, dtype=np.float32)
        top1 = np.empty(n_scored, dtype=np.int32)
        logprobs: np.memmap | None = None
        row = 0
        for targets, block in _logprob_blocks(model, token_ids, windows, progress):
            if logprobs is None:
                logprobs = np.lib.format.open_memmap(
                    staging / LOGPROBS_FILE, mode="w+", dtype=np.float16, shape=(n_scored, block.shape[-1])
                )
            rows = slice(row, row + len(targets))
            nll[rows] = _nll(block, targets).cpu().numpy()
            top1[rows] = block.argmax(-1).cpu().numpy()
            logprobs[rows] = encode_logprobs(block).cpu().numpy()
            row = rows.stop
        assert logprobs is not None and row == n_scored
        vocab_size = int(logprobs.shape[1])
        logprobs.flush()
        del logprobs  # close the map before the directory moves
        np.save(staging / NLL_FILE, nll)
        np.save(staging / TOP1_FILE, top1)
        info = {
            "format": FORMAT,
            "window": window,
            "stride": stride,
            "n_tokens": len(token_ids),
            "n_scored": n_scored,
            "vocab_size": vocab_size,
            "baseline_ppl": perplexity(nll),
            "baseline_model": _model_name(model)[:256],
            "logprobs_dtype": "float16",
        }
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
    files = [ref_dir / name for name in (INFO_FILE, TOKENS_FILE, NLL_FILE, TOP1_FILE, LOGPROBS_FILE)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{ref_dir}: incomplete reference, missing {missing}")
    return ReferenceInfo(
        path=ref_dir,
        window=int(info["window"]),
        stride=int(info["stride"]),
        n_tokens=int(info["n_tokens"]),
        n_scored=int(info["n_scored"]),
        vocab_size=int(info["vocab_size"]),
        baseline_ppl=float(info["baseline_ppl"]),
        baseline_model=str(info["baseline_model"]),
        bytes_on_disk=sum(f.stat().st_size for f in files),
    )


@dataclass(frozen=True, eq=False)
class TokenComparison:
    """Per scored token: the variant against the stored baseline (arrays of length n_scored)."""

    kld: np.ndarray
    kld_error_bound: np.ndarray
    baseline_nll: np.ndarray
    variant_nll: np.ndarray
    top1_match: np.ndarray

    def damage(self) -> TokenDamage:
        return token_damage(self.kld, self.baseline_nll, self.variant_nll, self.top1_match, self.kld_error_bound)

    def documents(self) -> dict[str, DocumentScores]:
        """The variant's per-token scores, for paired statistics against the baseline's
        (`baseline_documents`) and between variants."""
        return token_documents(self.variant_nll, self.kld, self.top1_match)


def token_documents(nll: np.ndarray, kld: np.ndarray, top1_match: np.ndarray) -> dict[str, DocumentScores]:
    """Per scored token, in the shapes `quantlab.paired` compares: perplexity as a weighted
    perplexity of one token each (so the paired difference is the ratio of perplexities), KL
    and top-1 agreement as means. Tokens are the paired units here; neighbouring tokens are
    correlated, so these standard errors are on the small side (documents would be the honest
    unit, and the quality corpus is one long text)."""
    ones = {index: 1.0 for index in range(len(nll))}
    return {
        "quality/ppl": DocumentScores(
            Aggregation.WEIGHTED_PERPLEXITY, dict(enumerate((-np.asarray(nll, dtype=np.float64)).tolist())), ones
        ),
        "quality/kld_mean": DocumentScores(
            Aggregation.MEAN, dict(enumerate(np.asarray(kld, dtype=np.float64).tolist()))
        ),
        "quality/top1_agreement": DocumentScores(
            Aggregation.MEAN, dict(enumerate(np.asarray(top1_match, dtype=np.float64).tolist()))
        ),
    }


def baseline_documents(ref_dir: Path) -> dict[str, DocumentScores]:
    """The baseline's per-token scores: its own NLL, no KL from itself, always its own top-1."""
    nll = np.load(read_reference(ref_dir).path / NLL_FILE)
    return token_documents(nll, np.zeros_like(nll), np.ones(nll.shape, dtype=bool))


def compare_tokens(model: torch.nn.Module, ref_dir: Path, progress: Progress | None = None) -> TokenComparison:
    """Run ``model`` over the reference's tokens and windows and compare token by token."""
    info = read_reference(ref_dir)
    token_ids = torch.from_numpy(np.load(info.path / TOKENS_FILE).astype(np.int64))
    windows = scoring_windows(info.n_tokens, info.window, info.stride)
    stored = np.load(info.path / LOGPROBS_FILE, mmap_mode="r")
    baseline_top1 = np.load(info.path / TOP1_FILE)
    kld = np.empty(info.n_scored, dtype=np.float32)
    bound = np.empty(info.n_scored, dtype=np.float32)
    variant_nll = np.empty(info.n_scored, dtype=np.float32)
    top1_match = np.empty(info.n_scored, dtype=bool)
    # Checked before the first forward pass too: a smaller embedding fails on the corpus' ids.
    _check_vocab(getattr(getattr(model, "config", None), "vocab_size", None), info)
    row = 0
    for targets, block in _logprob_blocks(model, token_ids, windows, progress):
        _check_vocab(block.shape[-1], info)
        rows = slice(row, row + len(targets))
        reference = torch.from_numpy(np.array(stored[rows])).to(block.device)
        block_kld, block_bound = stored_kld(reference, block)
        kld[rows] = block_kld.cpu().numpy()
        bound[rows] = block_bound.cpu().numpy()
        variant_nll[rows] = _nll(block, targets).cpu().numpy()
        top1_match[rows] = block.argmax(-1).cpu().numpy() == baseline_top1[rows]
        row = rows.stop
    return TokenComparison(
        kld=kld,
        kld_error_bound=bound,
        baseline_nll=np.load(info.path / NLL_FILE),
        variant_nll=variant_nll,
        top1_match=top1_match,
    )


def compare_to_reference(model: torch.nn.Module, ref_dir: Path, progress: Progress | None = None) -> TokenDamage:
    """Token-level damage of ``model`` against the stored baseline."""
    return compare_tokens(model, ref_dir, progress).damage()


def baseline_damage(ref_dir: Path) -> TokenDamage:
    """The baseline's own row: its stored values compared with themselves (no forward pass)."""
    nll = np.load(read_reference(ref_dir).path / NLL_FILE)
    return token_damage(np.zeros_like(nll), nll, nll, np.ones(nll.shape, dtype=bool))


def encode_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """The stored precision: fp16, clamped to fp16's finite range."""
    return logprobs.clamp_min(FP16_LOWEST).to(torch.float16)


def stored_kld(reference: torch.Tensor, variant_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(P̃ || Q̃) and its error bound against the exact KL (module docstring).

    ``reference``: stored fp16 baseline log-probabilities ``[rows, vocab]``;
    ``variant_logprobs``: the variant's float32 log-probabilities, same shape.
    """
    stored = reference.float()
    exact_variant = variant_logprobs.float().clamp_min(FP16_LOWEST)
    log_p, p, shift = _renormalized(stored)
    log_q, _, _ = _renormalized(encode_logprobs(exact_variant).float())
    kld = torch.linalg.vecdot(p, log_p - log_q)

    # Per entry, ``rounding`` is the docstring's d and ``distance`` is |ln P̃ - m|. The first two
    # terms are summed as one, P̃·expm1(d)·(distance + d + expm1(d)² + expm1(d)), as e^d = 1 + expm1(d).
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
    return kld, torch.linalg.vecdot(p, weights_and_chi_square) + variant_rounding + summation


def _renormalized(logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probabilities, probabilities, shift) after making rounded log-probabilities sum to 1.

    Plain exp is safe here, unlike for logits: rounded log-probabilities are at most ~0.
    """
    probs = logprobs.exp()
    total = probs.sum(-1, keepdim=True)
    shift = total.log()
    return logprobs - shift, probs.div_(total), shift


def _logprob_blocks(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    windows: Sequence[Window],
    progress: Progress | None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(targets, float32 log-probabilities) for the scored rows, window by window, in blocks."""
    device = _device_of(model)
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
                    rows = slice(first, first + rows_per_block)
                    yield targets[rows], logits[rows].float().log_softmax(-1)
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


def _nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -logprobs.gather(-1, targets[:, None])[:, 0]


def _token_vector(token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu()
    if ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(ids.shape)}")
    return ids


def _refuse_foreign(out_dir: Path) -> None:
    # Replacing means deleting: only ever delete something that is recognisably a reference.
    if out_dir.exists() and not (out_dir / INFO_FILE).is_file() and (out_dir.is_file() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not a baseline reference; refusing to replace it")


def _device_of(model: torch.nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def _model_name(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "_name_or_path", "") or type(model).__name__)
