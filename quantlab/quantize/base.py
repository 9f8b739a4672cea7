"""What a quantization method provides. One file per method; the registry is in __init__."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class CalibrationSet:
    """What a calibrating method runs through the model, and how many samples per forward pass."""

    samples: Dataset
    batch_size: int


class MethodParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Method:
    """The base of every method; its defaults suit a data-free method without parameters that fits any model."""

    Params: ClassVar[type[MethodParams]] = MethodParams
    needs_calibration: ClassVar[bool] = False
    # Whether `rounded` is all that `apply` does (a data-free method): then its own checkpoint serves both.
    rounding_is_the_method: ClassVar[bool] = False
    # The compressed-tensors format of the stored weights (its preset's name), None when nothing is quantized:
    # what a serving engine looks up to say which kernel runs the checkpoint (quantlab.serving.engines).
    stored_format: ClassVar[str | None] = None

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
    def check_model(params: Params, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        # A group would straddle two rows of a layer whose input width it does not divide.
        misfits = sorted({width for width in linear_widths.values() if width % params.group_size})
        if not misfits:
            return []
        example = next(name for name, width in linear_widths.items() if width == misfits[0])
        common = math.gcd(*linear_widths.values())
        divisor = min(common & -common, 1024)  # the largest power of two dividing every width, at most 1024
        message = f"(widths {misfits}, e.g. {example}); pick a divisor such as {divisor}"
        return [("group_size", f"{params.group_size} does not divide the input width of every linear layer {message}")]

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
