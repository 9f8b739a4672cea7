"""What a quantization method provides. One file per method; the registry is in __init__."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedModel

    from quantlab.measure.modeled import WeightCounts


@dataclass(frozen=True)
class CalibrationSet:
    """What a calibrating method runs through the model, and how many samples per forward pass."""

    samples: Dataset
    batch_size: int


class MethodParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def divides_widths(field: str, size: int, linear_widths: dict[str, int], fixed: str = "") -> list[tuple[str, str]]:
    """(field, message) when `size` (a group or block of input channels) does not divide every layer's input
    width: a group would straddle two rows of such a layer. `fixed`: the format's own name when its size is not a
    parameter (then the way out is to keep those layers in BF16)."""
    misfits = sorted({width for width in linear_widths.values() if width % size})
    if not misfits:
        return []
    example = next(name for name, width in linear_widths.items() if width == misfits[0])
    if fixed:
        return [
            (
                field,
                f"{fixed}'s groups of {size} do not divide the input widths {misfits} (e.g. {example}): list "
                "those layers in ignore",
            )
        ]
    common = math.gcd(*linear_widths.values())
    divisor = min(common & -common, 1024)  # the largest power of two dividing every width, at most 1024
    message = f"(widths {misfits}, e.g. {example}); pick a divisor such as {divisor}"
    return [(field, f"{size} does not divide the input width of every linear layer {message}")]


def per_channel_bytes(weights: WeightCounts, element_bytes: float) -> int:
    """`element_bytes` per weight and a BF16 scale per output channel (per-token activations store nothing)."""
    return int(element_bytes * weights.linear_weights) + 2 * weights.linear_outputs


def per_group_bytes(weights: WeightCounts, element_bytes: float, group: int, scale_bytes: int) -> int:
    """`element_bytes` per weight and a `scale_bytes` scale per `group` consecutive input channels."""
    return int(element_bytes * weights.linear_weights) + scale_bytes * (weights.linear_weights // group)


class Method:
    """The base of every method; its defaults suit a data-free method without parameters that fits any model."""

    Params: ClassVar[type[MethodParams]] = MethodParams
    needs_calibration: ClassVar[bool] = False
    # Whether `rounded` is all that `apply` does (a data-free method): then its own checkpoint serves both.
    rounding_is_the_method: ClassVar[bool] = False
    # The compressed-tensors format of the stored weights (its preset's name), None when nothing is quantized:
    # what a serving engine looks up to say which kernel runs the checkpoint (`Engine.formats`).
    stored_format: ClassVar[str | None] = None

    @staticmethod
    def linear_bytes(weights: WeightCounts, params: Mapping[str, Any]) -> int | None:
        """Stored bytes of the decoder blocks' linear weights (scales and packing included) for these params, as
        compressed-tensors writes them (what the disk check models); None: not modeled, counted as BF16."""
        return None

    @staticmethod
    def check_model(params: MethodParams, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        """(param field, message) for each way these params cannot apply to this model's layers."""
        return []

    @staticmethod
    def apply(model: PreTrainedModel, params: MethodParams, calibration: CalibrationSet | None) -> None:
        """Quantize `model` in place, ready for `save_pretrained(..., save_compressed=True)`."""
        raise NotImplementedError

    @staticmethod
    def rounded(params: MethodParams) -> list[Any] | None:
        """llm-compressor modifiers storing this method's format by round-to-nearest, data-free: no calibration,
        no smoothing. What `quantlab sensitivity` ranks layers with, quickly; None when nothing is quantized."""
        return None


class GroupwiseInt4(Method):
    """W4A16 by some calibrating algorithm: group-wise INT4 weights in compressed-tensors' pack-quantized format."""

    class Params(MethodParams):
        group_size: int = Field(
            128, gt=0, description="Input channels sharing one scale; must divide every layer's input width."
        )
        symmetric: bool = Field(True, description="Symmetric (no zero point) or asymmetric INT4.")
        ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="Modules kept in BF16.")

    needs_calibration: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "W4A16"

    @staticmethod
    def linear_bytes(weights: WeightCounts, params: Mapping[str, Any]) -> int:
        """Pack-quantized, AWQ's and GPTQ's alike (neither GPTQ ordering left in compressed-tensors 0.19 stores a
        g_idx): eight INT4 weights per int32, a BF16 scale per group of inputs, with `symmetric: false` an INT4 zero
        point per group (packed along the outputs), a 2-element int64 shape per layer."""
        linear, group = weights.linear_weights, params.get("group_size", 128)
        zero_points = 0 if params.get("symmetric", True) else linear // (2 * group)
        return linear // 2 + 2 * linear // group + zero_points + 16 * 7 * weights.layers

    @staticmethod
    def check_model(params: Params, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        return divides_widths("group_size", params.group_size, linear_widths)

    @staticmethod
    def int4_groups(params: Params) -> dict[str, Any]:
        """llm-compressor's `config_groups` for these params: every Linear layer not ignored."""
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        weights = QuantizationArgs(
            num_bits=4, type="int", symmetric=params.symmetric, strategy="group", group_size=params.group_size
        )
        return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}

    @staticmethod
    def rounded(params: Params) -> list[Any]:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return [QuantizationModifier(config_groups=GroupwiseInt4.int4_groups(params), ignore=list(params.ignore))]


def calibrated_oneshot(model: PreTrainedModel, recipe: Any, calibration: CalibrationSet | None) -> None:
    """llm-compressor's oneshot of `recipe` over the recipe's calibration samples, in the recipe's batches."""
    from llmcompressor import oneshot

    if calibration is None:
        raise ValueError("this method calibrates: it needs the recipe's calibration samples")
    oneshot(
        model=model,
        recipe=recipe,
        dataset=calibration.samples,
        num_calibration_samples=len(calibration.samples),
        max_seq_length=len(calibration.samples[0]["input_ids"]),
        batch_size=calibration.batch_size,
        # The samples are already drawn at random (seeded). llm-compressor's own shuffle draws
        # from torch's unseeded generator: the order moved AWQ's float sums, so its chosen
        # scales, from one run to the next (KL 0.2144 and 0.2127 for one recipe and seed).
        shuffle_calibration_samples=False,
    )


class PresetMethod(Method):
    """A compressed-tensors preset (`preset`, by its name in compressed-tensors' PRESET_SCHEMES) on every Linear
    layer not ignored, by llm-compressor's QuantizationModifier: round-to-nearest, with the recipe's calibration
    samples run through the model first when the preset has static activation scales to observe."""

    class Params(MethodParams):
        ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="Modules kept in BF16.")

    preset: ClassVar[str]

    @classmethod
    def scheme(cls, params: MethodParams) -> Any:
        """The preset's name, or its QuantizationScheme with what `params` change in it."""
        return cls.preset

    @classmethod
    def rounded(cls, params: Params) -> list[Any]:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        scheme, ignore = cls.scheme(params), list(params.ignore)
        if isinstance(scheme, str):
            return [QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)]
        return [QuantizationModifier(config_groups={"group_0": scheme}, ignore=ignore)]

    @classmethod
    def apply(cls, model: PreTrainedModel, params: MethodParams, calibration: CalibrationSet | None) -> None:
        if cls.needs_calibration:
            calibrated_oneshot(model, cls.rounded(params), calibration)
        else:
            from llmcompressor import oneshot

            oneshot(model=model, recipe=cls.rounded(params))


def preset_scheme(name: str) -> Any:
    """compressed-tensors' preset `name` as a QuantizationScheme on Linear layers, to change before use."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(name, ["Linear"])
