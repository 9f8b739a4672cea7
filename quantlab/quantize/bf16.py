"""The baseline: the model's weights in bfloat16, saved as they are."""

from typing import ClassVar

from quantlab.quantize.base import Method, Served, Support


class Bf16(Method):
    served: ClassVar[Served] = {
        "vllm": {"cpu": Support("unquantized (oneDNN / torch linear)"), "cuda": Support("unquantized (cuBLAS)")},
    }

    @staticmethod
    def linear_bytes(weights, params) -> int:
        return 2 * weights.linear_weights

    @staticmethod
    def apply(model, params, calibration) -> None:
        """Nothing to do: the quantize stage stores what a method leaves unquantized in BF16."""
