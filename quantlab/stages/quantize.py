"""The quantize stage of a variant: reuse a cached checkpoint or make one."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quantlab import cache, disk
from quantlab.models import ModelSource, checkpoint_identity, default_dtype, load_source_model
from quantlab.quantize import METHODS
from quantlab.quantize.kv_cache import quantize_kv_cache
from quantlab.stages.calibration import calibration_dataset

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from quantlab.recipe import CalibrationSettings, VariantSpec


@dataclass(frozen=True)
class QuantizedCheckpoint:
    path: Path
    key: str
    reused: bool

    def check_payload(self) -> cache.PayloadCheck:
        """A reused checkpoint's files hashed against their record in the background (`cache.PayloadCheck`);
        `confirm()` before anything measured on it is used. A checkpoint just made needs none."""
        return cache.PayloadCheck(self.path if self.reused else None)


def quantize_variant(
    source: ModelSource,
    variant: VariantSpec,
    calibration: CalibrationSettings | None,
    recipe_dir: Path,
    cache_root: Path,
    device: str,
    force: bool = False,
    follow: Callable[[PreTrainedModel], None] = lambda model: None,
) -> QuantizedCheckpoint:
    """The variant's checkpoint, reused from the cache or made; `follow` is given the model it calibrates (the
    runner's: its forward passes share the host's cores, `host_share.HostShare.follow`)."""
    method = METHODS[variant.method]

    def apply(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        follow(model)
        samples = calibration_dataset(calibration, tokenizer, recipe_dir) if variant.needs_calibration else None
        method.apply(model, variant.params, samples if method.needs_calibration else None)
        if variant.kv_cache is not None:
            quantize_kv_cache(model, variant.kv_cache.strategy, samples)

    identity = checkpoint_identity(source, variant, calibration)
    return _cached_checkpoint(source, variant, identity, variant.name, apply, cache_root, device, force)


def rounded_identity(source: ModelSource, variant: VariantSpec) -> dict:
    """What decides `rounded_variant`'s bytes: the variant's own identity when rounding is all its method does."""
    identity = checkpoint_identity(source, variant, None)
    return identity if METHODS[variant.method].rounding_is_the_method else identity | {"rounded": True}


def rounded_variant(source: ModelSource, variant: VariantSpec, cache_root: Path, device: str) -> QuantizedCheckpoint:
    """The variant's format by round-to-nearest, without its calibration or smoothing (`Method.rounded`): the
    variant's own checkpoint when that is all its method does."""
    method = METHODS[variant.method]
    modifiers = method.rounded(variant.params)
    if modifiers is None:
        raise ValueError(f"method {variant.method} quantizes nothing")
    if method.rounding_is_the_method:
        return quantize_variant(source, variant, None, Path(), cache_root, device)

    def apply(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        from llmcompressor import oneshot

        oneshot(model=model, recipe=modifiers)

    identity = rounded_identity(source, variant)
    return _cached_checkpoint(source, variant, identity, f"{variant.name}-rounded", apply, cache_root, device, False)


def _cached_checkpoint(
    source: ModelSource,
    variant: VariantSpec,
    identity: dict,
    name: str,
    apply: Callable[[PreTrainedModel, PreTrainedTokenizerBase], None],
    cache_root: Path,
    device: str,
    force: bool,
) -> QuantizedCheckpoint:
    key = cache.cache_key(identity)
    target = cache.checkpoint_dir(cache_root, name, key)
    if not force and cache.is_complete(target):
        return QuantizedCheckpoint(target, key, reused=True)
    # One process at a time builds a key: another sweep's variant that needs it waits here, then reuses it.
    with cache.building(target):
        if force:
            shutil.rmtree(target, ignore_errors=True)
        elif cache.is_complete(target):
            return QuantizedCheckpoint(target, key, reused=True)
        if (shape := disk.model_shape(source)) is not None:  # before loading the model
            tensor_bytes = disk.checkpoint_bytes(shape, variant.method, variant.params.model_dump())
            disk.require([disk.Need(target.parent, disk.with_margin(tensor_bytes), f"the {name} checkpoint")])
        _build(source, apply, target, identity, device)
    release_quantizer_memory()
    return QuantizedCheckpoint(target, key, reused=False)


def _build(
    source: ModelSource,
    apply: Callable[[PreTrainedModel, PreTrainedTokenizerBase], None],
    target: Path,
    identity: dict,
    device: str,
) -> None:
    import torch

    # CPUs without BF16 matmul instructions emulate them many times slower (AWQ's grid search would
    # take most of an hour for a 135M model): calibrate in float32 there (an exact upcast of BF16 weights),
    # then store what the method leaves unquantized as BF16, as on a GPU.
    compute_dtype = default_dtype(device)
    model, tokenizer = load_source_model(source, compute_dtype, device)
    apply(model, tokenizer)
    # compressed-tensors keeps NVFP4's global scales in float32 (as vLLM loads them): only the rest goes to BF16.
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.dtype == torch.float32 and not name.endswith("global_scale"):
            tensor.data = tensor.data.to(torch.bfloat16)
    with cache.writing(target, identity) as scratch:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)


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
