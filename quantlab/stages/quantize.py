"""The quantize stage of a variant: reuse a cached checkpoint or make one."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quantlab import cache
from quantlab.models import ModelSource, load_source_model
from quantlab.quantize import METHODS
from quantlab.stages.calibration import calibration_dataset

if TYPE_CHECKING:
    from quantlab.recipe import CalibrationSettings, VariantSpec


@dataclass(frozen=True)
class QuantizedCheckpoint:
    path: Path
    key: str
    reused: bool


def checkpoint_identity(source: ModelSource, variant: VariantSpec, calibration: CalibrationSettings) -> dict:
    """Everything that decides the checkpoint's bytes, and nothing that does not (e.g. its name)."""
    return {
        "model": source.identity,
        "method": variant.method,
        "params": variant.params.model_dump(),
        "calibration": calibration.model_dump() if METHODS[variant.method].needs_calibration else None,
        "versions": cache.library_versions(),
    }


def quantize_variant(
    source: ModelSource,
    variant: VariantSpec,
    calibration: CalibrationSettings,
    recipe_dir: Path,
    cache_root: Path,
    device: str,
    force: bool = False,
) -> QuantizedCheckpoint:
    import torch

    identity = checkpoint_identity(source, variant, calibration)
    key = cache.cache_key(identity)
    target = cache.checkpoint_dir(cache_root, variant.name, key)
    if force:
        shutil.rmtree(target, ignore_errors=True)
    if cache.is_complete(target):
        return QuantizedCheckpoint(target, key, reused=True)

    method = METHODS[variant.method]
    # CPUs without native BF16 matmuls emulate them ~10x slower (AWQ's grid search takes most
    # of an hour for 135M params): calibrate in float32 there (an exact upcast of BF16 weights),
    # then store what the method leaves unquantized as BF16, as on a GPU.
    compute_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tokenizer = load_source_model(source, compute_dtype, device)
    samples = calibration_dataset(calibration, tokenizer, recipe_dir) if method.needs_calibration else None
    method.apply(model, variant.params, samples)
    model.to(torch.bfloat16)
    with cache.writing(target, identity) as scratch:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
    del model
    release_quantizer_memory()
    return QuantizedCheckpoint(target, key, reused=False)


def release_quantizer_memory() -> None:
    """Give back what quantizing held: llm-compressor's global session keeps the last model it
    compressed, which would otherwise stay resident (on the GPU, too) and count in the variant's peak."""
    import gc
    import sys

    if "llmcompressor" in sys.modules:
        from llmcompressor.core import reset_session

        reset_session()
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
