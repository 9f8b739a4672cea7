"""MXFP4 (OCP microscaling, W4A4): FP4 (E2M1) weights and activations in groups of 32 sharing a power-of-two (E8M0)
scale; activations scaled dynamically, so data-free."""

from __future__ import annotations

from typing import ClassVar

from quantlab.quantize.base import PresetMethod, divides_widths, per_group_bytes

GROUP = 32  # the OCP MX block


class Mxfp4(PresetMethod):
    preset: ClassVar[str] = "MXFP4"
    rounding_is_the_method: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "MXFP4"

    @staticmethod
    def linear_bytes(weights, params) -> int:
        """Two FP4 weights per byte and a one-byte E8M0 scale per 32 inputs: 4.25 bits per weight."""
        return per_group_bytes(weights, 0.5, GROUP, 1)

    @staticmethod
    def check_model(params, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        return divides_widths("ignore", GROUP, linear_widths, fixed="MXFP4")
