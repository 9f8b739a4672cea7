"""NVFP4 (W4A4): FP4 (E2M1) weights and activations in groups of 16 with an FP8 (E4M3) scale each, under one FP32
global scale per tensor; the activations' global scales are observed on the calibration samples."""

from __future__ import annotations

from typing import ClassVar

from quantlab.quantize.base import PresetMethod, divides_widths, per_group_bytes

GROUP = 16  # compressed-tensors' NVFP4 preset


class Nvfp4(PresetMethod):
    preset: ClassVar[str] = "NVFP4"
    needs_calibration: ClassVar[bool] = True  # input_global_scale: a static observer over calibration activations
    stored_format: ClassVar[str | None] = "NVFP4"

    @staticmethod
    def linear_bytes(weights, params) -> int:
        """Two FP4 weights per byte, an FP8 scale per 16 inputs, an FP32 global scale per layer (the activations'
        FP32 global scale is not a weight)."""
        return per_group_bytes(weights, 0.5, GROUP, 1) + 4 * 7 * weights.layers

    @staticmethod
    def check_model(params, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        return divides_widths("ignore", GROUP, linear_widths, fixed="NVFP4")
