"""On-policy damage (the recipe's `quality.generate`): the baseline greedily continues prompts cut from the quality
corpus, and each variant is teacher-forced over prompt + the baseline's continuation, token by token against the
baseline's stored pass over the same tokens. Corpus text scores the variant on text nobody generated; here it is
scored where decoding takes it, on the baseline's own text, and damage that grows with the generated position shows
by bucket. KL(baseline || variant), top-1 agreement, expected acceptance rate (EAR, sum of min(p, q): what a
speculative decoder would accept) and ΔNLL of the baseline's tokens, for the prompt and the generated positions
apart, paired against the baseline with the sequences as clusters.

The stored pass is an ordinary baseline reference (quantlab.evaluate.reference) whose windows are the sequences, one
each, written by the baseline next to its main reference; the prompt lengths are stored with it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from quantlab.corpora import load_texts
from quantlab.evaluate import reference
from quantlab.paired import Aggregation, DocumentScores

if TYPE_CHECKING:
    import torch

    from quantlab.recipe import GenerateSettings, QualitySettings

ON_POLICY_SUFFIX = "-on-policy"  # the pass's reference directory: the main reference's, with this suffix
PREFIX = "quality/on_policy/"
SERVED_PREFIX = "quality/served/on_policy/"  # the same through the engine's prompt log-probabilities
# Generated positions are bucketed 1-32, 33-128, 129-512, ... (each bucket's last position); recipe's
# max_new_tokens stops at the last.
BUCKET_ENDS = (32, 128, 512, 2048, 8192)
# Per-token figures, and their value for the baseline against itself.
FIGURES = {"kld_mean": 0.0, "top1_agreement": 1.0, "ear": 1.0, "delta_nll": 0.0}
SETTINGS_TAG = "quantlab.quality.on_policy"  # how the prompts were made
GENERATE_BATCH = 16  # prompts the baseline continues at once


@dataclass(frozen=True)
class OnPolicyDamage:
    metrics: dict[str, float]  # quality/on_policy/<part>/<figure>
    documents: dict[str, DocumentScores]  # the same keys, per token (paired with the baseline's)
    baseline_documents: dict[str, DocumentScores]  # the baseline's own, over the same tokens
    tags: dict[str, str] = field(default_factory=dict)


def prompt_offsets(n_tokens: int, prompts: int, prompt_tokens: int) -> tuple[int, ...]:
    """Starts of `prompts` prompts of `prompt_tokens` spread evenly over `n_tokens` corpus tokens: the first at 0, the
    last ending at the corpus' end (they overlap where the corpus is short)."""
    last = n_tokens - prompt_tokens
    if last < 0:
        raise ValueError(f"the corpus has {n_tokens} tokens, fewer than one prompt of {prompt_tokens}")
    if prompts == 1:
        return (0,)
    return tuple(round(index * last / (prompts - 1)) for index in range(prompts))


def generated_positions(prompt_lengths: Sequence[int], sequence_lengths: Sequence[int]) -> np.ndarray:
    """Per scored token, in scoring order (each sequence from its second token on): 0 for a prompt token, else its
    position among its sequence's generated tokens, from 1."""
    parts = []
    for prompt, length in zip(prompt_lengths, sequence_lengths, strict=True):
        if not 1 <= prompt <= length:
            raise ValueError(f"a prompt of {prompt} tokens in a sequence of {length}")
        targets = np.arange(1, length)
        parts.append(np.maximum(targets - prompt + 1, 0))
    return np.concatenate(parts)


def bucket_name(first: int, last: int) -> str:
    return f"gen{first}-{last}"


def parts(positions: np.ndarray, ends: Sequence[int] = BUCKET_ENDS) -> dict[str, np.ndarray]:
    """Part name -> mask over the tokens: prompt, generated, and each generated-position bucket (`ends`: each one's
    last position, increasing); a part with no token is left out. A position past the last end is refused."""
    positions = np.asarray(positions)
    if positions.size and positions.max() > ends[-1]:
        raise ValueError(f"generated position {int(positions.max())} is past the last bucket's end {ends[-1]}")
    found = {"prompt": positions == 0, "generated": positions > 0}
    first = 1
    for last in ends:
        found[bucket_name(first, last)] = (positions >= first) & (positions <= last)
        first = last + 1
    return {name: mask for name, mask in found.items() if mask.any()}


def per_token_figures(comparison: reference.TokenComparison) -> dict[str, np.ndarray]:
    """The figures of FIGURES per token, from a comparison with the baseline's stored pass."""
    if comparison.ear is None:
        raise ValueError("the comparison has no expected acceptance rate per token")
    return {
        "kld_mean": np.asarray(comparison.kld, dtype=np.float64),
        "top1_agreement": np.asarray(comparison.top1_match, dtype=np.float64),
        "ear": np.asarray(comparison.ear, dtype=np.float64),
        "delta_nll": np.asarray(comparison.variant_nll, dtype=np.float64) - comparison.baseline_nll,
    }


def on_policy_figures(
    figures: Mapping[str, np.ndarray], masks: Mapping[str, np.ndarray], prefix: str = PREFIX
) -> dict[str, float]:
    """<prefix><part>/<figure>: each figure's mean over each part's tokens, and the tokens counted."""
    found: dict[str, float] = {}
    for part, mask in masks.items():
        found |= {f"{prefix}{part}/{name}": float(values[mask].mean()) for name, values in figures.items()}
        found[f"{prefix}{part}/tokens"] = float(mask.sum())
    return found


def on_policy_documents(
    figures: Mapping[str, np.ndarray], masks: Mapping[str, np.ndarray], sequences: np.ndarray, prefix: str = PREFIX
) -> dict[str, DocumentScores]:
    """The same keys per token (token index -> value), each token in the cluster of its sequence: tokens of one
    sequence share a context and, past the prompt, the continuation that the earlier ones chose."""
    found: dict[str, DocumentScores] = {}
    for part, mask in masks.items():
        tokens = np.flatnonzero(mask).tolist()
        clusters = dict(zip(tokens, np.asarray(sequences)[mask].astype(np.int64).tolist()))
        for name, values in figures.items():
            found[f"{prefix}{part}/{name}"] = DocumentScores(
                Aggregation.MEAN, dict(zip(tokens, values[mask].tolist())), clusters=clusters
            )
    return found


def on_policy_damage(
    model: torch.nn.Module, tokenizer, settings: QualitySettings, recipe_dir: Path, reference_dir: Path, job: Any
) -> OnPolicyDamage:
    """The variant over the baseline's sequences against the baseline's stored pass (both written here by the
    baseline, next to its main reference). `job`: a quantlab.jobs.VariantJob (is_baseline, force)."""
    ref_dir = on_policy_reference_dir(Path(reference_dir))
    if job.is_baseline:
        if job.force or not (ref_dir / reference.INFO_FILE).is_file():
            write_on_policy_reference(model, tokenizer, settings, recipe_dir, ref_dir)
        tokens = reference.baseline_comparison(ref_dir)
    else:
        tokens = reference.compare_tokens(model, ref_dir)
    masks = sequence_parts(ref_dir)
    baseline = reference.TokenComparison.of_baseline(tokens.baseline_nll, tokens.windows)
    figures = per_token_figures(tokens)
    return OnPolicyDamage(
        on_policy_figures(figures, masks),
        on_policy_documents(figures, masks, tokens.windows),
        on_policy_documents(per_token_figures(baseline), masks, tokens.windows),
        {SETTINGS_TAG: reference.read_meta(ref_dir)["described"]},
    )


def sequence_parts(ref_dir: Path) -> dict[str, np.ndarray]:
    """`parts` of the stored on-policy pass's scored tokens, from its sequences and their prompt lengths."""
    windows = reference.reference_windows(reference.read_reference(ref_dir))
    return parts(
        generated_positions(reference.read_meta(ref_dir)["prompt_lengths"], [w.end - w.start for w in windows])
    )


def on_policy_reference_dir(reference_dir: Path) -> Path:
    return reference_dir.with_name(reference_dir.name + ON_POLICY_SUFFIX)


def write_on_policy_reference(
    model: torch.nn.Module, tokenizer, settings: QualitySettings, recipe_dir: Path, ref_dir: Path
) -> reference.ReferenceInfo:
    """The baseline's continuations of the prompts and its stored pass over prompt + continuation."""
    generate = settings.generate
    text = "\n\n".join(load_texts(settings.corpus, recipe_dir))
    corpus = reference.corpus_token_ids(
        tokenizer, text, max(settings.max_tokens, generate.prompts * generate.prompt_tokens)
    ).tolist()
    prompts = [
        corpus[start : start + generate.prompt_tokens]
        for start in prompt_offsets(len(corpus), generate.prompts, generate.prompt_tokens)
    ]
    templated = bool(getattr(tokenizer, "chat_template", None))
    if templated:
        prompts = [chat_prompt(tokenizer, prompt) for prompt in prompts]
    limit = getattr(model.config, "max_position_embeddings", None)
    continuations = greedy_continuations(model, prompts, generate, _eos_ids(model, tokenizer), limit)
    sequences = [prompt + continuation for prompt, continuation in zip(prompts, continuations)]
    starts = np.cumsum([0] + [len(sequence) for sequence in sequences])
    windows = [reference.Window(int(a), int(b), int(a) + 1) for a, b in zip(starts[:-1], starts[1:])]
    described = (
        f"{len(prompts)} prompts of {generate.prompt_tokens} corpus tokens"
        + (" in the tokenizer's chat template (a user turn, the assistant's turn opened)" if templated else "")
        + f", continued greedily by the baseline for up to {generate.max_new_tokens} tokens "
        f"({sum(map(len, continuations))} generated)"
    )
    meta = {"prompt_lengths": [len(prompt) for prompt in prompts], "described": described}
    token_ids = [token for sequence in sequences for token in sequence]
    return reference.write_reference(model, token_ids, ref_dir, windows=windows, meta=meta)


def chat_prompt(tokenizer, corpus_ids: Sequence[int]) -> list[int]:
    """The corpus excerpt as a user turn, with the assistant's turn opened. An instruct model generates in its
    template: a bare text fragment would score it on a kind of continuation it is not served for, and the
    template's own tokens (scored as prompt positions) are where a chat deployment's requests start."""
    text = tokenizer.decode(list(corpus_ids))
    found = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = found["input_ids"] if isinstance(found, Mapping) else found
    return [int(token) for token in ids]


def greedy_continuations(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    settings: GenerateSettings,
    eos_ids: Sequence[int],
    max_positions: int | None,
) -> list[list[int]]:
    """Each prompt's greedy continuation, up to and including the first end-of-turn token (none past
    ``settings.max_new_tokens``, nor past ``max_positions`` in all). Up to GENERATE_BATCH prompts at once, shorter
    ones padded on the left and masked: one decoding loop for prompts whose templated lengths differ by a token."""
    import torch
    from transformers import GenerationConfig

    longest = max(len(prompt) for prompt in prompts)
    new = settings.max_new_tokens if max_positions is None else min(settings.max_new_tokens, max_positions - longest)
    if new < 1:
        raise ValueError(f"a prompt of {longest} tokens leaves the model's {max_positions} positions no room")
    pad = eos_ids[0] if eos_ids else 0
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=list(eos_ids) or None, pad_token_id=pad)
    device = next(model.parameters()).device
    found: list[list[int]] = []
    was_training = model.training
    model.eval()
    try:
        for first in range(0, len(prompts), GENERATE_BATCH):
            batch = prompts[first : first + GENERATE_BATCH]
            width = max(len(prompt) for prompt in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch], dtype=torch.int64, device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in batch], dtype=torch.int64, device=device
            )
            with torch.inference_mode():
                output = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            found += [_until_eos(row, eos_ids) for row in output[:, width:].tolist()]
    finally:
        model.train(was_training)
    return found


def _until_eos(tokens: list[int], eos_ids: Sequence[int]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: index + 1]
    return tokens


def _eos_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is None:
        configured = tokenizer.eos_token_id
    ids = configured if isinstance(configured, list) else [configured] if configured is not None else []
    return [int(token) for token in ids]
