"""The baseline: the model's weights in bfloat16, saved as they are."""

from quantlab.quantize.base import Method


class Bf16(Method):
    @staticmethod
    def linear_bytes(weights, params) -> int:
        return 2 * weights.linear_weights

    @staticmethod
    def apply(model, params, calibration) -> None:
        """Nothing to do: the quantize stage stores what a method leaves unquantized in BF16."""
