"""MXFP8 (OCP microscaling, W8A8): FP8 (E4M3) weights and activations in groups of 32 sharing a power-of-two (E8M0)
scale; activations scaled dynamically, so data-free."""

from __future__ import annotations

from typing import ClassVar

from quantlab.quantize.base import PresetMethod, divides_widths, per_group_bytes
from quantlab.quantize.mxfp4 import GROUP


class Mxfp8(PresetMethod):
    preset: ClassVar[str] = "MXFP8"
    rounding_is_the_method: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "MXFP8"

    @staticmethod
    def linear_bytes(weights, params) -> int:
        """One FP8 byte per weight and a one-byte E8M0 scale per 32 inputs: 8.25 bits per weight."""
        return per_group_bytes(weights, 1, GROUP, 1)

    @staticmethod
    def check_model(params, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        return divides_widths("ignore", GROUP, linear_widths, fixed="MXFP8")
