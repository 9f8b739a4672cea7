"""AWQ + W4A16: activation-aware scaling, then group-wise INT4 weights (llm-compressor)."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import ClassVar, Literal
from unittest.mock import patch

from pydantic import Field

from quantlab.quantize.base import Method, MethodParams


class AwqInt4(Method):
    class Params(MethodParams):
        group_size: int = Field(
            128, gt=0, description="Input channels sharing one scale; must divide every layer's input width."
        )
        symmetric: bool = Field(True, description="Symmetric (no zero point) or asymmetric INT4.")
        duo_scaling: bool | Literal["both"] = Field(True, description="AWQ scale search uses weights and activations.")
        ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="Modules kept in BF16.")

    needs_calibration: ClassVar[bool] = True

    @staticmethod
    def check_model(params: Params, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        misfits = sorted({width for width in linear_widths.values() if width % params.group_size})
        if not misfits:
            return []
        example = next(name for name, width in linear_widths.items() if width == misfits[0])
        common = math.gcd(*linear_widths.values())
        divisor = min(common & -common, 1024)  # the largest power of two dividing every width, at most 1024
        message = f"(widths {misfits}, e.g. {example}); pick a divisor such as {divisor}"
        return [("group_size", f"{params.group_size} does not divide the input width of every linear layer {message}")]

    @staticmethod
    def apply(model, params: Params, calibration) -> None:
        import torch
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier
        from llmcompressor.pipelines.cache import IntermediatesCache

        weights = QuantizationArgs(
            num_bits=4, type="int", symmetric=params.symmetric, strategy="group", group_size=params.group_size
        )
        recipe = [
            AWQModifier(duo_scaling=params.duo_scaling),
            QuantizationModifier(
                config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                ignore=list(params.ignore),
            ),
        ]
        # llm-compressor 0.14's AWQ pins cached activations to speed copies to an accelerator; with none,
        # `Tensor.pin_memory()` raises ("Cannot access accelerator device..."), so pinning is skipped.
        unpinned = patch.object(IntermediatesCache, "pin_memory", lambda self, batch_index, input_names=None: None)
        with nullcontext() if torch.accelerator.is_available() else unpinned:
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
