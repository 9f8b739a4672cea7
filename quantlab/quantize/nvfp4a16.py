"""NVFP4A16: NVFP4's weights (FP4 E2M1 in groups of 16, FP8 scales, an FP32 global scale per tensor), activations
left in BF16; data-free (the weights' global scale is their own maximum)."""

from __future__ import annotations

from typing import ClassVar

from quantlab.quantize.base import PresetMethod
from quantlab.quantize.nvfp4 import Nvfp4


class Nvfp4A16(PresetMethod):
    preset: ClassVar[str] = "NVFP4A16"
    rounding_is_the_method: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "NVFP4A16"
    linear_bytes = Nvfp4.linear_bytes
    check_model = Nvfp4.check_model
