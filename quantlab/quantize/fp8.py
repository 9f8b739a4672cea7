"""FP8_DYNAMIC: per-channel FP8 (E4M3) weights, dynamic per-token FP8 activations; data-free."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from quantlab.quantize.base import Method, MethodParams


class Fp8(Method):
    class Params(MethodParams):
        ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="Modules kept in BF16.")

    rounding_is_the_method: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "FP8_DYNAMIC"

    @staticmethod
    def rounded(params: Params) -> list:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=list(params.ignore))]

    @staticmethod
    def apply(model, params: Params, calibration) -> None:
        from llmcompressor import oneshot

        oneshot(model=model, recipe=Fp8.rounded(params))
