"""W8A8 INT8: SmoothQuant moves activation outliers into the weights, then per-channel INT8 weights (GPTQ, or
round-to-nearest) and dynamic per-token INT8 activations, as llm-compressor's quantization_w8a8_int8 examples."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from quantlab.quantize.base import Method, MethodParams, calibrated_oneshot, per_channel_bytes


class Int8(Method):
    class Params(MethodParams):
        smoothing_strength: float = Field(
            0.8,
            gt=0,
            le=1,
            description="SmoothQuant's alpha: how much of the activations' range moves into the weights.",
        )
        rtn: bool = Field(False, description="Round the weights to nearest instead of GPTQ (faster, less accurate).")
        ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="Modules kept in BF16.")

    needs_calibration: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "W8A8"

    @staticmethod
    def linear_bytes(weights, params) -> int:
        """One INT8 byte per weight and a BF16 scale per output channel."""
        return per_channel_bytes(weights, 1)

    @staticmethod
    def rounded(params: Params) -> list:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return [QuantizationModifier(targets="Linear", scheme="W8A8", ignore=list(params.ignore))]

    @staticmethod
    def apply(model, params: Params, calibration) -> None:
        from llmcompressor.modifiers.gptq import GPTQModifier
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        weights = (
            Int8.rounded(params)
            if params.rtn
            else [GPTQModifier(targets="Linear", scheme="W8A8", ignore=list(params.ignore))]
        )
        recipe = [SmoothQuantModifier(smoothing_strength=params.smoothing_strength), *weights]
        calibrated_oneshot(model, recipe, calibration)
