"""Damage by context length (the recipe's `quality.contexts`): a second baseline pass over the quality corpus in
windows of the longest length, each scored token's KL and top-1 put in the bucket of how many tokens came before it;
and, for a variant whose KV cache is quantized, the same pass with its K/V rounding switched off, paired token by
token with the pass with it on: what the quantized KV cache alone costs at each length, on the same weights.

One pass in long windows rather than one per length: a causal model's prediction at context c is the same in any
window longer than c, so the first bucket of a 4096-token window is what a 256-token window computes, and the deep
buckets are not diluted by the short contexts that every window also scores."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from quantlab.corpora import load_texts
from quantlab.evaluate import reference
from quantlab.evaluate.damage import (
    context_buckets,
    context_lengths,
    damage_by_context,
    kv_cache_pairs,
    token_contexts,
)
from quantlab.metrics import KV_CACHE_PREFIX, Shown, paired_key, shown_in
from quantlab.paired import DocumentScores, compare

if TYPE_CHECKING:
    import torch

    from quantlab.recipe import QualitySettings

CONTEXTS_SUFFIX = "-contexts"  # the pass's reference directory: the main reference's, with this suffix
LENGTHS_TAG = "quantlab.quality.contexts"  # the lengths measured, after clipping to the model's positions
KV_CACHE_TAG = "quantlab.kv_cache.paired"  # how the KV cache's own damage was paired
PAIRED_FIGURES = shown_in(Shown.BY_CONTEXT)  # the per-token figures paired per bucket


@dataclass(frozen=True)
class ContextDamage:
    metrics: dict[str, float]  # quality/<figure>/ctx<L>, quality/kv_cache/...
    documents: dict[str, DocumentScores]  # quality/<figure>/ctx<L> -> per token (paired with the baseline's)
    baseline_documents: dict[str, DocumentScores]  # the baseline's own, over the same tokens
    tags: dict[str, str] = field(default_factory=dict)


def context_reference_dir(reference_dir: Path) -> Path:
    return reference_dir.with_name(reference_dir.name + CONTEXTS_SUFFIX)


def context_damage(
    model: torch.nn.Module,
    tokenizer,
    settings: QualitySettings,
    recipe_dir: Path,
    reference_dir: Path,
    job: Any,  # quantlab.jobs.VariantJob, not imported: jobs imports this floor's lm_eval_runner
) -> ContextDamage:
    """The pass against the baseline's stored one (written here by the baseline, next to its main reference)."""
    is_baseline = job.is_baseline
    lengths = context_lengths(settings.contexts, getattr(model.config, "max_position_embeddings", None))
    ref_dir = context_reference_dir(Path(reference_dir))
    if is_baseline:
        if job.force or not (ref_dir / reference.INFO_FILE).is_file():
            text = "\n\n".join(load_texts(settings.corpus, recipe_dir))
            token_ids = reference.corpus_token_ids(tokenizer, text, lengths[-1] * settings.context_windows)
            reference.write_reference(model, token_ids, ref_dir, window=lengths[-1])
        tokens = reference.baseline_comparison(ref_dir)
    else:
        tokens = reference.compare_tokens(model, ref_dir)
    info = reference.read_reference(ref_dir)
    contexts = token_contexts(reference.scoring_windows(info.n_tokens, info.window, info.stride))
    buckets = context_buckets(contexts, lengths)
    baseline = reference.TokenComparison.of_baseline(tokens.baseline_nll, tokens.windows)
    metrics = damage_by_context(tokens.kld, tokens.top1_match, contexts, lengths)
    tags = {LENGTHS_TAG: ",".join(map(str, lengths))}
    if (attention := kv_quantized_attention(model)) and not is_baseline:
        with kv_quantization_off(attention):
            without = reference.compare_tokens(model, ref_dir)
        on, off = by_bucket(tokens.documents(), buckets, lengths), by_bucket(without.documents(), buckets, lengths)
        metrics |= paired_metrics(off, on, KV_CACHE_PREFIX)
        twin = kv_cache_pairs(job.loaded.recipe.variants).get(job.variant)
        tags[KV_CACHE_TAG] = (
            "per token, this checkpoint with its K/V rounding on minus off (compressed-tensors' quantization_enabled "
            "on the attention modules): off, it computes what "
            + (
                f"the recipe's {twin} computes (its twin without a quantized KV cache)"
                if twin
                else "its method alone does"
            )
        )
    documents = by_bucket(tokens.documents(), buckets, lengths)
    return ContextDamage(metrics, documents, by_bucket(baseline.documents(), buckets, lengths), tags)


def by_bucket(
    documents: Mapping[str, DocumentScores], buckets: np.ndarray, lengths: tuple[int, ...]
) -> dict[str, DocumentScores]:
    """The per-token figures of PAIRED_FIGURES restricted to each context bucket's tokens, as quality/<figure>/ctx<L>."""
    found: dict[str, DocumentScores] = {}
    for index, length in enumerate(lengths):
        members = set(np.flatnonzero(buckets == index).tolist())
        if not members:
            continue
        for key in PAIRED_FIGURES:
            scores = documents[key]
            found[f"{key}/ctx{length}"] = DocumentScores(
                scores.aggregation,
                {token: value for token, value in scores.values.items() if token in members},
                {token: value for token, value in scores.weights.items() if token in members},
                {token: value for token, value in scores.clusters.items() if token in members},
            )
    return found


def paired_metrics(
    reference_scores: Mapping[str, DocumentScores], scores: Mapping[str, DocumentScores], prefix: str
) -> dict[str, float]:
    """<prefix><key>/<statistic>: `scores` minus `reference_scores`, per token, for every key both have."""
    figures: dict[str, float] = {}
    for key in scores.keys() & reference_scores.keys():
        comparison = compare(key, reference_scores[key], scores[key])  # the same tokens and windows by construction
        figures |= {paired_key(key, name, prefix): value for name, value in comparison.statistics().items()}
    return figures


def kv_quantized_attention(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules whose K/V compressed-tensors rounds as the model runs (a checkpoint with a
    kv_cache_scheme, loaded by transformers): a `kv_cache` hook module and a scheme for its input activations."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "kv_cache")
        and getattr(getattr(module, "quantization_scheme", None), "input_activations", None)
    ]


@contextmanager
def kv_quantization_off(attention: list[torch.nn.Module]) -> Iterator[None]:
    """K/V passed through unrounded inside (compressed-tensors' QuantizedKVCache reads `quantization_enabled`)."""
    before = [getattr(module, "quantization_enabled", True) for module in attention]
    for module in attention:
        module.quantization_enabled = False
    try:
        yield
    finally:
        for module, enabled in zip(attention, before):
            module.quantization_enabled = enabled
