"""The baseline: the model's weights in bfloat16, saved as they are."""

from __future__ import annotations

from typing import ClassVar

from quantlab.quantize.base import Method, MethodParams


class Bf16(Method):
    class Params(MethodParams):
        pass

    summary: ClassVar[str] = "BF16 weights, no quantization (the baseline)"

    @staticmethod
    def apply(model, params: Params, calibration) -> None:
        """Nothing to do: the quantize stage stores what a method leaves unquantized in BF16."""
