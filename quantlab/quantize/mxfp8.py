"""MXFP8 (OCP microscaling, W8A8): FP8 (E4M3) weights and activations in groups of 32 sharing a power-of-two (E8M0)
scale; activations scaled dynamically, so data-free."""

from __future__ import annotations

from typing import ClassVar

from quantlab.quantize.base import PresetMethod, Served, Support, divides_widths, per_group_bytes
from quantlab.quantize.mxfp4 import GROUP


class Mxfp8(PresetMethod):
    preset: ClassVar[str] = "MXFP8"
    rounding_is_the_method: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "MXFP8"
    served: ClassVar[Served] = {
        # vLLM 0.32's CPU build has no MXFP8 kernel.
        "vllm": {
            "cuda": Support(
                "FlashInfer CUTLASS / CuteDSL MXFP8 on Blackwell (SM >= 100); MarlinMxfp8LinearKernel (weight-only) "
                "elsewhere",
                "below Blackwell vLLM keeps BF16 activations (Marlin) or emulates MXFP8 in BF16",
                served_as="MXFP8A16 (weight-only) below Blackwell",
            ),
        },
    }

    @staticmethod
    def linear_bytes(weights, params) -> int:
        """One FP8 byte per weight and a one-byte E8M0 scale per 32 inputs: 8.25 bits per weight."""
        return per_group_bytes(weights, 1, GROUP, 1)

    @staticmethod
    def check_model(params, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        return divides_widths("ignore", GROUP, linear_widths, fixed="MXFP8")
