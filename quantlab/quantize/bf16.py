"""The baseline: the model's weights in bfloat16, saved as they are."""

from __future__ import annotations

from typing import ClassVar

from quantlab.quantize.base import MethodParams


class Bf16:
    class Params(MethodParams):
        pass

    needs_calibration: ClassVar[bool] = False
    summary: ClassVar[str] = "BF16 weights, no quantization (the baseline)"

    @staticmethod
    def check_model(params: Params, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        return []

    @staticmethod
    def apply(model, params: Params, calibration) -> None:
        import torch

        model.to(torch.bfloat16)
