"""FP8_DYNAMIC: per-channel FP8 (E4M3) weights, dynamic per-token FP8 activations; data-free."""

from __future__ import annotations

from pydantic import Field

from quantlab.quantize.base import Method, MethodParams


class Fp8(Method):
    class Params(MethodParams):
        ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="Modules kept in BF16.")

    @staticmethod
    def apply(model, params: Params, calibration) -> None:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier

        recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=list(params.ignore))
        oneshot(model=model, recipe=recipe)
